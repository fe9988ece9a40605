//! EXPLAIN: a plan printed like a database's — per request the strategy and why, then one
//! line per zone with clusters, tokens, blocks and bytes, then the estimated cost.

use crate::plan::{human_bytes, Plan, RequestPlan, Strategy};
use attnstore_index::HeadPlan;
use attnstore_kernels::Codec;
use std::fmt::Write;

/// The plan tree as [`Plan::explain`] prints it: one line per request and per zone.
impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.explain())
    }
}

impl Plan {
    /// The plan as text: zones, clusters, tokens, blocks and bytes per tier, estimated cost.
    pub fn explain(&self) -> String {
        self.render(false)
    }

    /// [`Plan::explain`] plus one line per KV head.
    pub fn explain_verbose(&self) -> String {
        self.render(true)
    }

    fn render(&self, verbose: bool) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "EXPLAIN  budget: {}  ({} request(s))", self.budget.describe(), self.requests.len());
        for (i, r) in self.requests.iter().enumerate() {
            self.render_request(&mut s, i, r, verbose);
        }
        s
    }

    fn render_request(&self, s: &mut String, i: usize, r: &RequestPlan, verbose: bool) {
        let sh = &r.shape;
        let _ = writeln!(
            s,
            "Request {i}: {} layer {} ({:?}) · {} · {} tokens · {} q heads / {} kv heads · d={} · {}",
            r.context,
            r.layer,
            r.kind,
            r.method,
            r.tokens,
            sh.q_heads,
            sh.kv_heads,
            sh.head_dim,
            codec_label(r.codec, sh.head_dim)
        );
        let c = &r.cost;
        let row = sh.head_dim * r.dtype.size_bytes();
        match &r.strategy {
            Strategy::Exact { reason } => {
                let _ = writeln!(s, "  strategy: exact — {reason}");
                let _ = writeln!(
                    s,
                    "  └─ Exact     {} tokens per kv head, all attended    bytes {}",
                    r.tokens,
                    human_bytes(c.kv_bytes)
                );
            }
            Strategy::Sparse { .. } if r.device.is_some() => render_device(s, r),
            Strategy::Sparse { zone } => {
                let q = sh.q_heads as f64;
                let per_q = |f: &dyn Fn(&attnstore_index::Selection) -> usize| -> f64 {
                    r.heads.iter().flat_map(|h| &h.selections).map(|sel| (f(sel) * sel.heads) as f64).sum::<f64>() / q
                };
                let pct = |t: f64| 100.0 * t / r.tokens.max(1) as f64;
                let kind = match r.method {
                    "flat" => "oracle top-k over true scores",
                    "pq" => "top-k over PQ-approximated scores (no estimation zone)",
                    _ => "tripartite",
                };
                let est = if zone.estimate_tokens == usize::MAX {
                    "rest".to_string()
                } else {
                    zone.estimate_tokens.to_string()
                };
                let _ = writeln!(
                    s,
                    "  strategy: sparse, {kind}; token budgets: retrieve {}, estimate {est}",
                    zone.retrieve_tokens
                );
                if let Some(why) = &r.host_planned {
                    let _ = writeln!(s, "  planned on the host, not the device: {why}");
                }
                let _ = writeln!(
                    s,
                    "  ├─ Steady    exact  {:>9} tokens per kv head ({} pending)              bytes {}",
                    c.steady_tokens,
                    c.pending_tokens,
                    human_bytes(sh.kv_heads * c.steady_tokens * 2 * row)
                );
                let rt = per_q(&|x| x.retrieve_tokens);
                let _ = writeln!(
                    s,
                    "  ├─ Retrieve  exact  {:>9.1} clusters, {:.0} tokens ({:.2}%) per q head   blocks gpu {} host {} disk {}{}   bytes {}",
                    per_q(&|x| x.retrieve_clusters),
                    rt,
                    pct(rt),
                    c.tier_blocks[0],
                    c.tier_blocks[1],
                    c.tier_blocks[2],
                    if c.buffered { " (looked up)" } else { " (estimated)" },
                    human_bytes(c.retrieve_bytes)
                );
                let et = per_q(&|x| x.estimate_tokens);
                let _ = writeln!(
                    s,
                    "  ├─ Estimate  meta   {:>9.1} clusters, {:.0} tokens ({:.2}%) per q head   bytes {}",
                    per_q(&|x| x.estimate.len()),
                    et,
                    pct(et),
                    human_bytes(c.estimate_clusters * row)
                );
                let dt = per_q(&|x| x.dropped_tokens);
                let _ = writeln!(
                    s,
                    "  ├─ Dropped          {:>9.1} clusters, {:.0} tokens ({:.2}%) per q head",
                    per_q(&|x| x.dropped_clusters),
                    dt,
                    pct(dt)
                );
                let _ = writeln!(
                    s,
                    "  ├─ Scoring   meta   {:>9} {} per kv head                               bytes {}",
                    c.scored / sh.kv_heads.max(1),
                    match r.method {
                        "flat" => "keys",
                        "pq" => "token codes",
                        _ => "centroids",
                    },
                    human_bytes(c.meta_bytes.saturating_sub(c.estimate_clusters * row))
                );
                if verbose {
                    for (h, head) in r.heads.iter().enumerate() {
                        render_head(s, h, head);
                    }
                }
            }
        }
        self.render_cost(s, r);
    }

    fn render_cost(&self, s: &mut String, r: &RequestPlan) {
        let c = &r.cost;
        let total = c.total_bytes();
        let _ = writeln!(
            s,
            "  └─ Cost      reads {} (gpu {}, host {}, disk {}) = {:.1}% of exact ({}); est. {:.2} ms at {} GB/s host reads",
            human_bytes(total),
            human_bytes(c.tier_bytes[0]),
            human_bytes(c.tier_bytes[1]),
            human_bytes(c.tier_bytes[2]),
            100.0 * total as f64 / c.exact_bytes.max(1) as f64,
            human_bytes(c.exact_bytes),
            total as f64 / (self.host_read_gbps * 1e6),
            self.host_read_gbps
        );
    }
}

/// The zones of a device-selected plan (`Engine::plan_gpu`), per KV head.
fn render_device(s: &mut String, r: &RequestPlan) {
    let Some(dev) = &r.device else { return };
    let (sh, c) = (&r.shape, &r.cost);
    let row = sh.head_dim * r.dtype.size_bytes();
    let pct = |t: usize| 100.0 * t as f64 / r.tokens.max(1) as f64;
    let _ = writeln!(
        s,
        "  strategy: sparse, tripartite, clusters chosen on the GPU at execution: top {} of {} per kv head by the group's best centroid score, every other cluster estimated",
        dev.clusters_per_head, dev.clusters
    );
    let _ = writeln!(
        s,
        "  ├─ Steady    exact  {:>9} tokens per kv head ({} pending), in device memory   bytes {}",
        c.steady_tokens,
        c.pending_tokens,
        human_bytes(sh.kv_heads * c.steady_tokens * 2 * row)
    );
    let _ = writeln!(
        s,
        "  ├─ Retrieve  exact  {:>9} clusters, ~{} tokens ({:.2}%) per kv head: Gpu-tier hits from device memory, misses zero-copy from the Host arena   bytes ~{}",
        dev.clusters_per_head,
        dev.retrieve_tokens,
        pct(dev.retrieve_tokens),
        human_bytes(c.retrieve_bytes)
    );
    let rest = dev.indexed_tokens - dev.retrieve_tokens;
    let _ = writeln!(
        s,
        "  ├─ Estimate  meta   {:>9} clusters, ~{} tokens ({:.2}%) per kv head   bytes {}",
        dev.clusters - dev.clusters_per_head,
        rest,
        pct(rest),
        human_bytes(c.estimate_clusters * row)
    );
    let _ = writeln!(
        s,
        "  ├─ Scoring   meta   {:>9} centroids per kv head, on the GPU                 bytes {}",
        dev.clusters,
        human_bytes(dev.clusters * sh.kv_heads * row)
    );
}

fn render_head(s: &mut String, h: usize, head: &HeadPlan) {
    for sel in &head.selections {
        let _ = writeln!(
            s,
            "  │   kv head {h} q {}..{}: retrieve {} clusters / {} tokens in {} spans, estimate {} clusters / {} tokens, drop {} clusters",
            sel.first_head,
            sel.first_head + sel.heads,
            sel.retrieve_clusters,
            sel.retrieve_tokens,
            sel.retrieve.len(),
            sel.estimate.len(),
            sel.estimate_tokens,
            sel.dropped_clusters
        );
    }
}

/// The codec as EXPLAIN names it: an encoded codec (`hack2`, `kv43`) with its stored bytes
/// per token and KV head (codes and metadata) and their share of f16's.
fn codec_label(codec: Codec, head_dim: usize) -> String {
    if !codec.is_encoded() {
        return codec.to_string();
    }
    let bytes = codec.kv_row_bytes(head_dim);
    format!("{codec} ({bytes:.1} B per token and kv head, {:.3}× f16)", bytes / Codec::F16.kv_row_bytes(head_dim))
}
