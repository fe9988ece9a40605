//! EXPLAIN ANALYZE: a plan executed with counting on ([`crate::Engine::execute_analyze`]),
//! printed against what the plan said it would read: per request and zone, planned and
//! actual rows, bytes from the access method's memory and blocks per tier, and the time of
//! the zone's tasks.

use crate::exec::{RequestActual, ZoneActual};
use crate::plan::{human_bytes, Plan, RequestPlan, Strategy};
use std::fmt::Write;
use std::time::Duration;

/// What executing a plan actually read and cost (serialized with `wall` in microseconds, as
/// `wall_us`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Analysis {
    /// Per request of the plan, in order.
    pub requests: Vec<RequestActual>,
    /// Wall time of the whole execution.
    #[serde(rename = "wall_us", serialize_with = "crate::exec::micros")]
    pub wall: Duration,
    /// Device time of the device-selected steps, from a mark before the first launch to one
    /// after the last (`Engine::execute_gpu_analyze`); `None` when none ran or they could
    /// not be timed together (several head dimensions).
    #[serde(rename = "device_us", serialize_with = "crate::exec::micros_opt")]
    pub device_time: Option<Duration>,
}

/// What a request's plan says each zone reads, summed over KV heads and selections (the
/// executor's units: a steady or retrieved row is counted once per KV head or selection
/// that attends it; estimation counts clusters). `None` where the plan does not know
/// (a device-selected plan chooses on the device).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PlannedRows {
    /// Rows attended exactly in one pass or as a scan (exact plans), or the steady zone.
    pub steady: u64,
    /// Retrieved rows.
    pub retrieve: u64,
    /// Estimated clusters.
    pub estimate: u64,
}

impl PlannedRows {
    /// The planned rows of `r`, or `None` for a device-selected plan.
    pub fn of(r: &RequestPlan) -> Option<Self> {
        if r.device.is_some() {
            return None;
        }
        let mut p = Self::default();
        for h in &r.heads {
            if h.exact {
                p.steady += r.tokens as u64;
                continue;
            }
            p.steady += h.steady_tokens as u64;
            for sel in &h.selections {
                p.retrieve += sel.retrieve_tokens as u64;
                p.estimate += sel.estimate.len() as u64;
            }
        }
        Some(p)
    }
}

impl Analysis {
    /// EXPLAIN ANALYZE of `plan` (the plan these counts came from): one line per zone with
    /// planned and actual rows, where the bytes came from, and time.
    pub fn explain(&self, plan: &Plan) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "EXPLAIN ANALYZE  budget: {}  ({} request(s), executed in {}{})",
            plan.budget.describe(),
            plan.requests.len(),
            ms(self.wall),
            self.device_time.map_or(String::new(), |d| format!("; device-selected steps {} on the device", ms(d)))
        );
        for (i, (r, a)) in plan.requests.iter().zip(&self.requests).enumerate() {
            let strategy = match &r.strategy {
                Strategy::Exact { reason } => format!("exact — {reason}"),
                Strategy::Sparse { .. } if r.device.is_some() => "sparse, selected on the device".into(),
                Strategy::Sparse { .. } => "sparse".into(),
            };
            let _ = writeln!(
                s,
                "Request {i}: {} layer {} · {} · {} tokens · {} kv heads · {strategy}",
                r.context, r.layer, r.method, r.tokens, r.shape.kv_heads
            );
            let planned = PlannedRows::of(r);
            let pick = |f: fn(&PlannedRows) -> u64| planned.as_ref().map(f);
            let steady = merge(&a.steady, &a.scan);
            zone_line(&mut s, "├─", "Exact/steady", pick(|p| p.steady), &steady, "rows");
            zone_line(&mut s, "├─", "Retrieve", pick(|p| p.retrieve), &a.retrieve, "rows");
            zone_line(&mut s, "└─", "Estimate", pick(|p| p.estimate), &a.estimate, "clusters");
            let planned_tiers = r.cost.tier_blocks;
            if r.cost.buffered {
                let _ = writeln!(
                    s,
                    "   retrieve blocks planned (looked up) gpu {} host {} disk {} · actual gpu {} host {} disk {}",
                    planned_tiers[0],
                    planned_tiers[1],
                    planned_tiers[2],
                    a.retrieve.blocks[0],
                    a.retrieve.blocks[1],
                    a.retrieve.blocks[2]
                );
            }
        }
        s
    }
}

/// Two zones' counts added.
fn merge(a: &ZoneActual, b: &ZoneActual) -> ZoneActual {
    let add3 = |x: [u64; 3], y: [u64; 3]| [x[0] + y[0], x[1] + y[1], x[2] + y[2]];
    ZoneActual {
        rows: a.rows + b.rows,
        index_bytes: a.index_bytes + b.index_bytes,
        blocks: add3(a.blocks, b.blocks),
        block_bytes: add3(a.block_bytes, b.block_bytes),
        cpu_time: a.cpu_time + b.cpu_time,
        gpu_time: a.gpu_time + b.gpu_time,
    }
}

fn zone_line(s: &mut String, branch: &str, name: &str, planned: Option<u64>, a: &ZoneActual, unit: &str) {
    let planned = planned.map_or("—".to_string(), |p| p.to_string());
    let _ = writeln!(
        s,
        "  {branch} {name:<13} planned {planned:>9} {unit:<8} actual {:>9}   index {:>10}   blocks gpu {} host {} disk {} ({})   cpu {}{}",
        a.rows,
        human_bytes(a.index_bytes as usize),
        a.blocks[0],
        a.blocks[1],
        a.blocks[2],
        human_bytes(a.block_bytes.iter().sum::<u64>() as usize),
        ms(a.cpu_time),
        if a.gpu_time.is_zero() { String::new() } else { format!("   gpu {}", ms(a.gpu_time)) }
    );
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}
