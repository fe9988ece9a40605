//! Where kv43 loses accuracy on a real trace, per layer: attention of the trace's decode
//! queries over the prompt with the rows after the first `KEEP` (f16, as the engine's steady
//! zone) in kv43, computed three ways against exact attention over the f32 rows:
//! - `rounding`: exact (f64) attention over the rows the codes stand for (dequantized);
//! - `codes`: kv43's own arithmetic on the codes (`Kv43Head::attend_runs`: 8-bit `q∘s` per
//!   key group and partition, 8-bit probabilities per 64 rows);
//! - `keys` / `values`: rounding of the keys only, or of the values only.
//!
//! Rows are encoded in token order (the engine encodes each segment in cluster order).
//!
//! With `suggest` after the codec, it also proposes a table of codecs per layer: for every
//! layer the rounding error of each candidate (`kv43:256:b128`, `kv43`, `kv43:v4`,
//! `kv43:k5`, `kv43:k5:v4`), then the choice per layer that minimizes the summed error with
//! the layers' mean bytes at most a quarter of f16's (an exact knapsack over bytes), printed
//! as a `--codec` table (`attnstore_runtime::codec_policy`, which `--codec kv43:auto` runs at
//! prefill on the prompt's own last queries). The summed attention error is a proxy for the
//! model's KL, so a suggestion is to be checked with `attnstore eval`.
//!
//! `cargo run --release -p attnstore-runtime --example kv43_layers -- TRACE_DIR [CODEC [suggest]]`
//! (a trace written by `attnstore capture`; CODEC a kv43 name, `kv43` by default).

use attnstore_kernels::cpu::partial::Partial;
use attnstore_kernels::cpu::reference::{attend_f64, rel_l2};
use attnstore_kernels::{Codec, Kv43Head, Kv43Params};
use attnstore_runtime::codec_policy::{
    cheapest_table, kv43_candidates, layer_rounding_errors, table_string, KEEP_ROWS, KV43_CANDIDATES,
};
use attnstore_runtime::trace::Trace;
use half::f16;

/// Rows kept in f16 at the start (the engine's sink and local window stay f16).
const KEEP: usize = KEEP_ROWS;

fn f16_rows(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| f16::from_f32(v).to_f32()).collect()
}

/// The partial of query `q` over f16 rows `k`, `v` (scores scaled by `scale`).
fn exact_partial(q: &[f32], k: &[f32], v: &[f32], scale: f32) -> Partial {
    let d = q.len();
    let s: Vec<f32> = k.chunks(d).map(|r| scale * r.iter().zip(q).map(|(a, b)| a * b).sum::<f32>()).collect();
    let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut p = Partial { m, l: 0.0, o: vec![0.0; d] };
    for (t, &x) in s.iter().enumerate() {
        let w = (x - m).exp();
        p.l += w;
        p.o.iter_mut().zip(&v[t * d..(t + 1) * d]).for_each(|(o, v)| *o += w * v);
    }
    p
}

/// One layer's mean attention error over the trace's decode queries and query heads:
/// key rounding, value rounding, both, and kv43's arithmetic on the codes.
fn layer_errors(trace: &Trace, layer: usize, params: Kv43Params) -> [f64; 4] {
    let m = &trace.meta;
    let (d, p, g) = (m.head_dim, m.prompt_tokens, m.q_heads / m.kv_heads);
    let scale = 1.0 / (d as f32).sqrt();
    let (k, v) = trace.layer_kv(layer, 0..p);
    let mut sums = [0.0f64; 4];
    for h in 0..m.kv_heads {
        let (kh, vh) = (f16_rows(&k[h * p * d..(h + 1) * p * d]), f16_rows(&v[h * p * d..(h + 1) * p * d]));
        let mut head = Kv43Head::new(d, params).expect("kv43 parameters");
        head.append(&kh[KEEP * d..], &vh[KEEP * d..]).expect("finite rows");
        let (dk, dv) = head.dequantize();
        let join = |a: &[f32], b: &[f32]| -> Vec<f32> { a[..KEEP * d].iter().chain(b).copied().collect() };
        let (rk, rv) = (join(&kh, &dk), join(&vh, &dv));
        for step in 0..m.decode_steps {
            let queries = &trace.query(step, layer)[h * g * d..(h + 1) * g * d];
            let mut parts: Vec<Partial> =
                queries.chunks(d).map(|q| exact_partial(q, &kh[..KEEP * d], &vh[..KEEP * d], scale)).collect();
            head.attend_runs(queries, scale, &[0..head.rows()], &mut parts).expect("runs");
            for (j, q) in queries.chunks(d).enumerate() {
                let exact = attend_f64(q, &kh, &vh, None);
                let f = |x: Vec<f64>| x.iter().map(|&y| y as f32).collect::<Vec<_>>();
                sums[0] += rel_l2(&f(attend_f64(q, &rk, &vh, None)), &exact);
                sums[1] += rel_l2(&f(attend_f64(q, &kh, &rv, None)), &exact);
                sums[2] += rel_l2(&f(attend_f64(q, &rk, &rv, None)), &exact);
                sums[3] += rel_l2(&parts[j].finish(), &exact);
            }
        }
    }
    let n = (m.q_heads * m.decode_steps) as f64;
    sums.map(|s| s / n)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = args.next().unwrap_or_else(|| "target/traces/retroinfer-8k".into());
    let codec: Codec = args.next().as_deref().unwrap_or("kv43").parse().unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    let suggest = args.next().as_deref() == Some("suggest");
    let Some(params) = codec.kv43() else {
        eprintln!("{codec} is not a kv43 codec");
        std::process::exit(2)
    };
    let trace = Trace::load(std::path::Path::new(&dir)).unwrap_or_else(|e| {
        eprintln!("cannot read the trace {dir}: {e}");
        std::process::exit(2)
    });
    let m = &trace.meta;
    println!("{codec} over {} prompt tokens, {} decode steps, first {KEEP} rows f16", m.prompt_tokens, m.decode_steps);
    println!("{:>5} {:>9} {:>9} {:>9} {:>9}", "layer", "keys", "values", "rounding", "codes");
    let mut total = [0.0f64; 4];
    for layer in 0..m.layers {
        let e = layer_errors(&trace, layer, params);
        println!("{layer:>5} {:>9.4} {:>9.4} {:>9.4} {:>9.4}", e[0], e[1], e[2], e[3]);
        total.iter_mut().zip(&e).for_each(|(t, s)| *t += s / m.layers as f64);
    }
    println!("{:>5} {:>9.4} {:>9.4} {:>9.4} {:>9.4}", "mean", total[0], total[1], total[2], total[3]);
    if !suggest {
        return;
    }
    let names = KV43_CANDIDATES;
    let candidates = kv43_candidates();
    let d = m.head_dim;
    let bytes: Vec<f64> = candidates.iter().map(|c| c.bytes_per_token(d)).collect();
    // The rounding error `kv43:auto` measures at prefill, probed here with the trace's
    // decode queries.
    let errors: Vec<Vec<f64>> = (0..m.layers)
        .map(|l| {
            let (k, v) = trace.layer_kv(l, 0..m.prompt_tokens);
            let probes: Vec<f32> = (0..m.decode_steps).flat_map(|s| trace.query(s, l).iter().copied()).collect();
            layer_rounding_errors(&k, &v, &probes, (m.q_heads, m.kv_heads, d), &candidates).expect("trace shapes")
        })
        .collect();
    // A quarter of f16's bytes per token and KV head (keys and values, 2 bytes each).
    let budget = 0.25 * 4.0 * d as f64 * m.layers as f64;
    match cheapest_table(&errors, &bytes, budget, attnstore_kernels::MAX_CODEC_OVERRIDES) {
        Some((default, picks)) => {
            let mean = picks.iter().map(|&c| bytes[c]).sum::<f64>() / m.layers as f64;
            let err = picks.iter().enumerate().map(|(l, &c)| errors[l][c]).sum::<f64>() / m.layers as f64;
            println!(
                "suggested (mean rounding error {err:.4}, {:.4}× f16): {}",
                mean / (4.0 * d as f64),
                table_string(&names, default, &picks)
            );
        }
        None => println!("no table fits a quarter of f16's bytes"),
    }
}
