//! Decoder forward passes on the CPU with candle, one per GGUF architecture, sharing the
//! common parts: `llama` (SmolLM2: RMSNorm, interleaved RoPE, SwiGLU), `qwen2` (the llama
//! block with Q/K/V biases and half-split RoPE) and `gemma3` (Gemma-3: QK-norm, pre- and
//! post-norms around attention and MLP, GeGLU, embeddings scaled by √d, tied output,
//! interleaved sliding-window and global layers with their own RoPE bases). Weights are the
//! GGUF's (quantized matmuls). Prompt attention is computed here, exactly and causally, in
//! chunks; decode attention is handed to an [`AttentionBackend`] — attnstore's engine in a
//! [`crate::Session`] — which receives each layer's post-RoPE query, key and value.

use crate::error::{Error, Result};
use crate::gguf::Meta;
use crate::tokenizer::Tokenizer;
use attnstore::LayerKind;
use candle_core::quantized::{gguf_file, QMatMul};
use candle_core::{DType, Device, Module, Tensor};
use std::path::Path;

/// A decoder architecture the runtime runs, named by the GGUF's `general.architecture`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Llama (SmolLM2): the GGUF converter permuted Q/K rows for interleaved RoPE.
    Llama,
    /// Qwen2: the llama block with Q/K/V biases and half-split (NeoX) RoPE.
    Qwen2,
    /// Gemma-3: QK-norm, sandwich norms, GeGLU, √d-scaled embeddings, tied output, five
    /// sliding-window layers to each global one, two RoPE bases.
    Gemma3,
}

impl Arch {
    /// The architecture of a `general.architecture` value; an unknown one is an error that
    /// lists the known ones.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "llama" => Ok(Self::Llama),
            "qwen2" => Ok(Self::Qwen2),
            "gemma3" => Ok(Self::Gemma3),
            other => Err(Error::BadModel {
                what: "general.architecture".into(),
                detail: format!("{other} is not supported: expected llama, qwen2 or gemma3"),
            }),
        }
    }

    /// The GGUF name (also the metadata keys' prefix).
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Gemma3 => "gemma3",
        }
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Gemma-3's layer pattern: of each six layers the first five attend a sliding window, the
/// sixth globally (llama.cpp and transformers use the same fixed pattern for every size).
pub const GEMMA3_WINDOW_PATTERN: usize = 6;

/// Gemma-3's RoPE base of its sliding-window layers when the GGUF does not name one
/// (`gemma3.rope.local_freq_base`).
const GEMMA3_LOCAL_ROPE_BASE: f32 = 10_000.0;

/// Shape and constants of a model, read from GGUF metadata.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelConfig {
    /// The architecture (which forward runs).
    pub arch: Arch,
    /// Transformer blocks.
    pub layers: usize,
    /// Hidden size.
    pub d_model: usize,
    /// Query heads.
    pub q_heads: usize,
    /// KV heads (GQA).
    pub kv_heads: usize,
    /// Head dimension (Gemma-3's is not `d_model / q_heads`).
    pub head_dim: usize,
    /// RoPE base frequency of the global layers.
    pub rope_base: f32,
    /// RoPE position scale of the global layers (1 / the linear scaling factor).
    pub rope_scale: f32,
    /// RoPE base of the sliding-window layers.
    pub rope_base_local: f32,
    /// Tokens a sliding-window layer attends (the token itself included); `None` when every
    /// layer is global.
    pub sliding_window: Option<usize>,
    /// Every this many layers the last is global, the others sliding-window (0: none is).
    pub window_pattern: usize,
    /// The query's scale relative to `1/√head_dim` (the engine applies `1/√head_dim`; Gemma-3
    /// 27B scales by `1/√(d_model/q_heads)` instead).
    pub query_scale: f32,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Longest context the model was trained for.
    pub context_length: usize,
    /// Vocabulary size.
    pub vocab: usize,
}

impl ModelConfig {
    fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        let meta = Meta(content);
        let arch = Arch::parse(&meta.string("general.architecture")?)?;
        let key = |suffix: &str| format!("{}.{suffix}", arch.name());
        let num = |suffix: &str| -> Result<usize> { Ok(meta.u32(&key(suffix))? as usize) };
        let float = |suffix: &str| meta.f32(&key(suffix));
        let optional_float = |suffix: &str| meta.optional(&key(suffix), |v| v.to_f32());
        let d_model = num("embedding_length")?;
        let q_heads = num("attention.head_count")?;
        let kv_heads = num("attention.head_count_kv")?;
        let layers = num("block_count")?;
        if q_heads == 0 || kv_heads == 0 || q_heads % kv_heads != 0 || layers == 0 {
            return Err(Error::BadModel {
                what: "attention heads".into(),
                detail: format!("{layers} layers, {q_heads} query heads, {kv_heads} KV heads: expected at least one layer and KV heads dividing query heads"),
            });
        }
        let head_dim = match arch {
            Arch::Gemma3 => {
                let (kd, vd) = (num("attention.key_length")?, num("attention.value_length")?);
                if kd != vd {
                    return Err(Error::BadModel {
                        what: key("attention.value_length"),
                        detail: format!("{vd}, expected the key length {kd}"),
                    });
                }
                kd
            }
            _ if d_model % q_heads != 0 => {
                return Err(Error::BadModel {
                    what: "attention heads".into(),
                    detail: format!("d_model {d_model} is not a multiple of {q_heads} query heads"),
                })
            }
            _ => d_model / q_heads,
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(Error::BadModel {
                what: "head dimension".into(),
                detail: format!("{head_dim}, expected a positive even number (RoPE rotates pairs)"),
            });
        }
        let vocab = match meta.optional(&key("vocab_size"), |v| v.to_u32())? {
            Some(v) => v as usize,
            None => content.tensor_infos.get("token_embd.weight").map(|t| t.shape.dims()[0]).unwrap_or(0),
        };
        let rope_scale = match optional_float("rope.scaling.factor")? {
            Some(f) if f > 0.0 && f.is_finite() => 1.0 / f,
            Some(f) => {
                return Err(Error::BadModel { what: key("rope.scaling.factor"), detail: format!("{f}, expected > 0") })
            }
            None => 1.0,
        };
        let (sliding_window, window_pattern, rope_base_local, query_scale) = match arch {
            Arch::Gemma3 => {
                let w = num("attention.sliding_window")?;
                if w == 0 {
                    return Err(Error::BadModel {
                        what: key("attention.sliding_window"),
                        detail: "0, expected at least one token".into(),
                    });
                }
                // llama.cpp: the 27B model (62 layers) scales queries by 1/√(d_model/heads).
                let scale = if layers == 62 { (head_dim as f32 / (d_model / q_heads) as f32).sqrt() } else { 1.0 };
                let local = optional_float("rope.local_freq_base")?.unwrap_or(GEMMA3_LOCAL_ROPE_BASE);
                (Some(w), GEMMA3_WINDOW_PATTERN, local, scale)
            }
            _ => (None, 0, 0.0, 1.0),
        };
        let rope_base = match arch {
            Arch::Gemma3 => float("rope.freq_base")?,
            _ => optional_float("rope.freq_base")?.unwrap_or(10_000.0),
        };
        Ok(Self {
            arch,
            layers,
            d_model,
            q_heads,
            kv_heads,
            head_dim,
            rope_base,
            rope_scale,
            rope_base_local,
            sliding_window,
            window_pattern,
            query_scale,
            rms_eps: float("attention.layer_norm_rms_epsilon")?,
            context_length: num("context_length")?,
            vocab,
        })
    }

    /// The attention shape attnstore stores this model's KV in.
    pub fn attn_shape(&self) -> attnstore::AttnShape {
        attnstore::AttnShape { q_heads: self.q_heads, kv_heads: self.kv_heads, head_dim: self.head_dim }
    }

    /// The kind of `layer`: a sliding window of [`Self::sliding_window`] tokens, or global.
    pub fn layer_kind(&self, layer: usize) -> LayerKind {
        match self.sliding_window {
            Some(w) if self.window_pattern > 0 && !(layer + 1).is_multiple_of(self.window_pattern) => {
                LayerKind::SlidingWindow(w)
            }
            _ => LayerKind::Global,
        }
    }

    /// Every layer's kind, in order.
    pub fn layer_kinds(&self) -> Vec<LayerKind> {
        (0..self.layers).map(|l| self.layer_kind(l)).collect()
    }

    /// Indices of the global layers (all of them for llama and qwen2).
    pub fn global_layers(&self) -> Vec<usize> {
        (0..self.layers).filter(|&l| self.layer_kind(l) == LayerKind::Global).collect()
    }

    /// Width of the attention output, `q_heads × head_dim`.
    fn attn_dim(&self) -> usize {
        self.q_heads * self.head_dim
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

/// How the forward rounds its intermediate values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Numerics {
    /// Everything in f32 (the default).
    #[default]
    F32,
    /// ggml's CPU backend's roundings, for agreement checks against llama.cpp (`attnstore
    /// argmax`): GELU from its f16 table; RoPE angles as its cache makes them (each
    /// frequency the previous one times `base^(-2/d)` in f32); queries, keys and values
    /// rounded to f16 (its KV cache and the f16 operand of its attention matmuls) and, in
    /// the prefill, attention probabilities rounded to f16 before they weigh the values.
    /// Decode attention's probabilities stay the attention backend's.
    Ggml,
}

/// One transformer block. The optional parts are those of some architectures only.
struct Block {
    kind: LayerKind,
    attn_norm: Tensor,
    wq: QMatMul,
    wk: QMatMul,
    wv: QMatMul,
    wo: QMatMul,
    /// Qwen2: biases of the Q, K and V projections.
    qkv_bias: Option<[Tensor; 3]>,
    /// Gemma-3: RMSNorm weights of each query and key head (before RoPE).
    qk_norm: Option<(Tensor, Tensor)>,
    /// Gemma-3: RMSNorm of the attention output before the residual add.
    post_attn_norm: Option<Tensor>,
    ffn_norm: Tensor,
    gate: QMatMul,
    up: QMatMul,
    down: QMatMul,
    /// Gemma-3: RMSNorm of the MLP output before the residual add.
    post_ffn_norm: Option<Tensor>,
}

/// Tanh-approximated GELU at f16 precision, the way ggml's CPU backend evaluates it: the
/// input rounded to f16 indexes a table of f16 results (inputs ≤ −10 give 0, ≥ 10 pass
/// through). Differs from f32 GELU by up to an f16 step of input and output; matching it
/// moves the runtime's near-tie argmaxes toward llama.cpp's.
fn gelu_f16_table(x: &Tensor) -> Result<Tensor> {
    use half::f16;
    let shape = x.shape().clone();
    let y: Vec<f32> = x
        .flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(|v| {
            if v <= -10.0 {
                0.0
            } else if v >= 10.0 {
                v
            } else {
                let h = f16::from_f32(v).to_f32();
                let g = 0.5 * h * (1.0 + (0.797_884_6 * h * (1.0 + 0.044_715 * h * h)).tanh());
                f16::from_f32(g).to_f32()
            }
        })
        .collect();
    Ok(Tensor::from_vec(y, shape, x.device())?)
}

/// `cos`/`sin` tables of one RoPE base, `[positions, head_dim/2]`.
struct Rope {
    cos: Tensor,
    sin: Tensor,
}

/// A loaded model: weights, RoPE tables and the tokenizer from the same GGUF file.
pub struct Model {
    config: ModelConfig,
    weights: Weights,
    numerics: Numerics,
    embed: Tensor,
    output: QMatMul,
    norm: Tensor,
    blocks: Vec<Block>,
    /// RoPE of the global layers.
    rope_global: Rope,
    /// RoPE of the sliding-window layers (Gemma-3), else `None`.
    rope_local: Option<Rope>,
    tokenizer: Tokenizer,
}

/// Decode attention for one token: called once per layer with the post-RoPE query
/// (`q_heads × head_dim`), key and value (`kv_heads × head_dim`) of the new token, which
/// the backend must store before attending (the token attends to itself). Returns the
/// attention output, `q_heads × head_dim`. A sliding-window layer attends only its last
/// `W` tokens ([`ModelConfig::layer_kind`]), the new one included.
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
    /// Per layer, `(keys, values)`: every prompt token for a global layer, only the last
    /// `W` (the window) for a sliding-window layer — older ones are never attended again.
    pub kv: Vec<(Vec<f32>, Vec<f32>)>,
    /// Next-token logits after the last prompt token.
    pub logits: Vec<f32>,
    /// Per layer, post-RoPE queries of the prompt's last positions (up to
    /// [`crate::codec_policy::PROBE_QUERIES`] spread over the last
    /// [`crate::codec_policy::PROBE_WINDOW`], across prefill chunks), each
    /// `q_heads × head_dim`, one after another: what a prefill-time codec policy probes the
    /// layer's KV with ([`crate::codec_policy::choose_kv43`]). Empty for a prefix attached
    /// from the remote tier.
    pub probes: Vec<Vec<f32>>,
}

impl Model {
    /// Loads a GGUF file (weights and tokenizer) of a supported architecture ([`Arch`]).
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
        let tokenizer = Tokenizer::from_gguf(&content, config.arch)?;
        let mut tensor = |name: &str| {
            if !content.tensor_infos.contains_key(name) {
                return Err(Error::BadModel {
                    what: name.into(),
                    detail: format!("tensor missing (a {} GGUF has it)", config.arch),
                });
            }
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
        if embed.dims() != [config.vocab, config.d_model] {
            return Err(Error::BadModel {
                what: "token_embd.weight".into(),
                detail: format!("shape {:?}, expected [{}, {}]", embed.dims(), config.vocab, config.d_model),
            });
        }
        // SmolLM2 and Gemma-3 tie the output projection to the embedding.
        let output = if content.tensor_infos.contains_key("output.weight") {
            matmul(tensor("output.weight")?)?
        } else {
            matmul(embed_q)?
        };
        let norm = tensor("output_norm.weight")?.dequantize(&dev)?;
        let arch = config.arch;
        let mut blocks = Vec::with_capacity(config.layers);
        for i in 0..config.layers {
            let mut t = |name: &str| tensor(&format!("blk.{i}.{name}"));
            let qkv_bias = match arch {
                Arch::Qwen2 => Some([
                    t("attn_q.bias")?.dequantize(&dev)?,
                    t("attn_k.bias")?.dequantize(&dev)?,
                    t("attn_v.bias")?.dequantize(&dev)?,
                ]),
                _ => None,
            };
            let (qk_norm, post_attn_norm, post_ffn_norm) = match arch {
                Arch::Gemma3 => (
                    Some((t("attn_q_norm.weight")?.dequantize(&dev)?, t("attn_k_norm.weight")?.dequantize(&dev)?)),
                    Some(t("post_attention_norm.weight")?.dequantize(&dev)?),
                    Some(t("post_ffw_norm.weight")?.dequantize(&dev)?),
                ),
                _ => (None, None, None),
            };
            blocks.push(Block {
                kind: config.layer_kind(i),
                attn_norm: t("attn_norm.weight")?.dequantize(&dev)?,
                wq: matmul(t("attn_q.weight")?)?,
                wk: matmul(t("attn_k.weight")?)?,
                wv: matmul(t("attn_v.weight")?)?,
                wo: matmul(t("attn_output.weight")?)?,
                qkv_bias,
                qk_norm,
                post_attn_norm,
                ffn_norm: t("ffn_norm.weight")?.dequantize(&dev)?,
                gate: matmul(t("ffn_gate.weight")?)?,
                up: matmul(t("ffn_up.weight")?)?,
                down: matmul(t("ffn_down.weight")?)?,
                post_ffn_norm,
            });
        }
        let (rope_global, rope_local) = rope_pair(&config, Numerics::F32)?;
        Ok(Self {
            config,
            weights,
            numerics: Numerics::F32,
            embed,
            output,
            norm,
            blocks,
            rope_global,
            rope_local,
            tokenizer,
        })
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The same model computing with `numerics`.
    pub fn with_numerics(mut self, numerics: Numerics) -> Result<Self> {
        if numerics != self.numerics {
            let (global, local) = rope_pair(&self.config, numerics)?;
            (self.rope_global, self.rope_local) = (global, local);
        }
        self.numerics = numerics;
        Ok(self)
    }

    /// How the forward rounds ([`Numerics`]).
    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    /// `x` rounded to f16 under [`Numerics::Ggml`], else `x` itself.
    fn ggml_f16(&self, x: Tensor) -> Result<Tensor> {
        Ok(match self.numerics {
            Numerics::Ggml => x.to_dtype(DType::F16)?.to_dtype(DType::F32)?,
            Numerics::F32 => x,
        })
    }

    /// How the weights are held.
    pub fn weights(&self) -> Weights {
        self.weights
    }

    /// The tokenizer built from the GGUF's own vocabulary (and merges, for BPE).
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

    /// The embeddings of `ids`, `[1, n, d_model]` (Gemma-3 scales them by `√d_model`).
    fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        let x = self.embed.index_select(&Tensor::new(ids, &Device::Cpu)?, 0)?.unsqueeze(0)?;
        Ok(match self.config.arch {
            Arch::Gemma3 => (x * (self.config.d_model as f64).sqrt())?,
            _ => x,
        })
    }

    /// Runs the prompt through the model with exact causal attention (a sliding window on
    /// window layers), `chunk` tokens at a time, and returns every layer's KV (see
    /// [`Prefill::kv`]) and the last token's logits. `progress` is called with the number of
    /// prompt tokens done after each chunk.
    pub fn prefill(&self, tokens: &[u32], chunk: usize, progress: &mut dyn FnMut(usize)) -> Result<Prefill> {
        self.prefill_after(&[], 0, tokens, chunk, false, progress)
    }

    /// [`Model::prefill`] of `tokens` at positions `start..`, continuing from `past`: every
    /// layer's KV of the first `start` tokens as [`Prefill::kv`] holds it (a global layer's
    /// `start` rows, a window layer's last `min(W, start)`), e.g. a prefix attached from the
    /// remote tier. `past` is empty when `start` is 0. The returned [`Prefill`] holds the KV
    /// of all `start + tokens.len()` tokens (its `tokens` only the new ids) and the logits
    /// of the last one. With `keep_window_rows`, a window layer's KV holds every row from
    /// its first past row on (what a publish to the remote tier needs, so that a prefix
    /// ending anywhere finds its window), not only the last `W`. `progress` counts new
    /// tokens done.
    pub fn prefill_after(
        &self,
        past: &[(Vec<f32>, Vec<f32>)],
        start: usize,
        tokens: &[u32],
        chunk: usize,
        keep_window_rows: bool,
        progress: &mut dyn FnMut(usize),
    ) -> Result<Prefill> {
        self.prefill_rows(past, start, tokens, chunk, keep_window_rows, progress, &mut |_| Ok(()))
    }

    /// [`Model::prefill`] of `tokens`, with the next-token argmax after every prefix: entry
    /// `i` is the model's most likely token after `tokens[..=i]` — the teacher-forced
    /// predictions at every prompt position, as llama.cpp computes them over a batch. The
    /// logits are made 64 rows at a time (a row is the whole vocabulary).
    pub fn prefill_argmax(
        &self,
        tokens: &[u32],
        chunk: usize,
        progress: &mut dyn FnMut(usize),
    ) -> Result<(Prefill, Vec<u32>)> {
        const LOGIT_ROWS: usize = 64;
        let mut best = Vec::with_capacity(tokens.len());
        let p = self.prefill_rows(&[], 0, tokens, chunk, false, progress, &mut |x| {
            let n = x.dim(1)?;
            for at in (0..n).step_by(LOGIT_ROWS) {
                let rows = x.narrow(1, at, LOGIT_ROWS.min(n - at))?;
                let rows = candle_nn::ops::rms_norm(&rows, &self.norm, self.config.rms_eps)?;
                let top = self.output.forward(&rows)?.argmax(candle_core::D::Minus1)?;
                best.extend(top.flatten_all()?.to_vec1::<u32>()?);
            }
            Ok(())
        })?;
        Ok((p, best))
    }

    /// [`Model::prefill_after`], handing every chunk's final hidden rows (`[1, n, d_model]`,
    /// before the output norm) to `rows`.
    #[allow(clippy::too_many_arguments, reason = "prefill_after's arguments and the rows' consumer")]
    fn prefill_rows(
        &self,
        past: &[(Vec<f32>, Vec<f32>)],
        start: usize,
        tokens: &[u32],
        chunk: usize,
        keep_window_rows: bool,
        progress: &mut dyn FnMut(usize),
        rows: &mut dyn FnMut(&Tensor) -> Result<()>,
    ) -> Result<Prefill> {
        if tokens.is_empty() {
            return Err(Error::InvalidInput("the prompt is empty: at least one token is needed".into()));
        }
        if chunk == 0 {
            return Err(Error::InvalidInput("the prefill chunk must hold at least one token".into()));
        }
        self.check_tokens(tokens, start)?;
        let c = &self.config;
        let mut cache: Vec<Option<(Tensor, Tensor)>> = vec![None; c.layers];
        if start > 0 {
            if past.len() != c.layers {
                return Err(Error::InvalidInput(format!(
                    "the past KV has {} layers, the model {}",
                    past.len(),
                    c.layers
                )));
            }
            for (l, (k, v)) in past.iter().enumerate() {
                let rows = match c.layer_kind(l) {
                    LayerKind::Global => start,
                    LayerKind::SlidingWindow(w) => w.min(start),
                };
                let dims = (1, c.kv_heads, rows, c.head_dim);
                if k.len() != c.kv_heads * rows * c.head_dim || v.len() != k.len() {
                    return Err(Error::InvalidInput(format!(
                        "layer {l} of the past KV holds {} values, {} expected ({rows} tokens)",
                        k.len(),
                        c.kv_heads * rows * c.head_dim
                    )));
                }
                cache[l] =
                    Some((Tensor::from_slice(k, dims, &Device::Cpu)?, Tensor::from_slice(v, dims, &Device::Cpu)?));
            }
        }
        // With keep_window_rows: per window layer, its past rows and each chunk's new rows.
        let mut kept: Vec<Vec<(Tensor, Tensor)>> = vec![Vec::new(); c.layers];
        if keep_window_rows {
            for (l, rows) in kept.iter_mut().enumerate() {
                if let (LayerKind::SlidingWindow(_), Some(kv)) = (c.layer_kind(l), &cache[l]) {
                    rows.push(kv.clone());
                }
            }
        }
        let mut last = None;
        let mut probes: Vec<Vec<f32>> = vec![Vec::new(); c.layers];
        let mut pos = start;
        for ids in tokens.chunks(chunk) {
            let n = ids.len();
            let mut x = self.embed(ids)?;
            // Masks by layer kind: global layers keep every token, window layers the last W.
            let global_mask = attention_mask(n, pos, 0, None)?;
            let window_mask = match c.sliding_window {
                Some(w) => Some(attention_mask(n, pos, pos - pos.min(w), Some(w))?),
                None => None,
            };
            for (l, b) in self.blocks.iter().enumerate() {
                let h = candle_nn::ops::rms_norm(&x, &b.attn_norm, c.rms_eps)?;
                let (q, k, v) = self.qkv(b, &h, pos, n)?;
                // The last positions' queries ([1, q_heads, n, d] → [p, q_heads, d]), after
                // those of earlier chunks, keeping the last PROBE_WINDOW (thinned below).
                let p = n.min(crate::codec_policy::PROBE_WINDOW);
                let row = c.q_heads * c.head_dim;
                probes[l]
                    .extend(q.narrow(2, n - p, p)?.transpose(1, 2)?.contiguous()?.flatten_all()?.to_vec1::<f32>()?);
                let extra = probes[l].len().saturating_sub(crate::codec_policy::PROBE_WINDOW * row);
                probes[l].drain(..extra);
                if keep_window_rows && matches!(b.kind, LayerKind::SlidingWindow(_)) {
                    kept[l].push((k.clone(), v.clone()));
                }
                let (k, v) = match cache[l].take() {
                    None => (k, v),
                    Some((kc, vc)) => (Tensor::cat(&[&kc, &k], 2)?, Tensor::cat(&[&vc, &v], 2)?),
                };
                let mask = match (b.kind, &window_mask) {
                    (LayerKind::SlidingWindow(_), Some(m)) => m,
                    _ => &global_mask,
                };
                let g = c.q_heads / c.kv_heads;
                let (kr, vr) = (repeat_kv(&k, g)?, repeat_kv(&v, g)?);
                let att = (q.matmul(&kr.t()?)? / (c.head_dim as f64).sqrt())?;
                let att = self.ggml_f16(candle_nn::ops::softmax_last_dim(&att.broadcast_add(mask)?)?)?;
                let y = att.matmul(&vr)?.transpose(1, 2)?.reshape((1, n, c.attn_dim()))?;
                x = self.attn_residual(b, &x, &y)?;
                x = self.mlp(b, &x)?;
                cache[l] = Some(match b.kind {
                    LayerKind::SlidingWindow(w) if k.dim(2)? > w => {
                        let keep = k.dim(2)? - w;
                        (k.narrow(2, keep, w)?, v.narrow(2, keep, w)?)
                    }
                    _ => (k, v),
                });
            }
            pos += n;
            progress(pos - start);
            rows(&x)?;
            last = Some(x.narrow(1, n - 1, 1)?);
        }
        let logits = self.logits(&last.expect("the prompt is not empty"))?;
        let row = c.q_heads * c.head_dim;
        for p in &mut probes {
            *p = crate::codec_policy::thin_probes(p, row);
        }
        let kv = cache
            .into_iter()
            .zip(kept)
            .map(|(kv, kept)| {
                let (k, v) = match kept.is_empty() {
                    true => kv.expect("every layer saw the prompt"),
                    false => {
                        let (ks, vs): (Vec<Tensor>, Vec<Tensor>) = kept.into_iter().unzip();
                        (Tensor::cat(&ks, 2)?, Tensor::cat(&vs, 2)?)
                    }
                };
                Ok((k.flatten_all()?.to_vec1::<f32>()?, v.flatten_all()?.to_vec1::<f32>()?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Prefill { tokens: tokens.to_vec(), kv, logits, probes })
    }

    /// Feeds one token at position `pos` (0-based) and returns the next-token logits;
    /// attention is served by `backend`.
    pub fn decode_step(&self, token: u32, pos: usize, backend: &mut dyn AttentionBackend) -> Result<Vec<f32>> {
        self.check_tokens(&[token], pos)?;
        let c = &self.config;
        let mut x = self.embed(&[token])?;
        for (l, b) in self.blocks.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &b.attn_norm, c.rms_eps)?;
            let (q, k, v) = self.qkv(b, &h, pos, 1)?;
            let flat = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.flatten_all()?.to_vec1::<f32>()?) };
            let y = backend.attend(l, &flat(&q)?, &flat(&k)?, &flat(&v)?)?;
            if y.len() != c.attn_dim() {
                return Err(Error::InvalidInput(format!(
                    "attention backend returned {} values for layer {l}, expected q_heads × head_dim = {}",
                    y.len(),
                    c.attn_dim()
                )));
            }
            let y = Tensor::from_vec(y, (1, 1, c.attn_dim()), &Device::Cpu)?;
            x = self.attn_residual(b, &x, &y)?;
            x = self.mlp(b, &x)?;
        }
        self.logits(&x)
    }

    /// Query `[1, q_heads, n, d]`, key and value `[1, kv_heads, n, d]` of `n` tokens from
    /// `pos`: projections (plus Qwen2's biases), Gemma-3's per-head QK-norm, then RoPE of the
    /// layer's base — interleaved pairs for llama (the GGUF converter permuted the rows),
    /// half-split for Qwen2 and Gemma-3 — and the query scale.
    fn qkv(&self, b: &Block, h: &Tensor, pos: usize, n: usize) -> Result<(Tensor, Tensor, Tensor)> {
        let c = &self.config;
        let heads = |w: &QMatMul, bias: Option<&Tensor>, count: usize| -> Result<Tensor> {
            let mut y = w.forward(h)?;
            if let Some(bias) = bias {
                y = y.broadcast_add(bias)?;
            }
            Ok(y.reshape((1, n, count, c.head_dim))?.transpose(1, 2)?.contiguous()?)
        };
        let bias = |i: usize| b.qkv_bias.as_ref().map(|bs| &bs[i]);
        let (mut q, mut k) = (heads(&b.wq, bias(0), c.q_heads)?, heads(&b.wk, bias(1), c.kv_heads)?);
        let v = heads(&b.wv, bias(2), c.kv_heads)?;
        if let Some((qn, kn)) = &b.qk_norm {
            q = candle_nn::ops::rms_norm(&q, qn, c.rms_eps)?;
            k = candle_nn::ops::rms_norm(&k, kn, c.rms_eps)?;
        }
        let rope = match (b.kind, &self.rope_local) {
            (LayerKind::SlidingWindow(_), Some(local)) => local,
            _ => &self.rope_global,
        };
        let (cos, sin) = (rope.cos.narrow(0, pos, n)?, rope.sin.narrow(0, pos, n)?);
        let rotate = |x: &Tensor| -> Result<Tensor> {
            Ok(match c.arch {
                Arch::Llama => candle_nn::rotary_emb::rope_i(x, &cos, &sin)?,
                Arch::Qwen2 | Arch::Gemma3 => candle_nn::rotary_emb::rope(x, &cos, &sin)?,
            })
        };
        let mut q = rotate(&q)?;
        if c.query_scale != 1.0 {
            q = (q * c.query_scale as f64)?;
        }
        // Under `Numerics::Ggml`, rounded to f16 as ggml's cache and attention operands are.
        Ok((self.ggml_f16(q)?, self.ggml_f16(rotate(&k)?)?, self.ggml_f16(v)?))
    }

    /// `x + o`, `o = wo(y)` (Gemma-3: RMSNorm-ed first).
    fn attn_residual(&self, b: &Block, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        let mut o = b.wo.forward(y)?;
        if let Some(w) = &b.post_attn_norm {
            o = candle_nn::ops::rms_norm(&o, w, self.config.rms_eps)?;
        }
        Ok((x + o)?)
    }

    /// Residual gated MLP: `x + down(act(gate(n)) * up(n))`, `n = rms_norm(x)`, the
    /// activation SiLU (llama, Qwen2) or tanh-approximated GELU (Gemma-3, whose output is
    /// RMSNorm-ed before the add).
    fn mlp(&self, b: &Block, x: &Tensor) -> Result<Tensor> {
        let eps = self.config.rms_eps;
        let h = candle_nn::ops::rms_norm(x, &b.ffn_norm, eps)?;
        let gate = b.gate.forward(&h)?;
        let gate = match self.config.arch {
            Arch::Gemma3 if self.numerics == Numerics::Ggml => gelu_f16_table(&gate)?,
            Arch::Gemma3 => gate.gelu()?,
            Arch::Llama | Arch::Qwen2 => candle_nn::ops::silu(&gate)?,
        };
        let mut d = b.down.forward(&(gate * b.up.forward(&h)?)?)?;
        if let Some(w) = &b.post_ffn_norm {
            d = candle_nn::ops::rms_norm(&d, w, eps)?;
        }
        Ok((x + d)?)
    }

    fn logits(&self, x: &Tensor) -> Result<Vec<f32>> {
        let x = candle_nn::ops::rms_norm(x, &self.norm, self.config.rms_eps)?;
        Ok(self.output.forward(&x)?.flatten_all()?.to_vec1::<f32>()?)
    }
}

/// The global layers' RoPE tables and the window layers' (Gemma-3), for every position of
/// the model's context, as `numerics` computes them.
fn rope_pair(config: &ModelConfig, numerics: Numerics) -> Result<(Rope, Option<Rope>)> {
    let positions = config.context_length.max(1);
    let global = rope_tables(config.head_dim, config.rope_base, config.rope_scale, positions, numerics)?;
    let local = match config.sliding_window {
        Some(_) => Some(rope_tables(config.head_dim, config.rope_base_local, 1.0, positions, numerics)?),
        None => None,
    };
    Ok((global, local))
}

/// `cos`/`sin` of `scale · pos · base^(-i/d)` for even `i`, `[positions, d/2]`: each angle a
/// product of `pos` and its frequency; under [`Numerics::Ggml`] the frequencies are made as
/// ggml's RoPE cache makes them, `pos` times `base^(-2/d)` again and again in f32 (the
/// rounding of those products differs from the direct power's by up to ~1e-3 radians at a
/// few thousand positions).
fn rope_tables(head_dim: usize, base: f32, scale: f32, positions: usize, numerics: Numerics) -> Result<Rope> {
    let half = head_dim / 2;
    let dev = &Device::Cpu;
    let angles = match numerics {
        Numerics::F32 => {
            let theta: Vec<f32> =
                (0..head_dim).step_by(2).map(|i| scale / base.powf(i as f32 / head_dim as f32)).collect();
            let theta = Tensor::new(theta.as_slice(), dev)?;
            let pos = Tensor::arange(0, positions as u32, dev)?.to_dtype(DType::F32)?.reshape((positions, 1))?;
            pos.matmul(&theta.reshape((1, half))?)?
        }
        Numerics::Ggml => {
            let step = base.powf(-2.0 / head_dim as f32);
            let mut angles = Vec::with_capacity(positions * half);
            for p in 0..positions {
                let mut theta = p as f32;
                for _ in 0..half {
                    angles.push(scale * theta);
                    theta *= step;
                }
            }
            Tensor::from_vec(angles, (positions, half), dev)?
        }
    };
    Ok(Rope { cos: angles.cos()?, sin: angles.sin()? })
}

/// Additive mask for `rows` new tokens at positions `past..past + rows` over the stored
/// columns at positions `first_col..past + rows`: a row sees the columns at or before its
/// position and, with a `window`, less than `window` positions before it; `-inf` elsewhere.
fn attention_mask(rows: usize, past: usize, first_col: usize, window: Option<usize>) -> Result<Tensor> {
    let cols = past + rows - first_col;
    let mask: Vec<f32> = (0..rows)
        .flat_map(|i| {
            (0..cols).map(move |j| {
                let (row, col) = (past + i, first_col + j);
                let visible = col <= row && window.is_none_or(|w| row - col < w);
                if visible {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_table_gelu_is_f32_gelu_at_f16_precision_and_clamps_outside_ten() {
        let xs: Vec<f32> = vec![-12.0, -10.0, -3.3, -0.7, -1e-3, 0.0, 1e-3, 0.123_456, 0.7, 2.5, 9.99, 10.0, 37.5];
        let t = Tensor::from_vec(xs.clone(), (1, xs.len()), &Device::Cpu).unwrap();
        let table = gelu_f16_table(&t).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let exact = t.gelu().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for ((&x, &a), &e) in xs.iter().zip(&table).zip(&exact) {
            if x <= -10.0 {
                assert_eq!(a, 0.0, "x = {x}");
            } else if x >= 10.0 {
                assert_eq!(a, x, "x = {x}");
            } else {
                // Every output is an f16 value, within an f16 step of input and output of f32 GELU.
                assert_eq!(half::f16::from_f32(a).to_f32(), a, "x = {x}: output not an f16 value");
                assert!((a - e).abs() <= 2e-3 * (1.0 + e.abs()), "x = {x}: {a} vs {e}");
            }
        }
        // Inputs that round to the same f16 give the same output (the table's index).
        let pair = Tensor::from_vec(vec![0.700_01f32, 0.700_02], (1, 2), &Device::Cpu).unwrap();
        let out = gelu_f16_table(&pair).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(out[0], out[1]);
    }
}
