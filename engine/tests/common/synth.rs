//! Synthetic KV and queries for the engine's integration tests: per KV head a shared mean
//! offset with a few outlier channels, tokens in runs of a topic, values with a topic
//! component, queries aimed at one or two topics. A frozen copy of the generator of
//! `attnstore-bench` (`bench/src/synth.rs`, described in `docs/synthetic-data.md`) as it was
//! when these tests' error bounds were set: the engine cannot depend on the bench crate, and
//! a change to the bench's data must not move the engine's tests. Same seed, same bytes.

use attnstore_kernels::random::SplitMix64;
use attnstore_kernels::AttnShape;
use rayon::prelude::*;

/// Average tokens per topic (number of topics = tokens / this, at least 8).
const TOKENS_PER_TOPIC: usize = 512;
/// Mean length of a run of consecutive tokens of one topic.
const MEAN_RUN_TOKENS: usize = 64;
/// Outlier channels per head.
const OUTLIER_CHANNELS: usize = 4;
/// Standard deviation of the per-token key noise around its topic centre.
const KEY_NOISE: f32 = 0.7;

/// Parameters of a synthetic context.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthParams {
    /// Heads and head dimension.
    pub shape: AttnShape,
    /// Tokens per KV head.
    pub tokens: usize,
    /// Seed of everything.
    pub seed: u64,
}

impl SynthParams {
    /// `tokens` tokens of `shape` from `seed`.
    pub fn new(shape: AttnShape, tokens: usize, seed: u64) -> Self {
        Self { shape, tokens, seed }
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
    let topics = (p.tokens / TOKENS_PER_TOPIC).max(8);
    let mut mean: Vec<f32> = (0..d).map(|_| rng.normal() * 0.3).collect();
    let mut outliers = Vec::new();
    for _ in 0..OUTLIER_CHANNELS.min(d) {
        let c = rng.below(d);
        mean[c] += if rng.uniform() < 0.5 { -1.0 } else { 1.0 } * (5.0 + 3.0 * rng.uniform());
        outliers.push(c);
    }
    let centers: Vec<f32> = (0..topics * d).map(|_| rng.normal()).collect();
    let value_centers: Vec<f32> = (0..topics * d).map(|_| rng.normal() * 0.5).collect();
    let mut keys = Vec::with_capacity(p.tokens * d);
    let mut values = Vec::with_capacity(p.tokens * d);
    let mut topic = rng.below(topics);
    let switch = 1.0 / MEAN_RUN_TOKENS as f32;
    for _ in 0..p.tokens {
        if rng.uniform() < switch {
            topic = rng.below(topics);
        }
        let c = &centers[topic * d..(topic + 1) * d];
        let vc = &value_centers[topic * d..(topic + 1) * d];
        let start = keys.len();
        keys.extend((0..d).map(|j| mean[j] + c[j] + rng.normal() * KEY_NOISE));
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
    /// and its sharpness.
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
