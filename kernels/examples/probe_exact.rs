//! Probe of the exact CPU kernel (the figures in `docs/bench.md`, session 29):
//!
//! - `probe_exact TOKENS`: `exact_attention` over 8 KV heads × TOKENS f16 rows (32 query
//!   heads, d = 128) on all rayon threads, each call paired with a plain memory read of the
//!   same bytes (as `attnstore bench` does); prints ten paired shares of that baseline.
//! - `probe_exact TOTAL ROWS [THREADS]`: per thread, `attend_ranges` (4 query heads, one KV
//!   head) over runs of ROWS rows cycling through TOTAL rows: in cache when TOTAL is small,
//!   from memory when large; prints the best of seven ns per row for each thread.
//!
//! Run: `cargo run --release -p attnstore-kernels --example probe_exact -- 131072`.

use attnstore_kernels::cpu::attention::{attend_ranges, exact_attention, Scratch};
use attnstore_kernels::random::SplitMix64;
use attnstore_kernels::{AttnShape, HeadsView};
use rayon::prelude::*;
use std::time::Instant;

const D: usize = 128;

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|s| s.parse().ok()).collect();
    match args[..] {
        [tokens] => paired_shares(tokens),
        [total, rows] | [total, rows, _] if rows > 0 && rows <= total => {
            let threads = args.get(2).copied().unwrap_or(1).max(1);
            let ns: Vec<f64> = std::thread::scope(|sc| {
                let hs: Vec<_> = (0..threads).map(|t| sc.spawn(move || ns_per_row(total, rows, t as u64))).collect();
                hs.into_iter().map(|h| h.join().unwrap_or(f64::NAN)).collect()
            });
            println!("total {total} rows {rows} threads {threads}: {ns:.1?} ns per row and thread");
        }
        _ => eprintln!("usage: probe_exact TOKENS | probe_exact TOTAL ROWS [THREADS] (ROWS ≤ TOTAL)"),
    }
}

fn f16_normals(n: usize, rng: &mut SplitMix64) -> Vec<half::f16> {
    (0..n).map(|_| half::f16::from_f32(rng.normal())).collect()
}

/// Best of seven: ns per row of `attend_ranges` over runs of `rows` rows cycling through
/// `total` rows, for at least 8M rows per pass.
fn ns_per_row(total: usize, rows: usize, seed: u64) -> f64 {
    let mut rng = SplitMix64::new(seed);
    let (k, v) = (f16_normals(total * D, &mut rng), f16_normals(total * D, &mut rng));
    let q: Vec<f32> = (0..4 * D).map(|_| rng.normal()).collect();
    let mut scratch = Scratch::default();
    let mut best = f64::MAX;
    for _ in 0..7 {
        let t = Instant::now();
        let (mut at, mut done) = (0, 0);
        while done < 8 * total.max(1 << 20) {
            if at + rows > total {
                at = 0;
            }
            std::hint::black_box(attend_ranges(&q, 4, 0.088, &k, &v, &[at..at + rows], &mut scratch));
            at += rows;
            done += rows;
        }
        best = best.min(t.elapsed().as_secs_f64() * 1e9 / done as f64);
    }
    best
}

/// Ten calls of `exact_attention`, each right after a plain read of as many bytes.
fn paired_shares(tokens: usize) {
    let shape = AttnShape::new(32, 8, D).expect("a valid shape");
    let mut rng = SplitMix64::new(3);
    let n = shape.kv_len(tokens);
    let (k, v) = (f16_normals(n, &mut rng), f16_normals(n, &mut rng));
    let q: Vec<f32> = (0..shape.query_len()).map(|_| rng.normal()).collect();
    let (Ok(kv), Ok(vv)) = (HeadsView::new(&k, 8, tokens, D), HeadsView::new(&v, 8, tokens, D)) else {
        eprintln!("probe_exact: bad views");
        return;
    };
    let buf: Vec<u64> = (0..n as u64 / 2).collect();
    let gb = (4 * n) as f64 / 1e9;
    for _ in 0..10 {
        let t = Instant::now();
        let s = buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, x| a.wrapping_add(*x)))
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(s);
        let mem = t.elapsed().as_secs_f64();
        let t = Instant::now();
        std::hint::black_box(exact_attention(&shape, &q, kv, vv).ok());
        let exact = t.elapsed().as_secs_f64();
        let per_row = exact * 1e9 / (8 * tokens) as f64 * rayon::current_num_threads() as f64;
        println!(
            "memread {:.1} GB/s exact {:.1} GB/s share {:.2} ({per_row:.1} ns/row/thread)",
            gb / mem,
            gb / exact,
            mem / exact
        );
    }
}
