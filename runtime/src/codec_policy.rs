//! Choosing a `kv43` codec per layer at prefill, from the prompt's own KV.
//!
//! Which layers of a model need 4-bit values or 5-bit keys differs per model (SmolLM2-135M
//! needs 4-bit values in layers 3–10, Gemma-3-270M none: `docs/codec.md`). After a prefill
//! the runtime has each layer's KV and 64 queries spread over the prompt's last 512 positions
//! ([`Prefill::probes`]). For every layer and candidate codec ([`KV43_CANDIDATES`]) the
//! policy measures the **rounding error**: the relative L2 distance of exact attention of
//! those queries over the rows the codes stand for (dequantized; the first
//! [`KEEP_ROWS`] rows stay f16, as the engine's sink and window do) from exact attention over
//! the f16 rows. It then picks, per layer, the codec that minimizes the summed error with
//! the layers' mean bytes per token at most a quarter of f16's (an exact knapsack over bytes,
//! [`cheapest_table`]). The summed rounding error is a proxy for the model's KL: offline, on
//! a trace of SmolLM2's decode queries, it proposed the table measured best by hand
//! (`runtime/examples/kv43_layers.rs`).

use attnstore_kernels::cpu::attention::{attend_rows, Scratch};
use attnstore_kernels::Partial;
use attnstore_kernels::{Codec, Kv43Head, Kv43Params, LayerCodecs, MAX_CODEC_OVERRIDES};
use half::f16;
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::model::{ModelConfig, Prefill};
use crate::session::relative_l2;

/// Queries a prefill keeps per layer as probes: every `PROBE_WINDOW / PROBE_QUERIES`-th of
/// the prompt's last [`PROBE_WINDOW`] positions, ending at the last.
pub const PROBE_QUERIES: usize = 64;

/// The prompt's last positions the probes are spread over.
pub const PROBE_WINDOW: usize = 512;

/// At most [`PROBE_QUERIES`] of `queries` (rows of `row` values, the prompt's last ones in
/// order), evenly spaced and ending at the last row.
pub fn thin_probes(queries: &[f32], row: usize) -> Vec<f32> {
    let n = queries.len().checked_div(row).unwrap_or(0);
    if n <= PROBE_QUERIES {
        return queries.to_vec();
    }
    let stride = n.div_ceil(PROBE_QUERIES);
    let first = (n - 1) % stride;
    (first..n).step_by(stride).flat_map(|i| queries[i * row..(i + 1) * row].iter().copied()).collect()
}

/// Rows at the start of a layer kept in f16 when its rounding is measured (the engine's
/// sink and local window stay f16).
pub const KEEP_ROWS: usize = 64;

/// The codecs the policy chooses among, by name: 4-bit keys over 256-token groups with
/// 128-token value blocks (the cheapest), plain `kv43`, then 4-bit values, 5-bit keys, both.
pub const KV43_CANDIDATES: [&str; 5] = ["kv43:256:b128", "kv43", "kv43:v4", "kv43:k5", "kv43:k5:v4"];

/// A codec table the policy chose and what it measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Kv43Choice {
    /// The codec of every layer.
    pub codecs: LayerCodecs,
    /// Per layer, the rounding error of each of [`KV43_CANDIDATES`], in order.
    pub errors: Vec<Vec<f64>>,
    /// Mean rounding error of the chosen codecs over the layers.
    pub mean_error: f64,
    /// Mean bytes per token and KV head of the chosen codecs, as a share of f16's.
    pub bytes_share: f64,
}

/// The rounding error of each of `candidates` for one layer: `k`, `v` its rows (`kv_heads ×
/// rows × d`, head-major), `probes` queries (`n × q_heads × d`). Each candidate's error is the
/// mean over the probes and query heads of the relative L2 distance of exact attention over
/// the rows its codes stand for from exact attention over the f16 rows (the first
/// [`KEEP_ROWS`] rows f16 in both). A layer of at most `KEEP_ROWS` rows, or no probes, has
/// error 0 for every candidate.
pub fn layer_rounding_errors(
    k: &[f32],
    v: &[f32],
    probes: &[f32],
    (q_heads, kv_heads, d): (usize, usize, usize),
    candidates: &[Kv43Params],
) -> Result<Vec<f64>> {
    let bad = |what: String| Err(Error::InvalidInput(what));
    if d == 0 || kv_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
        return bad(format!("{q_heads} query heads over {kv_heads} KV heads of dimension {d}"));
    }
    if k.len() != v.len() || !k.len().is_multiple_of(kv_heads * d) || !probes.len().is_multiple_of(q_heads * d) {
        return bad(format!(
            "layer rows of {} and {} values and {} probe values do not fit {kv_heads} KV heads, {q_heads} query heads, d = {d}",
            k.len(),
            v.len(),
            probes.len()
        ));
    }
    let rows = k.len() / (kv_heads * d);
    let n = probes.len() / (q_heads * d);
    let mut sums = vec![0.0f64; candidates.len()];
    if rows <= KEEP_ROWS || n == 0 {
        return Ok(sums);
    }
    let g = q_heads / kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let narrow = |x: &[f32]| x.iter().map(|&y| f16::from_f32(y).to_f32()).collect::<Vec<f32>>();
    let mut scratch = Scratch::default();
    // The group's outputs of every probe over rows `k`, `v` (f32 attention, SIMD).
    let mut outputs = |h: usize, k: &[f32], v: &[f32]| -> Vec<Vec<f32>> {
        (0..n)
            .map(|p| {
                let q = &probes[p * q_heads * d + h * g * d..p * q_heads * d + (h + 1) * g * d];
                let mut parts = vec![Partial::empty(d); g];
                attend_rows(q, scale, k, v, &mut parts, &mut scratch);
                parts.iter().flat_map(Partial::finish).collect()
            })
            .collect()
    };
    let codes = |e: attnstore_kernels::Error| Error::InvalidInput(format!("kv43 codes of the layer: {e}"));
    // The first KEEP_ROWS f16 rows of `a`, then the rows `b` the codes stand for.
    let join = |a: &[f32], b: &[f32]| -> Vec<f32> { a[..KEEP_ROWS * d].iter().chain(b).copied().collect() };
    for h in 0..kv_heads {
        let (kh, vh) = (narrow(&k[h * rows * d..(h + 1) * rows * d]), narrow(&v[h * rows * d..(h + 1) * rows * d]));
        let exact = outputs(h, &kh, &vh);
        for (sum, &params) in sums.iter_mut().zip(candidates) {
            let mut head = Kv43Head::new(d, params).map_err(codes)?;
            head.append(&kh[KEEP_ROWS * d..], &vh[KEEP_ROWS * d..]).map_err(codes)?;
            let (dk, dv) = head.dequantize();
            let rounded = outputs(h, &join(&kh, &dk), &join(&vh, &dv));
            for (got, want) in rounded.iter().zip(&exact) {
                for (a, b) in got.chunks_exact(d).zip(want.chunks_exact(d)) {
                    *sum += relative_l2(a, b);
                }
            }
        }
    }
    let count = (n * q_heads) as f64;
    Ok(sums.into_iter().map(|s| s / count).collect())
}

/// The candidate per layer (indices into `bytes`) minimizing the summed `errors` (`layers ×
/// candidates`) with the summed `bytes` at most `budget` and at most `max_runs` runs of
/// layers whose candidate differs from the table's default (the table [`table_string`]
/// writes must fit `LayerCodecs`' ranges). Exact: for every default, a knapsack over bytes
/// (in eighths, divided by their common divisor) whose state also holds the last layer's
/// candidate and the runs so far. Returns the default and the picks; `None` when nothing fits.
pub fn cheapest_table(errors: &[Vec<f64>], bytes: &[f64], budget: f64, max_runs: usize) -> Option<(usize, Vec<usize>)> {
    let k = bytes.len();
    if k == 0 || errors.iter().any(|row| row.len() != k) {
        return None;
    }
    let eighths: Vec<usize> = bytes.iter().map(|b| (b * 8.0).round() as usize).collect();
    let unit = eighths.iter().fold(0, |g, &u| gcd(g, u)).max(1);
    let units: Vec<usize> = eighths.iter().map(|u| u / unit).collect();
    let cap = ((budget * 8.0).floor() as usize) / unit;
    let runs = max_runs + 1;
    let at = |b: usize, c: usize, r: usize| (b * k + c) * runs + r;
    let mut best_table: Option<(f64, usize, Vec<usize>)> = None;
    for default in 0..k {
        // cost[state]: least error so far; from[layer][state]: the previous state.
        let mut cost = vec![f64::INFINITY; (cap + 1) * k * runs];
        let mut from: Vec<Vec<u32>> = Vec::with_capacity(errors.len());
        for (l, row) in errors.iter().enumerate() {
            let mut next = vec![f64::INFINITY; cost.len()];
            let mut back = vec![u32::MAX; cost.len()];
            for c in 0..k {
                let opens = |prev: Option<usize>| usize::from(c != default && prev != Some(c));
                if l == 0 {
                    let (b, r) = (units[c], opens(None));
                    if b <= cap && r <= max_runs {
                        next[at(b, c, r)] = row[c];
                    }
                    continue;
                }
                for b in 0..=cap.saturating_sub(units[c]) {
                    for pc in 0..k {
                        for r in 0..runs {
                            let e = cost[at(b, pc, r)];
                            let r2 = r + opens(Some(pc));
                            if !e.is_finite() || r2 > max_runs {
                                continue;
                            }
                            let s = at(b + units[c], c, r2);
                            if e + row[c] < next[s] {
                                next[s] = e + row[c];
                                back[s] = at(b, pc, r) as u32;
                            }
                        }
                    }
                }
            }
            cost = next;
            from.push(back);
        }
        let Some((mut s, &e)) =
            cost.iter().enumerate().filter(|(_, e)| e.is_finite()).min_by(|x, y| x.1.total_cmp(y.1))
        else {
            continue;
        };
        if best_table.as_ref().is_some_and(|(b, _, _)| *b <= e) {
            continue;
        }
        let mut picks = vec![0; errors.len()];
        for l in (0..errors.len()).rev() {
            picks[l] = (s / runs) % k;
            s = from[l][s] as usize;
        }
        best_table = Some((e, default, picks));
    }
    best_table.map(|(_, default, picks)| (default, picks))
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// A table of `names` per layer (`picks`: an index per layer) as `--codec` writes it: the
/// codec `default`, then each run of layers with another one as `A-B=CODEC` (or `L=CODEC`).
pub fn table_string(names: &[&str], default: usize, picks: &[usize]) -> String {
    let mut out = names[default].to_string();
    let mut l = 0;
    while l < picks.len() {
        let end = (l..picks.len()).take_while(|&x| picks[x] == picks[l]).last().unwrap_or(l);
        if picks[l] != default {
            match end == l {
                true => out.push_str(&format!(",{l}={}", names[picks[l]])),
                false => out.push_str(&format!(",{l}-{end}={}", names[picks[l]])),
            }
        }
        l = end + 1;
    }
    out
}

/// The candidates' parameters, in [`KV43_CANDIDATES`] order.
pub fn kv43_candidates() -> Vec<Kv43Params> {
    KV43_CANDIDATES.iter().filter_map(|n| n.parse::<Codec>().ok().and_then(Codec::kv43)).collect()
}

/// The kv43 table for a model (`config`) from its `prefill`: every layer's rounding error
/// for each candidate ([`layer_rounding_errors`], layers in parallel), then the table of
/// least summed error at a quarter of f16's bytes per token ([`cheapest_table`]). A prefill
/// without probes (a prefix attached from the remote tier) is an error.
pub fn choose_kv43(config: &ModelConfig, prefill: &Prefill) -> Result<Kv43Choice> {
    let (layers, d) = (config.layers, config.head_dim);
    if prefill.kv.len() != layers || prefill.probes.len() != layers || prefill.probes.iter().any(Vec::is_empty) {
        return Err(Error::InvalidInput(format!(
            "choosing kv43 codecs needs every layer's KV and probe queries of a prefill: {} layers of KV and {} of \
             probes for a model of {layers}",
            prefill.kv.len(),
            prefill.probes.iter().filter(|p| !p.is_empty()).count()
        )));
    }
    let params = kv43_candidates();
    let heads = (config.q_heads, config.kv_heads, d);
    let errors = prefill
        .kv
        .par_iter()
        .zip(&prefill.probes)
        .map(|((k, v), probes)| layer_rounding_errors(k, v, probes, heads, &params))
        .collect::<Result<Vec<_>>>()?;
    let bytes: Vec<f64> = params.iter().map(|p| p.bytes_per_token(d)).collect();
    // A quarter of f16's bytes per token and KV head (keys and values, 2 bytes each).
    let f16_bytes = 4.0 * d as f64;
    let budget = 0.25 * f16_bytes * layers as f64;
    let (default, picks) = cheapest_table(&errors, &bytes, budget, MAX_CODEC_OVERRIDES).ok_or_else(|| {
        Error::InvalidInput(format!("no kv43 table fits a quarter of f16's bytes at head dimension {d}"))
    })?;
    let table = table_string(&KV43_CANDIDATES, default, &picks);
    let codecs: LayerCodecs =
        table.parse().map_err(|e| Error::InvalidInput(format!("the chosen table {table}: {e}")))?;
    let n = layers.max(1) as f64;
    Ok(Kv43Choice {
        codecs,
        mean_error: picks.iter().enumerate().map(|(l, &c)| errors[l][c]).sum::<f64>() / n,
        bytes_share: picks.iter().map(|&c| bytes[c]).sum::<f64>() / n / f16_bytes,
        errors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnstore_kernels::random::SplitMix64;

    /// The probes kept are evenly spaced over the window and end at its last query; fewer
    /// queries than the probes are kept whole.
    #[test]
    fn probes_are_spread_over_the_window_and_end_at_the_last_query() {
        let row = 3;
        let rows = |n: usize| (0..n * row).map(|x| x as f32).collect::<Vec<f32>>();
        let first_of = |p: &[f32]| p.chunks_exact(row).map(|r| r[0] as usize / row).collect::<Vec<_>>();
        let window = first_of(&thin_probes(&rows(PROBE_WINDOW), row));
        assert_eq!(window.len(), PROBE_QUERIES);
        assert_eq!(*window.last().unwrap(), PROBE_WINDOW - 1);
        assert!(window.windows(2).all(|w| w[1] - w[0] == PROBE_WINDOW / PROBE_QUERIES), "{window:?}");
        let odd = first_of(&thin_probes(&rows(100), row));
        assert!(odd.len() <= PROBE_QUERIES && *odd.last().unwrap() == 99, "{odd:?}");
        assert_eq!(thin_probes(&rows(40), row), rows(40), "fewer than PROBE_QUERIES: all of them");
        assert!(thin_probes(&[], row).is_empty());
    }

    #[test]
    fn the_knapsack_picks_the_least_error_within_the_byte_budget() {
        // Two candidates: cheap (1 byte) and dear (2 bytes); a budget of 5 bytes over 4
        // layers buys one upgrade, which goes to the layer the cheap codec hurts most.
        let errors = vec![vec![0.1, 0.05], vec![0.9, 0.1], vec![0.2, 0.1], vec![0.3, 0.29]];
        assert_eq!(cheapest_table(&errors, &[1.0, 2.0], 5.0, 4), Some((0, vec![0, 1, 0, 0])));
        assert_eq!(cheapest_table(&errors, &[1.0, 2.0], 8.0, 4).map(|t| t.1), Some(vec![1, 1, 1, 1]));
        assert_eq!(cheapest_table(&errors, &[1.0, 2.0], 3.0, 4), None, "4 layers cannot fit 3 bytes");
        // Upgrades in layers 1 and 3 are two runs; with one run allowed the best table
        // upgrades layers 1-2 instead.
        let errors = vec![vec![0.1, 0.1], vec![0.9, 0.1], vec![0.1, 0.05], vec![0.8, 0.1]];
        assert_eq!(cheapest_table(&errors, &[1.0, 2.0], 6.0, 2), Some((0, vec![0, 1, 0, 1])));
        assert_eq!(cheapest_table(&errors, &[1.0, 2.0], 6.0, 1), Some((0, vec![0, 1, 1, 0])));
        assert_eq!(table_string(&["a", "b"], 0, &[0, 1, 1, 0, 1]), "a,1-2=b,4=b");
        assert_eq!(table_string(&["a", "b"], 1, &[0, 1, 1, 0, 1]), "b,0=a,3=a");
    }

    /// A layer whose values have a few large channels loses more to 3-bit values than to
    /// 4-bit ones, and every candidate's error is the distance it claims (a probe over
    /// rounded rows against f16 rows); rows all within the f16 head, or no probes, cost 0.
    #[test]
    fn rounding_errors_rank_the_candidates_and_bad_shapes_are_typed_errors() {
        let (q_heads, kv_heads, d, rows) = (4, 2, 64, 600);
        let mut rng = SplitMix64::new(5);
        let k: Vec<f32> = (0..kv_heads * rows * d).map(|i| rng.normal() * if i % d < 2 { 6.0 } else { 1.0 }).collect();
        let v: Vec<f32> = (0..kv_heads * rows * d).map(|_| rng.normal()).collect();
        let probes: Vec<f32> = (0..3 * q_heads * d).map(|_| rng.normal() * 0.5).collect();
        let params = kv43_candidates();
        let e = layer_rounding_errors(&k, &v, &probes, (q_heads, kv_heads, d), &params).unwrap();
        assert_eq!(e.len(), KV43_CANDIDATES.len());
        assert!(e.iter().all(|x| x.is_finite() && *x > 0.0), "{e:?}");
        // kv43:v4 (index 2) rounds values finer than kv43 (1); k5:v4 (4) finer than k5 (3).
        assert!(e[2] < e[1] && e[4] < e[3], "{e:?}");
        let short =
            layer_rounding_errors(&k[..kv_heads * 60 * d], &v[..kv_heads * 60 * d], &probes, (4, 2, 64), &params);
        assert_eq!(short.unwrap(), vec![0.0; 5]);
        assert_eq!(layer_rounding_errors(&k, &v, &[], (4, 2, 64), &params).unwrap(), vec![0.0; 5]);
        assert!(layer_rounding_errors(&k, &v[1..], &probes, (4, 2, 64), &params).is_err());
        assert!(layer_rounding_errors(&k, &v, &probes, (3, 2, 64), &params).is_err());
    }
}
