//! The GPU executor (feature `cuda`): runs a plan's exactly attended rows on the GPU, reading
//! them where the buffer manager keeps them — Gpu-tier hits from device memory, the rest
//! zero-copy from the pinned, device-mapped Host arena — in one decode kernel launch per
//! request; the steady zone (a few dozen rows per head) and the estimation zone are computed
//! on the CPU (`AccessMethod::gpu_work`) and merged with the GPU's partials by log-sum-exp.
//!
//! Blocks are pinned (CPU latches) from before the launch until the results are back, so the
//! maintainer can neither evict nor overwrite a slot a kernel reads. Requests the GPU cannot
//! serve — rows not homed in the buffer manager, not f16, one selection per query head, a
//! block only on Disk, no GPU — run on the CPU executor; the result says how many ran where.

use std::collections::HashMap;
use std::sync::Arc;

use attnstore_buffer::{HostMemoryKind, Tier};
use attnstore_kernels::cuda::{GpuBackend, RowRef, SharedRows};
use attnstore_kernels::Partial;
use parking_lot::Mutex;
use rayon::prelude::*;

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::plan::{Plan, RequestPlan};

/// GPU backends per head dimension (each compiles its kernels once).
#[derive(Default)]
pub(crate) struct GpuExec {
    backends: Mutex<HashMap<usize, Arc<GpuBackend>>>,
}

impl GpuExec {
    fn backend(&self, head_dim: usize) -> Result<Arc<GpuBackend>> {
        let mut map = self.backends.lock();
        if let Some(b) = map.get(&head_dim) {
            return Ok(Arc::clone(b));
        }
        let b = Arc::new(GpuBackend::new(head_dim)?);
        map.insert(head_dim, Arc::clone(&b));
        Ok(b)
    }
}

/// Phase times of one GPU request, printed to stderr when `ATTNSTORE_GPU_TRACE` is set.
struct PhaseTrace {
    on: bool,
    last: std::time::Instant,
    phases: Vec<(&'static str, f64)>,
}

impl PhaseTrace {
    fn new() -> Self {
        Self {
            on: std::env::var_os("ATTNSTORE_GPU_TRACE").is_some(),
            last: std::time::Instant::now(),
            phases: Vec::new(),
        }
    }

    fn mark(&mut self, phase: &'static str) {
        if self.on {
            self.phases.push((phase, self.last.elapsed().as_secs_f64() * 1e6));
            self.last = std::time::Instant::now();
        }
    }

    fn print(&self) {
        if self.on {
            let parts: Vec<String> = self.phases.iter().map(|(p, us)| format!("{p} {us:.0}")).collect();
            eprintln!("gpu request (us): {}", parts.join(", "));
        }
    }
}

/// What [`Engine::execute_gpu`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GpuRun {
    /// Requests executed on the GPU.
    pub on_gpu: usize,
    /// Requests executed on the CPU (the GPU could not serve them).
    pub on_cpu: usize,
    /// Retrieved blocks read from the Gpu tier (device memory).
    pub gpu_blocks: usize,
    /// Retrieved blocks read zero-copy from the pinned Host arena.
    pub host_blocks: usize,
}

impl Engine {
    /// Runs `plan` like [`Engine::execute`], on the GPU for every request it can serve (see
    /// the module docs of `gpu.rs`), on the CPU for the others; outputs in request order.
    /// Needs [`EngineConfig::buffers`](crate::EngineConfig::buffers) on a machine where the
    /// buffer manager got pinned host memory; otherwise every request runs on the CPU.
    pub fn execute_gpu(&self, plan: &Plan) -> Result<(Vec<Vec<f32>>, GpuRun)> {
        let mut run = GpuRun::default();
        let mut outputs = Vec::with_capacity(plan.requests.len());
        for r in &plan.requests {
            match self.execute_request_gpu(r, &mut run)? {
                Some(out) => {
                    run.on_gpu += 1;
                    outputs.push(out);
                }
                None => {
                    run.on_cpu += 1;
                    let single =
                        Plan { budget: plan.budget, requests: vec![r.clone()], host_read_gbps: plan.host_read_gbps };
                    outputs.push(self.execute(&single)?.remove(0));
                }
            }
        }
        Ok((outputs, run))
    }

    /// One request on the GPU, or `None` when it must run on the CPU.
    fn execute_request_gpu(&self, r: &RequestPlan, run: &mut GpuRun) -> Result<Option<Vec<f32>>> {
        let mut trace = PhaseTrace::new();
        let Some(manager) = self.buffer_manager() else { return Ok(None) };
        let HostMemoryKind::Pinned { device_base: host_base } = manager.host_memory() else { return Ok(None) };
        let ctx = self.context(r.context)?;
        let layer = ctx.layers.get(r.layer).ok_or(Error::UnknownLayer {
            context: r.context,
            layer: r.layer,
            layers: ctx.layers.len(),
        })?;
        let guard = layer.read_recursive();
        crate::engine::check_fresh(r, &guard)?;
        let sh = r.shape;
        let (g, d) = (sh.group(), sh.head_dim);
        // Per KV head on rayon threads (the estimation partials are CPU work).
        let method = &guard.method;
        let works: Option<Vec<_>> = (0..sh.kv_heads)
            .into_par_iter()
            .map(|h| method.gpu_work(h, &r.queries[h * g * d..(h + 1) * g * d], &r.heads[h]))
            .collect();
        let Some(works) = works else { return Ok(None) };
        let works = works.into_iter().collect::<std::result::Result<Vec<_>, _>>()?;
        trace.mark("work");
        // Pin every block (CPU latches keep the maintainer off the slots the kernel reads).
        let reader = manager.reader();
        let locations: Vec<_> = works.iter().flat_map(|w| w.blocks.iter().map(|(l, _)| *l)).collect();
        let pins = reader.pin_all(&locations).into_iter().collect::<std::result::Result<Vec<_>, _>>()?;
        let per_block = works.first().map_or(1, |w| w.tokens_per_block);
        let stride = 2 * per_block;
        let mut lists: Vec<Vec<RowRef>> = Vec::with_capacity(sh.kv_heads);
        let mut pin_at = 0;
        for w in &works {
            let mut list = Vec::new();
            for &(_, n) in &w.blocks {
                let pin = &pins[pin_at];
                pin_at += 1;
                let Some(slot) = pin.slot() else { return Ok(None) }; // a Disk read: CPU
                let base = slot as usize * stride;
                match pin.tier() {
                    Tier::Gpu => {
                        run.gpu_blocks += 1;
                        list.extend((0..n as usize).map(|t| RowRef::Cache((base + t) as u32)));
                    }
                    _ => {
                        run.host_blocks += 1;
                        list.extend((0..n as usize).map(|t| RowRef::Kv((base + t) as u32)));
                    }
                }
            }
            lists.push(list);
        }
        trace.mark("pins+lists");
        let gpu = self.gpu.backend(d)?;
        let stats = manager.stats();
        trace.mark("backend+stats");
        let capacity = |t: Tier| stats.tier(t).map_or(0, |s| s.capacity_blocks);
        let row_bytes = (d * 2) as u64;
        let shift = per_block as u64 * row_bytes;
        let host_rows = capacity(Tier::Host) * stride;
        let host = SharedRows { keys: host_base, values: host_base + shift, rows: host_rows };
        let cache = manager.gpu_device_base().map(|b| SharedRows {
            keys: b,
            values: b + shift,
            rows: capacity(Tier::Gpu) * stride,
        });
        let mut parts: Vec<Partial> = (0..sh.q_heads).map(|_| Partial::empty(d)).collect();
        let retrieved = if lists.iter().any(|l| !l.is_empty()) {
            let cache_rows = cache.map_or(0, |c| c.rows);
            let mut job = gpu.prepare_refs(&sh, &r.queries, host_rows, Some(&lists), cache_rows)?;
            gpu.launch_shared(host, cache, &mut job)?;
            Some(job)
        } else {
            None
        };
        trace.mark("launch");

        if let Some(job) = &retrieved {
            for (p, got) in parts.iter_mut().zip(gpu.fetch_partials(job)?) {
                p.merge(&got);
            }
        }
        // The kernel is done: the blocks may move again.
        drop(pins);
        drop(reader);
        trace.mark("fetch");
        for (h, w) in works.iter().enumerate() {
            for (j, c) in w.cpu.iter().enumerate() {
                parts[h * g + j].merge(c);
            }
        }
        trace.mark("merge");
        trace.print();
        Ok(Some(parts.iter().flat_map(Partial::finish).collect()))
    }
}
