//! The llama forward pass on the CPU with candle: GGUF weights (quantized matmuls), RMSNorm,
//! interleaved RoPE, SwiGLU. Prompt attention is computed here, exactly and causally, in
//! chunks; decode attention is handed to an [`AttentionBackend`] — attnstore's engine in a
//! [`crate::Session`] — which receives each layer's post-RoPE query, key and value.

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;
use candle_core::quantized::{gguf_file, QMatMul};
use candle_core::{DType, Device, Module, Tensor};
use std::path::Path;

/// Shape and constants of a llama model, read from GGUF metadata.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelConfig {
    /// Transformer blocks.
    pub layers: usize,
    /// Hidden size.
    pub d_model: usize,
    /// Query heads.
    pub q_heads: usize,
    /// KV heads (GQA).
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// RoPE base frequency.
    pub rope_base: f32,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Longest context the model was trained for.
    pub context_length: usize,
    /// Vocabulary size.
    pub vocab: usize,
}

impl ModelConfig {
    fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        let get = |key: &str| {
            content.metadata.get(key).ok_or_else(|| Error::BadModel {
                what: key.to_string(),
                detail: "metadata key missing (a llama GGUF is expected)".into(),
            })
        };
        let num = |key: &str| -> Result<usize> {
            get(key)?
                .to_u32()
                .map(|v| v as usize)
                .map_err(|e| Error::BadModel { what: key.into(), detail: e.to_string() })
        };
        let float = |key: &str| -> Result<f32> {
            get(key)?.to_f32().map_err(|e| Error::BadModel { what: key.into(), detail: e.to_string() })
        };
        let arch = get("general.architecture")?
            .to_string()
            .map_err(|e| Error::BadModel { what: "general.architecture".into(), detail: e.to_string() })?;
        if arch != "llama" {
            return Err(Error::BadModel {
                what: "general.architecture".into(),
                detail: format!("{arch}, expected llama"),
            });
        }
        let d_model = num("llama.embedding_length")?;
        let q_heads = num("llama.attention.head_count")?;
        let kv_heads = num("llama.attention.head_count_kv")?;
        if q_heads == 0 || kv_heads == 0 || d_model % q_heads != 0 || q_heads % kv_heads != 0 {
            return Err(Error::BadModel {
                what: "attention heads".into(),
                detail: format!("d_model {d_model}, {q_heads} query heads, {kv_heads} KV heads do not divide"),
            });
        }
        let vocab = match content.metadata.get("llama.vocab_size") {
            Some(v) => {
                v.to_u32().map_err(|e| Error::BadModel { what: "llama.vocab_size".into(), detail: e.to_string() })?
                    as usize
            }
            None => content.tensor_infos.get("token_embd.weight").map(|t| t.shape.dims()[0]).unwrap_or(0),
        };
        Ok(Self {
            layers: num("llama.block_count")?,
            d_model,
            q_heads,
            kv_heads,
            head_dim: d_model / q_heads,
            rope_base: float("llama.rope.freq_base").unwrap_or(10_000.0),
            rms_eps: float("llama.attention.layer_norm_rms_epsilon")?,
            context_length: num("llama.context_length")?,
            vocab,
        })
    }

    /// The attention shape attnstore stores this model's KV in.
    pub fn attn_shape(&self) -> attnstore::AttnShape {
        attnstore::AttnShape { q_heads: self.q_heads, kv_heads: self.kv_heads, head_dim: self.head_dim }
    }
}

/// How the weights are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Weights {
    /// As stored (Q4_1 / Q8_0 quantized matmuls): the reference numerics, slow prompts.
    #[default]
    Quantized,
    /// Dequantized to f32 at load (+0.5 GB): ~10x faster prompts, slightly different logits.
    Dequantized,
}

struct Block {
    attn_norm: Tensor,
    wq: QMatMul,
    wk: QMatMul,
    wv: QMatMul,
    wo: QMatMul,
    ffn_norm: Tensor,
    gate: QMatMul,
    up: QMatMul,
    down: QMatMul,
}

/// A loaded model: weights, RoPE tables and the tokenizer from the same GGUF file.
pub struct Model {
    config: ModelConfig,
    weights: Weights,
    embed: Tensor,
    output: QMatMul,
    norm: Tensor,
    blocks: Vec<Block>,
    cos: Tensor,
    sin: Tensor,
    tokenizer: Tokenizer,
}

/// Decode attention for one token: called once per layer with the post-RoPE query
/// (`q_heads × head_dim`), key and value (`kv_heads × head_dim`) of the new token, which
/// the backend must store before attending (the token attends to itself). Returns the
/// attention output, `q_heads × head_dim`.
pub trait AttentionBackend {
    /// Stores `k`/`v` at the next position of `layer` and attends `q` over the layer.
    fn attend(&mut self, layer: usize, q: &[f32], k: &[f32], v: &[f32]) -> Result<Vec<f32>>;
}

/// The prompt after prefill: its tokens, every layer's KV in attnstore's layout
/// (`kv_heads × tokens × head_dim`, f32, post-RoPE keys) and the logits of its last token.
#[derive(Debug, Clone)]
pub struct Prefill {
    /// The prompt's token ids.
    pub tokens: Vec<u32>,
    /// Per layer, `(keys, values)`.
    pub kv: Vec<(Vec<f32>, Vec<f32>)>,
    /// Next-token logits after the last prompt token.
    pub logits: Vec<f32>,
}

impl Model {
    /// Loads a llama GGUF file (weights and tokenizer).
    pub fn load(path: &Path, weights: Weights) -> Result<Self> {
        if !path.exists() {
            return Err(Error::ModelMissing { path: path.to_path_buf() });
        }
        let dev = Device::Cpu;
        let mut file = std::fs::File::open(path).map_err(Error::io(path))?;
        let content = gguf_file::Content::read(&mut file).map_err(|e| Error::BadModel {
            what: path.display().to_string(),
            detail: format!("not a GGUF file: {e}"),
        })?;
        let config = ModelConfig::from_gguf(&content)?;
        let tokenizer = Tokenizer::from_gguf(&content)?;
        let mut tensor = |name: &str| {
            content
                .tensor(&mut file, name, &dev)
                .map_err(|e| Error::BadModel { what: name.into(), detail: e.to_string() })
        };
        let matmul = |q: candle_core::quantized::QTensor| -> Result<QMatMul> {
            Ok(match weights {
                Weights::Quantized => QMatMul::from_qtensor(q)?,
                Weights::Dequantized => QMatMul::Tensor(q.dequantize(&Device::Cpu)?),
            })
        };
        let embed_q = tensor("token_embd.weight")?;
        let embed = embed_q.dequantize(&dev)?;
        // SmolLM2 ties the output projection to the embedding.
        let output = match tensor("output.weight") {
            Ok(t) => matmul(t)?,
            Err(_) => matmul(embed_q)?,
        };
        let norm = tensor("output_norm.weight")?.dequantize(&dev)?;
        let mut blocks = Vec::with_capacity(config.layers);
        for i in 0..config.layers {
            let p = format!("blk.{i}");
            blocks.push(Block {
                attn_norm: tensor(&format!("{p}.attn_norm.weight"))?.dequantize(&dev)?,
                wq: matmul(tensor(&format!("{p}.attn_q.weight"))?)?,
                wk: matmul(tensor(&format!("{p}.attn_k.weight"))?)?,
                wv: matmul(tensor(&format!("{p}.attn_v.weight"))?)?,
                wo: matmul(tensor(&format!("{p}.attn_output.weight"))?)?,
                ffn_norm: tensor(&format!("{p}.ffn_norm.weight"))?.dequantize(&dev)?,
                gate: matmul(tensor(&format!("{p}.ffn_gate.weight"))?)?,
                up: matmul(tensor(&format!("{p}.ffn_up.weight"))?)?,
                down: matmul(tensor(&format!("{p}.ffn_down.weight"))?)?,
            });
        }
        let (cos, sin) = rope_tables(config.head_dim, config.rope_base, config.context_length.max(1), &dev)?;
        Ok(Self { config, weights, embed, output, norm, blocks, cos, sin, tokenizer })
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// How the weights are held.
    pub fn weights(&self) -> Weights {
        self.weights
    }

    /// The tokenizer built from the GGUF's own vocabulary and merges.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    fn check_tokens(&self, tokens: &[u32], start: usize) -> Result<()> {
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= self.config.vocab) {
            return Err(Error::InvalidInput(format!(
                "token id {t} is outside the vocabulary of {}",
                self.config.vocab
            )));
        }
        if start + tokens.len() > self.config.context_length {
            return Err(Error::InvalidInput(format!(
                "{} tokens exceed the model's context of {} tokens",
                start + tokens.len(),
                self.config.context_length
            )));
        }
        Ok(())
    }

    /// Runs the prompt through the model with exact causal attention, `chunk` tokens at a
    /// time, and returns every layer's KV and the last token's logits. `progress` is called
    /// with the number of prompt tokens done after each chunk.
    pub fn prefill(&self, tokens: &[u32], chunk: usize, progress: &mut dyn FnMut(usize)) -> Result<Prefill> {
        if tokens.is_empty() {
            return Err(Error::InvalidInput("the prompt is empty: at least one token is needed".into()));
        }
        if chunk == 0 {
            return Err(Error::InvalidInput("the prefill chunk must hold at least one token".into()));
        }
        self.check_tokens(tokens, 0)?;
        let c = &self.config;
        let mut cache: Vec<Option<(Tensor, Tensor)>> = vec![None; c.layers];
        let mut last = None;
        let mut pos = 0;
        for ids in tokens.chunks(chunk) {
            let n = ids.len();
            let mut x = self.embed.index_select(&Tensor::new(ids, &Device::Cpu)?, 0)?.unsqueeze(0)?;
            let mask = causal_mask(n, pos)?;
            for (l, b) in self.blocks.iter().enumerate() {
                let h = candle_nn::ops::rms_norm(&x, &b.attn_norm, c.rms_eps)?;
                let (q, k, v) = self.qkv(b, &h, pos, n)?;
                let (k, v) = match cache[l].take() {
                    None => (k, v),
                    Some((kc, vc)) => (Tensor::cat(&[&kc, &k], 2)?, Tensor::cat(&[&vc, &v], 2)?),
                };
                let g = c.q_heads / c.kv_heads;
                let (kr, vr) = (repeat_kv(&k, g)?, repeat_kv(&v, g)?);
                let att = (q.matmul(&kr.t()?)? / (c.head_dim as f64).sqrt())?;
                let att = candle_nn::ops::softmax_last_dim(&att.broadcast_add(&mask)?)?;
                let y = att.matmul(&vr)?.transpose(1, 2)?.reshape((1, n, c.d_model))?;
                x = (x + b.wo.forward(&y)?)?;
                x = self.mlp(b, &x)?;
                cache[l] = Some((k, v));
            }
            pos += n;
            progress(pos);
            last = Some(x.narrow(1, n - 1, 1)?);
        }
        let logits = self.logits(&last.expect("the prompt is not empty"))?;
        let kv = cache
            .into_iter()
            .map(|kv| {
                let (k, v) = kv.expect("every layer saw the prompt");
                Ok((k.flatten_all()?.to_vec1::<f32>()?, v.flatten_all()?.to_vec1::<f32>()?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Prefill { tokens: tokens.to_vec(), kv, logits })
    }

    /// Feeds one token at position `pos` (0-based) and returns the next-token logits;
    /// attention is served by `backend`.
    pub fn decode_step(&self, token: u32, pos: usize, backend: &mut dyn AttentionBackend) -> Result<Vec<f32>> {
        self.check_tokens(&[token], pos)?;
        let c = &self.config;
        let mut x = self.embed.index_select(&Tensor::new(&[token], &Device::Cpu)?, 0)?.unsqueeze(0)?;
        for (l, b) in self.blocks.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &b.attn_norm, c.rms_eps)?;
            let (q, k, v) = self.qkv(b, &h, pos, 1)?;
            let flat = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.flatten_all()?.to_vec1::<f32>()?) };
            let y = backend.attend(l, &flat(&q)?, &flat(&k)?, &flat(&v)?)?;
            if y.len() != c.q_heads * c.head_dim {
                return Err(Error::InvalidInput(format!(
                    "attention backend returned {} values for layer {l}, expected q_heads × head_dim = {}",
                    y.len(),
                    c.q_heads * c.head_dim
                )));
            }
            let y = Tensor::from_vec(y, (1, 1, c.d_model), &Device::Cpu)?;
            x = (x + b.wo.forward(&y)?)?;
            x = self.mlp(b, &x)?;
        }
        self.logits(&x)
    }

    /// Query `[1, q_heads, n, d]`, key and value `[1, kv_heads, n, d]` of `n` tokens from
    /// `pos`, RoPE applied to query and key (the interleaved variant: the GGUF converter
    /// permuted the projection rows).
    fn qkv(&self, b: &Block, h: &Tensor, pos: usize, n: usize) -> Result<(Tensor, Tensor, Tensor)> {
        let c = &self.config;
        let heads = |w: &QMatMul, count: usize| -> Result<Tensor> {
            Ok(w.forward(h)?.reshape((1, n, count, c.head_dim))?.transpose(1, 2)?.contiguous()?)
        };
        let (cos, sin) = (self.cos.narrow(0, pos, n)?, self.sin.narrow(0, pos, n)?);
        let q = candle_nn::rotary_emb::rope_i(&heads(&b.wq, c.q_heads)?, &cos, &sin)?;
        let k = candle_nn::rotary_emb::rope_i(&heads(&b.wk, c.kv_heads)?, &cos, &sin)?;
        Ok((q, k, heads(&b.wv, c.kv_heads)?))
    }

    /// Residual SwiGLU block: `x + down(silu(gate(n)) * up(n))`, `n = rms_norm(x)`.
    fn mlp(&self, b: &Block, x: &Tensor) -> Result<Tensor> {
        let h = candle_nn::ops::rms_norm(x, &b.ffn_norm, self.config.rms_eps)?;
        let act = (candle_nn::ops::silu(&b.gate.forward(&h)?)? * b.up.forward(&h)?)?;
        Ok((x + b.down.forward(&act)?)?)
    }

    fn logits(&self, x: &Tensor) -> Result<Vec<f32>> {
        let x = candle_nn::ops::rms_norm(x, &self.norm, self.config.rms_eps)?;
        Ok(self.output.forward(&x)?.flatten_all()?.to_vec1::<f32>()?)
    }
}

/// `cos`/`sin` of `pos · base^(-i/d)` for even `i`, `[positions, d/2]`.
fn rope_tables(head_dim: usize, base: f32, positions: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
    let theta: Vec<f32> = (0..head_dim).step_by(2).map(|i| 1f32 / base.powf(i as f32 / head_dim as f32)).collect();
    let theta = Tensor::new(theta.as_slice(), dev)?;
    let pos = Tensor::arange(0, positions as u32, dev)?.to_dtype(DType::F32)?.reshape((positions, 1))?;
    let angles = pos.matmul(&theta.reshape((1, head_dim / 2))?)?;
    Ok((angles.cos()?, angles.sin()?))
}

/// Additive mask for `rows` new tokens after `past` stored ones: row `i` sees columns
/// `0..=past + i`, `-inf` elsewhere.
fn causal_mask(rows: usize, past: usize) -> Result<Tensor> {
    let cols = past + rows;
    let mask: Vec<f32> =
        (0..rows).flat_map(|i| (0..cols).map(move |j| if j > past + i { f32::NEG_INFINITY } else { 0.0 })).collect();
    Ok(Tensor::from_vec(mask, (rows, cols), &Device::Cpu)?)
}

/// `[1, kv, n, d]` → `[1, kv·g, n, d]`, each KV head repeated for its `g` query heads.
fn repeat_kv(x: &Tensor, g: usize) -> Result<Tensor> {
    if g == 1 {
        return Ok(x.clone());
    }
    let (b, kv, n, d) = x.dims4()?;
    Ok(x.unsqueeze(2)?.expand((b, kv, g, n, d))?.reshape((b, kv * g, n, d))?)
}

/// Index of the largest logit.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Softmax of `logits` in f64 (for KL divergences).
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|&x| x as f64 - lse).collect()
}

/// KL(p ‖ q) of two next-token distributions given as logits.
pub fn kl_divergence(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let (lp, lq) = (log_softmax(p_logits), log_softmax(q_logits));
    lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum::<f64>().max(0.0)
}
