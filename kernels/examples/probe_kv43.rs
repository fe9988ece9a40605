//! Probe of the kv43 reference codec on the CPU (issue 43; `docs/codec.md`, round 4): ns per
//! row and KV head for four query heads (a GQA group) over ROWS rows of d = 128, one thread:
//! the f16 exact kernel (`attend_ranges`), kv43's homomorphic scores (scalar reference and
//! the AVX2 path), its whole decode per head (`Kv43Rows::attend`) and for the four heads at
//! once (`Kv43Rows::attend_heads`: codes read once, values unpacked once and weighed with
//! AVX2). Five rounds, each timing all five in turn; prints each round and the f16 /
//! `attend_heads` ratios.
//!
//! `probe_kv43 ROWS THREADS`: THREADS KV heads at once, one per thread (see `parallel`).
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

/// `probe_kv43 ROWS THREADS`: every thread its own KV head of ROWS rows (as a layer's KV heads
/// spread over cores), all timed together, f16 exact then kv43 `attend_heads`, five rounds:
/// where the f16 kernel is memory-bound, kv43's 0.25× bytes count.
fn parallel(rows: usize, threads: usize) {
    let scale = 1.0 / (D as f32).sqrt();
    let heads: Vec<_> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                sc.spawn(move || {
                    let mut rng = SplitMix64::new(100 + t as u64);
                    let keys: Vec<f32> =
                        (0..rows * D).map(|i| rng.normal() * if i % D < 3 { 8.0 } else { 1.0 }).collect();
                    let values: Vec<f32> = (0..rows * D).map(|_| rng.normal()).collect();
                    let q: Vec<f32> = (0..HEADS * D).map(|_| rng.normal()).collect();
                    let k16: Vec<half::f16> = keys.iter().map(|&x| half::f16::from_f32(x)).collect();
                    let v16: Vec<half::f16> = values.iter().map(|&x| half::f16::from_f32(x)).collect();
                    let codes = Kv43Rows::encode(&keys, &values, D, Kv43Params::default()).expect("encodes");
                    (k16, v16, codes, q)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("generation")).collect()
    });
    println!("{threads} threads, each a KV head of {rows} rows (d = {D}, {HEADS} query heads): ns per row and KV head, all together");
    let mut ratios = Vec::new();
    for round in 1..=5 {
        let time = |kv43: bool| {
            let t = Instant::now();
            std::thread::scope(|sc| {
                for (k16, v16, codes, q) in &heads {
                    sc.spawn(move || {
                        let mut scratch = Scratch::default();
                        if kv43 {
                            std::hint::black_box(codes.attend_heads(q, HEADS, scale).expect("shapes"));
                        } else {
                            std::hint::black_box(attend_ranges(q, HEADS, scale, k16, v16, &[0..rows], &mut scratch));
                        }
                    });
                }
            });
            t.elapsed().as_secs_f64() * 1e9 / (rows * threads) as f64
        };
        let (f16, kv43) = (time(false), time(true));
        println!("round {round}: f16 exact {f16:.2}, kv43 attend_heads {kv43:.2}; f16 / kv43 {:.2}x", f16 / kv43);
        ratios.push(f16 / kv43);
    }
    ratios.sort_by(f64::total_cmp);
    println!("f16 exact / kv43 attend_heads: min {:.2} / median {:.2} / max {:.2}x", ratios[0], ratios[2], ratios[4]);
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|s| s.parse().ok()).collect();
    if let [rows, threads] = args[..] {
        return parallel(rows.div_ceil(128).max(1) * 128, threads.max(1));
    }
    let rows: usize = args.first().copied().unwrap_or(32768);
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
    // `PROBE_KV43_HEADS_ONLY=N`: only `attend_heads`, N times (for a profiler), then its
    // fastest and median call.
    if let Some(n) = std::env::var("PROBE_KV43_HEADS_ONLY").ok().and_then(|v| v.parse::<usize>().ok()) {
        let mut times: Vec<f64> = (0..n)
            .map(|_| {
                let t = Instant::now();
                std::hint::black_box(codes.attend_heads(&q, HEADS, scale).expect("shapes"));
                t.elapsed().as_secs_f64() * 1e9 / rows as f64
            })
            .collect();
        times.sort_by(f64::total_cmp);
        if let (Some(min), Some(med)) = (times.first(), times.get(times.len() / 2)) {
            println!("attend_heads, {n} calls: ns per row and KV head min {min:.2} / median {med:.2}");
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
