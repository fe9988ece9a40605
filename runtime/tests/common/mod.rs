//! Shared by the model tests: loading (or skipping), the reference comparison, a naive
//! attention backend.
#![allow(dead_code)]

use attnstore_runtime::{default_model_path, Model, Weights};

pub const PROMPTS: [&str; 3] = [
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a storage engine for attention KV caches in language model inference, \
     and say which one matters most for contexts of 128K tokens and why.",
];

pub fn model_or_skip(weights: Weights) -> Option<Model> {
    let path = default_model_path();
    if !path.exists() {
        eprintln!("SKIPPED: {} not found (run scripts/fetch-model)", path.display());
        return None;
    }
    Some(Model::load(&path, weights).unwrap())
}

/// Largest |a - b| over the largest |b|.
pub fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Says why a comparison with candle-transformers' llama skipped: that crate is compiled in
/// only with the feature `candle-reference`.
pub fn reference_skipped() {
    eprintln!(
        "SKIPPED: the candle-transformers reference is not compiled in \
         (cargo test -p attnstore-runtime --features candle-reference; .ci/run does)"
    );
}

// Not every test file that shares this module compares with the reference.
#[cfg(feature = "candle-reference")]
#[allow(unused_imports)]
pub use reference::compare_with_reference;

/// The comparison with candle-transformers' own llama forward.
#[cfg(feature = "candle-reference")]
mod reference {
    use super::{max_rel, PROMPTS};
    use attnstore::{Codec, DType, Engine, EngineConfig};
    use attnstore_runtime::{argmax, default_model_path, AttnConfig, AttnMethod, Model, Session};
    use candle_core::{Device, Tensor};
    use candle_transformers::models::quantized_llama::ModelWeights;

    /// What the comparison with candle-transformers' llama found.
    #[derive(Debug, Default)]
    pub struct Agreement {
        /// Largest relative logit difference at the prompt's last token.
        pub prefill: f32,
        /// Largest relative logit difference over the decode steps.
        pub decode: f32,
        /// Positions whose argmax agreed, of all compared.
        pub argmax: (usize, usize),
    }

    /// Runs every prompt through candle-transformers' quantized llama (whole prompt at once, then
    /// its greedy continuation token by token) and through the runtime (prefill in `chunk`-token
    /// pieces, decode attention by attnstore's exact method with `dtype` storage), feeding both
    /// the reference's argmax, and compares the logits at every position.
    pub fn compare_with_reference(model: &Model, dtype: DType, chunk: usize, steps: usize) -> Agreement {
        let path = default_model_path();
        let mut a = Agreement::default();
        for prompt in PROMPTS {
            let ids = model.tokenizer().encode(&model.tokenizer().chat_prompt(prompt)).unwrap();
            let mut file = std::fs::File::open(&path).unwrap();
            let content = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
            let mut reference = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
            let logits = |r: &mut ModelWeights, ids: &[u32], pos: usize| -> Vec<f32> {
                let input = Tensor::new(ids, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
                r.forward(&input, pos).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
            };
            let mut want = logits(&mut reference, &ids, 0);
            let prefill = model.prefill(&ids, chunk, &mut |_| {}).unwrap();
            let engine = Engine::in_memory(EngineConfig::default()).unwrap();
            let config = AttnConfig { codec: Codec::from(dtype).into(), ..AttnConfig::new(AttnMethod::Exact) };
            let mut session = Session::new(model, &engine, config, &prefill, false).unwrap();
            let mut got = prefill.logits.clone();
            a.prefill = a.prefill.max(max_rel(&got, &want));
            for step in 0..steps {
                if step > 0 {
                    a.decode = a.decode.max(max_rel(&got, &want));
                }
                a.argmax.0 += usize::from(argmax(&got) == argmax(&want));
                a.argmax.1 += 1;
                let next = argmax(&want);
                want = logits(&mut reference, &[next], ids.len() + step);
                got = session.step(next).unwrap();
            }
        }
        a
    }
}

/// Plain f64 attention over every stored token: the runtime's decode path with no engine.
pub struct NaiveAttention {
    pub shape: attnstore::AttnShape,
    pub kv: Vec<(Vec<f32>, Vec<f32>)>,
}

impl attnstore_runtime::AttentionBackend for NaiveAttention {
    fn attend(&mut self, layer: usize, q: &[f32], k: &[f32], v: &[f32]) -> attnstore_runtime::Result<Vec<f32>> {
        let (h, d, g) = (self.shape.kv_heads, self.shape.head_dim, self.shape.group());
        let (keys, values) = &mut self.kv[layer];
        // Stored as [kv_heads, tokens, d]: insert the new token at the end of every head.
        let t = keys.len() / (h * d);
        let mut nk = Vec::with_capacity(keys.len() + k.len());
        let mut nv = Vec::with_capacity(keys.len() + k.len());
        for head in 0..h {
            nk.extend_from_slice(&keys[head * t * d..(head + 1) * t * d]);
            nk.extend_from_slice(&k[head * d..(head + 1) * d]);
            nv.extend_from_slice(&values[head * t * d..(head + 1) * t * d]);
            nv.extend_from_slice(&v[head * d..(head + 1) * d]);
        }
        (*keys, *values) = (nk, nv);
        let t = t + 1;
        let mut out = vec![0f32; q.len()];
        for qh in 0..self.shape.q_heads {
            let head = qh / g;
            let qv = &q[qh * d..(qh + 1) * d];
            let scores: Vec<f64> = (0..t)
                .map(|j| {
                    let kr = &keys[(head * t + j) * d..(head * t + j + 1) * d];
                    qv.iter().zip(kr).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() / (d as f64).sqrt()
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = w.iter().sum();
            for (j, wj) in w.iter().enumerate() {
                let vr = &values[(head * t + j) * d..(head * t + j + 1) * d];
                for (o, x) in out[qh * d..(qh + 1) * d].iter_mut().zip(vr) {
                    *o += (wj / z * *x as f64) as f32;
                }
            }
        }
        Ok(out)
    }
}
