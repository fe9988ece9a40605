//! Synthetic KV and queries with the structure of real post-RoPE attention (documented in
//! `docs/synthetic-data.md`): per KV head a shared mean offset with a few large outlier
//! channels, tokens that come in runs of a topic (cluster structure with locality), values
//! that carry a topic component, and queries aimed at one or two topics with varying
//! sharpness. Seeded: the same parameters give the same bytes on every machine.

use attnstore_kernels::random::SplitMix64;
use attnstore_kernels::AttnShape;
use rayon::prelude::*;

/// Parameters of a synthetic context.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthParams {
    /// Heads and head dimension.
    pub shape: AttnShape,
    /// Tokens per KV head.
    pub tokens: usize,
    /// Seed of everything.
    pub seed: u64,
    /// Average tokens per topic (number of topics = tokens / this, at least 8).
    pub tokens_per_topic: usize,
    /// Mean length of a run of consecutive tokens of one topic.
    pub mean_run_tokens: usize,
    /// Outlier channels per head (large shared offsets, as post-RoPE keys show).
    pub outlier_channels: usize,
    /// Standard deviation of the per-token key noise around its topic centre.
    pub key_noise: f32,
}

impl SynthParams {
    /// Defaults for `tokens` tokens of `shape`.
    pub fn new(shape: AttnShape, tokens: usize, seed: u64) -> Self {
        Self { shape, tokens, seed, tokens_per_topic: 512, mean_run_tokens: 64, outlier_channels: 4, key_noise: 0.7 }
    }

    /// Bytes of the generated keys and values (f32: `2 × kv_heads × tokens × head_dim × 4`);
    /// `None` past `u64`.
    pub fn kv_bytes(&self) -> Option<u64> {
        let s = self.shape;
        [s.kv_heads, self.tokens, s.head_dim].into_iter().try_fold(8u64, |acc, n| acc.checked_mul(n as u64))
    }

    /// Resident bytes [`SynthContext::generate`] holds at its peak: every head's rows,
    /// generated in parallel, and the head-major keys and values they are copied into one
    /// head at a time (each head's rows are freed once copied): [`SynthParams::kv_bytes`]
    /// and one head more. `None` past `u64`.
    pub fn peak_bytes(&self) -> Option<u64> {
        let all = self.kv_bytes()?;
        all.checked_add(all / self.shape.kv_heads.max(1) as u64)
    }
}

/// A generated context: keys and values `kv_heads × tokens × head_dim` (f32), plus the
/// topic centres queries are aimed at.
#[derive(Debug, Clone)]
pub struct SynthContext {
    /// The parameters it was made with.
    pub params: SynthParams,
    /// Keys, head-major.
    pub keys: Vec<f32>,
    /// Values, head-major.
    pub values: Vec<f32>,
    /// Per KV head, `topics × head_dim` key topic centres.
    centers: Vec<Vec<f32>>,
}

struct Head {
    keys: Vec<f32>,
    values: Vec<f32>,
    centers: Vec<f32>,
}

fn head(p: &SynthParams, h: usize) -> Head {
    let d = p.shape.head_dim;
    let mut rng = SplitMix64::fork(p.seed, h as u64);
    let topics = (p.tokens / p.tokens_per_topic.max(1)).max(8);
    let mut mean: Vec<f32> = (0..d).map(|_| rng.normal() * 0.3).collect();
    let mut outliers = Vec::new();
    for _ in 0..p.outlier_channels.min(d) {
        let c = rng.below(d);
        mean[c] += if rng.uniform() < 0.5 { -1.0 } else { 1.0 } * (5.0 + 3.0 * rng.uniform());
        outliers.push(c);
    }
    let centers: Vec<f32> = (0..topics * d).map(|_| rng.normal()).collect();
    let value_centers: Vec<f32> = (0..topics * d).map(|_| rng.normal() * 0.5).collect();
    let mut keys = Vec::with_capacity(p.tokens * d);
    let mut values = Vec::with_capacity(p.tokens * d);
    let mut topic = rng.below(topics);
    let switch = 1.0 / p.mean_run_tokens.max(1) as f32;
    for _ in 0..p.tokens {
        if rng.uniform() < switch {
            topic = rng.below(topics);
        }
        let c = &centers[topic * d..(topic + 1) * d];
        let vc = &value_centers[topic * d..(topic + 1) * d];
        let start = keys.len();
        keys.extend((0..d).map(|j| mean[j] + c[j] + rng.normal() * p.key_noise));
        for &o in &outliers {
            keys[start + o] += rng.normal() * 1.5;
        }
        values.extend((0..d).map(|j| vc[j] + rng.normal()));
    }
    Head { keys, values, centers }
}

impl SynthContext {
    /// Generates a context (heads in parallel; deterministic for a seed).
    pub fn generate(params: SynthParams) -> Self {
        let heads: Vec<Head> = (0..params.shape.kv_heads).into_par_iter().map(|h| head(&params, h)).collect();
        let mut keys = Vec::with_capacity(params.shape.kv_len(params.tokens));
        let mut values = Vec::with_capacity(params.shape.kv_len(params.tokens));
        let mut centers = Vec::new();
        for hd in heads {
            keys.extend_from_slice(&hd.keys);
            values.extend_from_slice(&hd.values);
            centers.push(hd.centers);
        }
        Self { params, keys, values, centers }
    }

    /// Keys and values of tokens `from..to` in the same head-major layout (for appends).
    pub fn slice(&self, from: usize, to: usize) -> (Vec<f32>, Vec<f32>) {
        let (n, d) = (self.params.tokens, self.params.shape.head_dim);
        let take = |x: &[f32]| -> Vec<f32> {
            (0..self.params.shape.kv_heads).flat_map(|h| x[(h * n + from) * d..(h * n + to) * d].to_vec()).collect()
        };
        (take(&self.keys), take(&self.values))
    }

    /// Query vectors for one decode step (`q_heads × head_dim`): each KV group aims at one
    /// main topic and a weaker second one; every query head of the group varies the mix
    /// and its sharpness, so heads of a group agree partly, as in real models.
    pub fn queries(&self, step: u64) -> Vec<f32> {
        let s = self.params.shape;
        let d = s.head_dim;
        let mut rng = SplitMix64::fork(self.params.seed ^ 0x0051_7E55, step);
        let mut q = Vec::with_capacity(s.query_len());
        for h in 0..s.kv_heads {
            let centers = &self.centers[h];
            let topics = centers.len() / d;
            let (a, b) = (rng.below(topics), rng.below(topics));
            for _ in 0..s.group() {
                let mix = 0.3 + 0.4 * rng.uniform();
                let mut v: Vec<f32> =
                    (0..d).map(|j| centers[a * d + j] + mix * centers[b * d + j] + rng.normal() * 0.6).collect();
                let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
                let strength = 3.0 + 5.0 * rng.uniform();
                // unit(v)·c_a ≈ 0.8·√d, so q·k/√d ≈ strength for keys of the main topic.
                let scale = 1.25 * strength / norm;
                v.iter_mut().for_each(|x| *x *= scale);
                q.extend(v);
            }
        }
        q
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_gives_the_same_context_and_slices_match() {
        let shape = AttnShape::new(4, 2, 16).unwrap();
        let a = SynthContext::generate(SynthParams::new(shape, 300, 1));
        let b = SynthContext::generate(SynthParams::new(shape, 300, 1));
        let c = SynthContext::generate(SynthParams::new(shape, 300, 2));
        assert_eq!(a.keys, b.keys);
        assert_ne!(a.keys, c.keys);
        assert_eq!(a.queries(3), b.queries(3));
        let (k, _) = a.slice(10, 12);
        assert_eq!(&k[..16], &a.keys[10 * 16..11 * 16]);
        assert_eq!(&k[32..48], &a.keys[(300 + 10) * 16..(300 + 11) * 16]);
    }

    #[test]
    fn kv_bytes_count_the_f32_keys_and_values_and_overflow_gives_none() {
        let shape = AttnShape::new(4, 2, 16).unwrap();
        let p = SynthParams::new(shape, 300, 1);
        let c = SynthContext::generate(p);
        assert_eq!(p.kv_bytes(), Some(((c.keys.len() + c.values.len()) * 4) as u64));
        assert_eq!(p.peak_bytes(), Some(p.kv_bytes().unwrap() / 2 * 3));
        assert_eq!(SynthParams::new(shape, usize::MAX, 1).kv_bytes(), None);
    }
}
