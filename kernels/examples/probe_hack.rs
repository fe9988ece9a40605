//! Probe of CPU attention over `hack2` rows (the figures in `docs/codec.md`, session 29): one
//! thread, one KV head of ROWS rows (d = 128, 4 query heads), `HackRows::attend` over all of
//! them against `attend_ranges` over the same rows in f16; five lines of ns per row, each
//! the mean of 40 calls. `probe_hack ROWS hack` or `ROWS f16` times only one of them;
//! `probe_hack ROWS hack CHUNK` attends the 2-bit rows CHUNK at a time (as the engine's
//! exact plans do, 2048) and merges the pieces.
//!
//! Run: `cargo run --release -p attnstore-kernels --example probe_hack -- 32768`.

use attnstore_kernels::cpu::attention::{attend_ranges, Scratch};
use attnstore_kernels::random::SplitMix64;
use attnstore_kernels::{HackParams, HackRows, HackScratch, KeyLayout, Partial};
use std::time::Instant;

const D: usize = 128;
const CALLS: usize = 40;

fn main() {
    let rows: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(32768).max(1);
    let which = std::env::args().nth(2).unwrap_or_else(|| "both".into());
    // Rows per `attend` call (as the engine's exact plans split a head into tasks), merged.
    let chunk: usize = std::env::args().nth(3).and_then(|s| s.parse().ok()).unwrap_or(rows).max(1);
    let mut rng = SplitMix64::new(1);
    let k: Vec<half::f16> = (0..rows * D).map(|_| half::f16::from_f32(rng.normal())).collect();
    let v: Vec<half::f16> = (0..rows * D).map(|_| half::f16::from_f32(rng.normal())).collect();
    let q: Vec<f32> = (0..4 * D).map(|_| rng.normal()).collect();
    // ATTNSTORE_PROBE_KEYS=channel: per-channel keys (hack2c).
    let keys = match std::env::var("ATTNSTORE_PROBE_KEYS").as_deref() {
        Ok("channel") => KeyLayout::PerChannel,
        _ => KeyLayout::PerToken,
    };
    let hack = HackParams::new(64)
        .and_then(|p| HackRows::new(D, p.with_keys(keys)))
        .and_then(|mut r| r.push_rows(&k, &v, &mut SplitMix64::new(2)).map(|()| r));
    let Ok(hack) = hack else {
        eprintln!("probe_hack: could not encode the rows");
        return;
    };
    let (mut hs, mut s) = (HackScratch::default(), Scratch::default());
    let per_row = |t: Instant| t.elapsed().as_secs_f64() * 1e9 / (CALLS * rows) as f64;
    for _ in 0..5 {
        if which != "f16" {
            let t = Instant::now();
            for _ in 0..CALLS {
                let mut parts = vec![Partial::empty(D); 4];
                for a in (0..rows).step_by(chunk) {
                    let mut piece = vec![Partial::empty(D); 4];
                    hack.attend(&q, 0.088, &[a..(a + chunk).min(rows)], &mut piece, &mut hs);
                    parts.iter_mut().zip(&piece).for_each(|(p, x)| p.merge(x));
                }
                std::hint::black_box(parts);
            }
            print!("hack2 {:.1} ns/row  ", per_row(t));
        }
        if which != "hack" {
            let t = Instant::now();
            for _ in 0..CALLS {
                std::hint::black_box(attend_ranges(&q, 4, 0.088, &k, &v, &[0..rows], &mut s));
            }
            print!("f16 {:.1} ns/row", per_row(t));
        }
        println!();
    }
}
