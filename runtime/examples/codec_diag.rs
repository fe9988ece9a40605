//! Where 2-bit KV loses accuracy on a real trace: for every layer and KV head, attention of
//! decode step 0's queries over the prompt with keys only, values only, or both quantized to
//! 2 bits (dequantized here, so only the rounding is measured), for several ways of
//! quantizing keys. The first 64 rows stay exact, as the steady zone does in the engine.
//!
//! `cargo run --release -p attnstore-runtime --example codec_diag -- target/traces/NAME`
//! (a trace written by `attnstore capture`). Results for SmolLM2 are in `docs/codec.md`.

use attnstore_kernels::random::SplitMix64;
use attnstore_runtime::trace::Trace;

/// Rows kept exact at the start (the engine's sink and local window are f16).
const KEEP: usize = 64;

/// How keys are quantized.
#[derive(Clone, Copy)]
enum Keys {
    /// Per token, partitions of this many dims (HACK).
    PerToken(usize),
    /// Per channel, blocks of this many tokens (KIVI's layout).
    PerChannel(usize),
    /// Per token, partitions of this many dims, after subtracting the mean key (`center`)
    /// and/or a randomized Hadamard rotation (`rotate`). Both keep scores up to a constant
    /// per query (`q·μ`), which softmax ignores, and the rotation keeps dot products exact.
    Transformed { part: usize, center: bool, rotate: bool },
}

/// In-place fast Walsh–Hadamard transform of a power-of-two length, scaled to be orthonormal.
fn hadamard(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let s = 1.0 / (n as f32).sqrt();
    x.iter_mut().for_each(|v| *v *= s);
}

/// Random ±1 signs then a Hadamard transform: an orthogonal matrix `R`; its inverse is the
/// transform followed by the same signs.
fn rotate(x: &mut [f32], signs: &[f32]) {
    x.iter_mut().zip(signs).for_each(|(v, s)| *v *= s);
    hadamard(x);
}

fn unrotate(x: &mut [f32], signs: &[f32]) {
    hadamard(x);
    x.iter_mut().zip(signs).for_each(|(v, s)| *v *= s);
}

fn attention(q: &[f32], k: &[f32], v: &[f32], d: usize) -> Vec<f32> {
    let n = k.len() / d;
    let scale = 1.0 / (d as f32).sqrt();
    let s: Vec<f32> = (0..n).map(|t| q.iter().zip(&k[t * d..]).map(|(a, b)| a * b).sum::<f32>() * scale).collect();
    let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let p: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
    let l: f32 = p.iter().sum();
    (0..d).map(|c| p.iter().enumerate().map(|(t, w)| w * v[t * d + c]).sum::<f32>() / l).collect()
}

fn relative(a: &[f32], b: &[f32]) -> f32 {
    let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    (num / b.iter().map(|y| y * y).sum::<f32>()).sqrt()
}

/// 2-bit asymmetric quantization of `x` in place (dequantized), stochastic or to nearest.
fn quantize(x: &mut [f32], rng: &mut SplitMix64, stochastic: bool) {
    let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let s = (hi - lo) / 3.0;
    if s <= 0.0 {
        return;
    }
    for v in x.iter_mut() {
        let t = (*v - lo) / s;
        let c = if stochastic {
            let f = t.floor();
            f + f32::from(rng.uniform() < t - f)
        } else {
            t.round()
        };
        *v = c.min(3.0) * s + lo;
    }
}

/// Quantizes each column of the rows after `KEEP` in blocks of `block` rows.
fn per_channel(x: &mut [f32], d: usize, block: usize, rng: &mut SplitMix64, stochastic: bool) {
    let rows = (x.len() / d - KEEP) / block * block;
    let mut col = vec![0.0f32; block];
    for b in 0..rows / block {
        for c in 0..d {
            let at = |t: usize| (KEEP + b * block + t) * d + c;
            col.iter_mut().enumerate().for_each(|(t, v)| *v = x[at(t)]);
            quantize(&mut col, rng, stochastic);
            col.iter().enumerate().for_each(|(t, v)| x[at(t)] = *v);
        }
    }
}

fn main() {
    let dir = std::env::args().nth(1).unwrap_or_else(|| "target/traces/retroinfer-4k".into());
    let trace = match Trace::load(std::path::Path::new(&dir)) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("cannot read the trace {dir}: {e}");
            std::process::exit(2);
        }
    };
    let m = &trace.meta;
    let (d, p, g) = (m.head_dim, m.prompt_tokens, m.q_heads / m.kv_heads);
    println!("{:<40} {:>8} {:>8} {:>8}", "keys quantized as", "K only", "V only", "both");
    for (name, keys, stochastic) in [
        ("per token, Π = 64, stochastic (HACK)", Keys::PerToken(64), true),
        ("per token, Π = 64, to nearest", Keys::PerToken(64), false),
        ("per token, Π = 32, stochastic", Keys::PerToken(32), true),
        ("per channel, 64 tokens, stochastic", Keys::PerChannel(64), true),
        ("per channel, 32 tokens, to nearest", Keys::PerChannel(32), false),
        ("per token, Π = 64, centred, stochastic", Keys::Transformed { part: 64, center: true, rotate: false }, true),
        ("per token, Π = 64, rotated, stochastic", Keys::Transformed { part: 64, center: false, rotate: true }, true),
        (
            "per token, Π = 64, centred+rotated, stoch.",
            Keys::Transformed { part: 64, center: true, rotate: true },
            true,
        ),
        (
            "per token, Π = 64, centred+rotated, nearest",
            Keys::Transformed { part: 64, center: true, rotate: true },
            false,
        ),
    ] {
        let (mut ek, mut ev, mut eb) = (0.0, 0.0, 0.0);
        for layer in 0..m.layers {
            let (k, v) = trace.layer_kv(layer, 0..p);
            for h in 0..m.kv_heads {
                let (kh, vh) = (&k[h * p * d..(h + 1) * p * d], &v[h * p * d..(h + 1) * p * d]);
                let mut rng = SplitMix64::new(7);
                let mut kq = kh.to_vec();
                match keys {
                    Keys::PerToken(part) => {
                        for row in kq[KEEP * d..].chunks_mut(d) {
                            row.chunks_mut(part).for_each(|x| quantize(x, &mut rng, stochastic));
                        }
                    }
                    Keys::PerChannel(block) => per_channel(&mut kq, d, block, &mut rng, stochastic),
                    Keys::Transformed { part, center, rotate: rot } => {
                        let rows = p - KEEP;
                        let mut mean = vec![0.0f32; d];
                        if center {
                            for row in kq[KEEP * d..].chunks(d) {
                                mean.iter_mut().zip(row).for_each(|(m, x)| *m += x / rows as f32);
                            }
                        }
                        let mut sg = SplitMix64::new(99);
                        let signs: Vec<f32> = (0..d).map(|_| if sg.uniform() < 0.5 { -1.0 } else { 1.0 }).collect();
                        for row in kq[KEEP * d..].chunks_mut(d) {
                            row.iter_mut().zip(&mean).for_each(|(x, m)| *x -= m);
                            if rot {
                                rotate(row, &signs);
                            }
                            row.chunks_mut(part).for_each(|x| quantize(x, &mut rng, stochastic));
                            if rot {
                                unrotate(row, &signs);
                            }
                            row.iter_mut().zip(&mean).for_each(|(x, m)| *x += m);
                        }
                    }
                }
                let mut vq = vh.to_vec();
                per_channel(&mut vq, d, 64, &mut rng, stochastic);
                for j in 0..g {
                    let q = &trace.query(0, layer)[(h * g + j) * d..(h * g + j + 1) * d];
                    let exact = attention(q, kh, vh, d);
                    ek += relative(&attention(q, &kq, vh, d), &exact);
                    ev += relative(&attention(q, kh, &vq, d), &exact);
                    eb += relative(&attention(q, &kq, &vq, d), &exact);
                }
            }
        }
        let n = (m.q_heads * m.layers) as f32;
        println!("{name:<40} {:>8.3} {:>8.3} {:>8.3}", ek / n, ev / n, eb / n);
    }
}
