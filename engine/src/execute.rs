//! The executor: runs the per-KV-head plans of every request on rayon threads and merges
//! the zones' partials into outputs. (The CUDA executor joins with the CUDA issue.)

use crate::context::Layer;
use crate::error::Result;
use crate::plan::Plan;
use attnstore_kernels::cpu::attention::Scratch;
use rayon::prelude::*;

/// Runs `plan` over the read-locked `layers` (one per request, same order).
pub(crate) fn run(plan: &Plan, layers: &[&Layer]) -> Result<Vec<Vec<f32>>> {
    let heads: Vec<_> = plan.requests.iter().zip(layers).map(|(r, l)| crate::Engine::cpu_heads(r, l)).collect();
    let jobs: Vec<(usize, usize)> =
        plan.requests.iter().enumerate().flat_map(|(i, r)| (0..r.shape.kv_heads).map(move |h| (i, h))).collect();
    let pieces: Vec<Vec<f32>> = jobs
        .par_iter()
        .map_init(Scratch::default, |scratch, &(i, h)| {
            let r = &plan.requests[i];
            let (g, d) = (r.shape.group(), r.shape.head_dim);
            let q = &r.queries[h * g * d..(h + 1) * g * d];
            let parts = layers[i].method.execute_head(h, q, &heads[i][h], scratch)?;
            Ok(parts.iter().flat_map(|p| p.finish()).collect())
        })
        .collect::<Result<_>>()?;
    let mut out: Vec<Vec<f32>> = plan.requests.iter().map(|r| Vec::with_capacity(r.shape.query_len())).collect();
    for (&(i, _), piece) in jobs.iter().zip(pieces) {
        out[i].extend(piece);
    }
    Ok(out)
}
