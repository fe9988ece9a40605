//! Probe of the kv43 reference codec on the CPU (issue 43; `docs/codec.md`, round 4): ns per
//! row and KV head for four query heads (a GQA group) over ROWS rows of d = 128, one thread:
//! the f16 exact kernel (`attend_ranges`), kv43's homomorphic scores (scalar reference and
//! the AVX2 path), its whole decode per head (`Kv43Rows::attend`, values by subset-sum
//! tables) and for the four heads at once (`Kv43Rows::attend_heads`: codes read once, values
//! unpacked once and weighed with AVX2). Five rounds, each timing all five in turn; prints
//! each round and the f16 / `attend_heads` ratios.
//!
//! Run: `cargo run --release -p attnstore-kernels --example probe_kv43 -- 32768`.

use attnstore_kernels::cpu::attention::{attend_ranges, Scratch};
use attnstore_kernels::cpu::kv43::{Kv43Params, Kv43Rows};
use attnstore_kernels::random::SplitMix64;
use std::time::Instant;

const D: usize = 128;
const HEADS: usize = 4;

/// Best of three: ns per row of `f` over `rows` rows.
fn ns_per_row(rows: usize, mut f: impl FnMut()) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64() * 1e9 / rows as f64);
    }
    best
}

fn main() {
    let rows: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(32768);
    let rows = rows.div_ceil(128).max(1) * 128;
    let mut rng = SplitMix64::new(7);
    let keys: Vec<f32> = (0..rows * D).map(|i| rng.normal() * if i % D < 3 { 8.0 } else { 1.0 }).collect();
    let values: Vec<f32> = (0..rows * D).map(|_| rng.normal()).collect();
    let q: Vec<f32> = (0..HEADS * D).map(|_| rng.normal()).collect();
    let (k16, v16): (Vec<half::f16>, Vec<half::f16>) =
        keys.iter().zip(&values).map(|(&k, &v)| (half::f16::from_f32(k), half::f16::from_f32(v))).unzip();
    let codes = Kv43Rows::encode(&keys, &values, D, Kv43Params::default()).expect("encodes");
    let scale = 1.0 / (D as f32).sqrt();
    let mut scratch = Scratch::default();
    // `PROBE_KV43_HEADS_ONLY=N`: only `attend_heads`, N times (for a profiler).
    if let Some(n) = std::env::var("PROBE_KV43_HEADS_ONLY").ok().and_then(|v| v.parse::<usize>().ok()) {
        for _ in 0..n {
            std::hint::black_box(codes.attend_heads(&q, HEADS, scale).expect("shapes"));
        }
        return;
    }
    println!("{rows} rows, d = {D}, {HEADS} query heads per KV head, one thread: ns per row and KV head");
    let mut ratios = Vec::new();
    for round in 1..=5 {
        let f16 = ns_per_row(rows, || {
            std::hint::black_box(attend_ranges(&q, HEADS, scale, &k16, &v16, &[0..rows], &mut scratch));
        });
        let reference = ns_per_row(rows, || {
            for h in 0..HEADS {
                std::hint::black_box(codes.scores_reference(&q[h * D..(h + 1) * D], scale));
            }
        });
        let fast = ns_per_row(rows, || {
            for h in 0..HEADS {
                std::hint::black_box(codes.scores(&q[h * D..(h + 1) * D], scale));
            }
        });
        let attend = ns_per_row(rows, || {
            for h in 0..HEADS {
                std::hint::black_box(codes.attend(&q[h * D..(h + 1) * D], scale));
            }
        });
        let together = ns_per_row(rows, || {
            std::hint::black_box(codes.attend_heads(&q, HEADS, scale).expect("shapes"));
        });
        println!(
            "round {round}: f16 exact {f16:.1}, kv43 scores scalar {reference:.1} / AVX2 {fast:.1}, kv43 attend per head \
             {attend:.1}, all heads at once {together:.1}; f16 / kv43 heads at once {:.2}x",
            f16 / together
        );
        ratios.push(f16 / together);
    }
    ratios.sort_by(f64::total_cmp);
    println!("f16 exact / kv43 attend_heads: min {:.2} / median {:.2} / max {:.2}x", ratios[0], ratios[2], ratios[4]);
}
