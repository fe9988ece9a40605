//! Shared pieces of the criterion benches: seeded inputs, plain baselines, and a same-run
//! ratio printer (BENCH.md: every speed is reported against a baseline measured in the
//! same run).

use attnstore_kernels::random::SplitMix64;
use std::time::Instant;

/// `n` standard-normal values from `seed`.
pub fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut g = SplitMix64::new(seed);
    (0..n).map(|_| g.normal()).collect()
}

/// Median wall time of `f` over `runs` runs, in microseconds.
pub fn median_us(runs: usize, mut f: impl FnMut()) -> f64 {
    let mut t: Vec<f64> = (0..runs.max(1))
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Times `op` and `baseline` in the same run and prints one line with both and the ratio.
pub fn print_ratio(name: &str, baseline: &str, op: impl FnMut(), base: impl FnMut()) {
    let b = median_us(15, base);
    let o = median_us(15, op);
    eprintln!("ratio {name}: {o:.1} us vs baseline {baseline}: {b:.1} us -> {:.2}x", b / o);
}

/// Plain single-threaded attention of one query head over `n` rows: dot, exp, axpy with no
/// tiling or vectors — the baseline of the tiled kernels.
pub fn naive_attention(q: &[f32], keys: &[f32], values: &[f32], scale: f32) -> Vec<f32> {
    let d = q.len();
    let scores: Vec<f32> =
        keys.chunks_exact(d).map(|k| q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale).collect();
    let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut o = vec![0.0; d];
    let mut l = 0.0;
    for (s, v) in scores.iter().zip(values.chunks_exact(d)) {
        let p = (s - m).exp();
        l += p;
        o.iter_mut().zip(v).for_each(|(o, v)| *o += p * v);
    }
    o.iter_mut().for_each(|x| *x /= l);
    o
}

/// Sums a buffer with one thread: the memory-read baseline of the attention benches.
pub fn sum_bytes(buf: &[u64]) -> u64 {
    buf.iter().fold(0u64, |a, x| a.wrapping_add(*x))
}
