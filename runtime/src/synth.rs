//! Small models with random weights and the real GGUF layout of each architecture — the
//! metadata keys, tensor names and shapes, and a tokenizer of the architecture's kind — so
//! the forward passes are tested (and cross-checked against llama.cpp with
//! `scripts/llamacpp-check`) without downloading real weights. Weights are f32, seeded.

use crate::error::{Error, Result};
use crate::model::Arch;
use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use std::path::Path;

/// The shape of a generated model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SynthConfig {
    /// The architecture (metadata keys, tensors and tokenizer follow it).
    pub arch: Arch,
    /// Transformer blocks (Gemma-3: a multiple of six keeps its pattern whole).
    pub layers: usize,
    /// Hidden size.
    pub d_model: usize,
    /// Query heads.
    pub q_heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension (llama and Qwen2 need `d_model / q_heads`).
    pub head_dim: usize,
    /// MLP width.
    pub ffn: usize,
    /// Gemma-3's sliding window (ignored by the others).
    pub window: usize,
    /// Context length written in the metadata.
    pub context_length: usize,
    /// Seed of the weights.
    pub seed: u64,
}

impl SynthConfig {
    /// A small model of `arch`: 64-wide, 4 query and 2 KV heads, 2 layers (Gemma-3: 6, with a
    /// 16-token window and 32-wide heads, unlike `d_model / q_heads`).
    pub fn small(arch: Arch) -> Self {
        let gemma = arch == Arch::Gemma3;
        Self {
            arch,
            layers: if gemma { 6 } else { 2 },
            d_model: 64,
            q_heads: 4,
            kv_heads: 2,
            head_dim: if gemma { 32 } else { 16 },
            ffn: 128,
            window: 16,
            context_length: 1024,
            seed: 7,
        }
    }
}

/// The GGUF metadata of a generated model: architecture keys and tokenizer.
pub fn metadata(c: &SynthConfig) -> Vec<(String, Value)> {
    let a = c.arch.name();
    let mut m = vec![
        ("general.architecture".to_string(), Value::String(a.into())),
        ("general.name".into(), Value::String(format!("attnstore synthetic {a}"))),
        (format!("{a}.block_count"), Value::U32(c.layers as u32)),
        (format!("{a}.context_length"), Value::U32(c.context_length as u32)),
        (format!("{a}.embedding_length"), Value::U32(c.d_model as u32)),
        (format!("{a}.feed_forward_length"), Value::U32(c.ffn as u32)),
        (format!("{a}.attention.head_count"), Value::U32(c.q_heads as u32)),
        (format!("{a}.attention.head_count_kv"), Value::U32(c.kv_heads as u32)),
        (format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
        (format!("{a}.rope.freq_base"), Value::F32(if c.arch == Arch::Gemma3 { 1e6 } else { 10_000.0 })),
        (format!("{a}.rope.dimension_count"), Value::U32(c.head_dim as u32)),
    ];
    if c.arch == Arch::Gemma3 {
        m.push((format!("{a}.attention.key_length"), Value::U32(c.head_dim as u32)));
        m.push((format!("{a}.attention.value_length"), Value::U32(c.head_dim as u32)));
        m.push((format!("{a}.attention.sliding_window"), Value::U32(c.window as u32)));
    }
    m.extend(tokenizer_metadata(c.arch));
    m
}

/// Printable ASCII, the characters of every generated vocabulary.
fn ascii() -> impl Iterator<Item = char> {
    (b' '..=b'~').map(char::from)
}

/// Merges of the byte-level BPE vocabularies: frequent English pairs, then their results.
const MERGES: [(&str, &str); 12] = [
    ("t", "h"),
    ("Ġ", "t"),
    ("h", "e"),
    ("i", "n"),
    ("e", "r"),
    ("a", "n"),
    ("Ġt", "he"),
    ("o", "n"),
    ("Ġ", "a"),
    ("r", "e"),
    ("in", "g"),
    ("Ġ", "s"),
];

/// Tokenizer metadata: byte-level BPE (llama, Qwen2; ChatML control tokens) or a
/// SentencePiece vocabulary with byte fallback (Gemma-3; its turn tokens and a user-defined
/// run of newlines).
fn tokenizer_metadata(arch: Arch) -> Vec<(String, Value)> {
    let strings = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
    let mut m = Vec::new();
    match arch {
        Arch::Llama | Arch::Qwen2 => {
            // GPT-2's byte-to-unicode map: printable bytes stand for themselves.
            let mut tokens: Vec<String> = (0u32..256).map(|b| byte_char(b as u8).to_string()).collect();
            tokens.extend(MERGES.iter().map(|(a, b)| format!("{a}{b}")));
            let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
            let first_special = tokens.len();
            tokens.extend(specials.iter().map(|s| s.to_string()));
            let types: Vec<Value> =
                (0..tokens.len()).map(|i| Value::I32(if i >= first_special { 3 } else { 1 })).collect();
            m.push(("tokenizer.ggml.model".to_string(), Value::String("gpt2".into())));
            m.push((
                "tokenizer.ggml.pre".into(),
                Value::String(if arch == Arch::Qwen2 { "qwen2" } else { "smollm" }.into()),
            ));
            m.push(("tokenizer.ggml.tokens".into(), strings(tokens)));
            m.push(("tokenizer.ggml.token_type".into(), Value::Array(types)));
            m.push(("tokenizer.ggml.merges".into(), strings(MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect())));
            m.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(first_special as u32 + 2)));
            m.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(first_special as u32)));
            m.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)));
        }
        Arch::Gemma3 => {
            let mut tokens: Vec<String> =
                ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n\n"]
                    .iter()
                    .map(|s| s.to_string())
                    .collect();
            let mut types = vec![3, 3, 3, 3, 3, 3, 4];
            for b in 0..=255u8 {
                tokens.push(format!("<0x{b:02X}>"));
                types.push(6);
            }
            let words = ["▁the", "▁a", "th", "he", "in", "er", "an", "▁t", "▁s", "re", "on", "ing", "▁", "▁th"];
            let mut scores = vec![0.0f32; tokens.len()];
            for (i, w) in words.iter().enumerate() {
                tokens.push(w.to_string());
                types.push(1);
                scores.push(-(i as f32));
            }
            for ch in ascii().filter(|&c| c != ' ') {
                tokens.push(ch.to_string());
                types.push(1);
                scores.push(-100.0);
            }
            m.push(("tokenizer.ggml.model".to_string(), Value::String("llama".into())));
            m.push(("tokenizer.ggml.pre".into(), Value::String("default".into())));
            m.push(("tokenizer.ggml.tokens".into(), strings(tokens)));
            m.push(("tokenizer.ggml.scores".into(), Value::Array(scores.into_iter().map(Value::F32).collect())));
            m.push(("tokenizer.ggml.token_type".into(), Value::Array(types.into_iter().map(Value::I32).collect())));
            m.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(2)));
            m.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(1)));
            m.push(("tokenizer.ggml.unknown_token_id".into(), Value::U32(3)));
            m.push(("tokenizer.ggml.padding_token_id".into(), Value::U32(0)));
            m.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(true)));
            m.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false)));
        }
    }
    m
}

/// GPT-2's byte-level alphabet: printable Latin-1 bytes as themselves, the others shifted
/// past 255 (space is `Ġ`).
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    if printable(b) {
        return char::from(b);
    }
    let shifted = (0..=255u8).filter(|&x| !printable(x)).position(|x| x == b).expect("a non-printable byte");
    char::from_u32(256 + shifted as u32).expect("a valid char")
}

/// Vocabulary size of the generated tokenizer of `arch`.
fn vocab(arch: Arch) -> usize {
    tokenizer_metadata(arch)
        .iter()
        .find(|(k, _)| k == "tokenizer.ggml.tokens")
        .and_then(|(_, v)| v.to_vec().ok().map(Vec::len))
        .expect("the tokenizer has tokens")
}

/// A seeded normal generator (SplitMix64 + Box-Muller): weights without a dependency.
struct Normal(u64);

impl Normal {
    fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn sample(&mut self, n: usize, mean: f32, std: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let (u, v) = (self.uniform().max(1e-12), self.uniform());
                mean + std * ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
            })
            .collect()
    }
}

/// The tensors of a generated model, named as llama.cpp names them, f32.
pub fn tensors(c: &SynthConfig) -> Result<Vec<(String, QTensor)>> {
    let mut rng = Normal(c.seed);
    let mut out = Vec::new();
    let mut add = |name: String, shape: &[usize], mean: f32, std: f32| -> Result<()> {
        let data = rng.sample(shape.iter().product(), mean, std);
        let t = Tensor::from_vec(data, shape, &Device::Cpu)?;
        out.push((name, QTensor::quantize(&t, GgmlDType::F32)?));
        Ok(())
    };
    let (d, q, kv, f) = (c.d_model, c.q_heads * c.head_dim, c.kv_heads * c.head_dim, c.ffn);
    let w = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    let vocab = vocab(c.arch);
    add("token_embd.weight".into(), &[vocab, d], 0.0, if c.arch == Arch::Gemma3 { 0.2 } else { 1.0 })?;
    add("output_norm.weight".into(), &[d], 1.0, 0.1)?;
    if c.arch == Arch::Qwen2 {
        add("output.weight".into(), &[vocab, d], 0.0, w(d))?;
    }
    for i in 0..c.layers {
        let p = |n: &str| format!("blk.{i}.{n}");
        add(p("attn_norm.weight"), &[d], 1.0, 0.1)?;
        add(p("attn_q.weight"), &[q, d], 0.0, w(d))?;
        add(p("attn_k.weight"), &[kv, d], 0.0, w(d))?;
        add(p("attn_v.weight"), &[kv, d], 0.0, w(d))?;
        add(p("attn_output.weight"), &[d, q], 0.0, w(q))?;
        add(p("ffn_norm.weight"), &[d], 1.0, 0.1)?;
        add(p("ffn_gate.weight"), &[f, d], 0.0, w(d))?;
        add(p("ffn_up.weight"), &[f, d], 0.0, w(d))?;
        add(p("ffn_down.weight"), &[d, f], 0.0, w(f))?;
        match c.arch {
            Arch::Qwen2 => {
                add(p("attn_q.bias"), &[q], 0.0, 0.5)?;
                add(p("attn_k.bias"), &[kv], 0.0, 0.5)?;
                add(p("attn_v.bias"), &[kv], 0.0, 0.5)?;
            }
            Arch::Gemma3 => {
                add(p("attn_q_norm.weight"), &[c.head_dim], 1.0, 0.1)?;
                add(p("attn_k_norm.weight"), &[c.head_dim], 1.0, 0.1)?;
                add(p("post_attention_norm.weight"), &[d], 1.0, 0.1)?;
                add(p("post_ffw_norm.weight"), &[d], 1.0, 0.1)?;
            }
            Arch::Llama => {}
        }
    }
    Ok(out)
}

/// Writes a GGUF file of `metadata` and `tensors`.
pub fn write_gguf(path: &Path, metadata: &[(String, Value)], tensors: &[(String, QTensor)]) -> Result<()> {
    let mut file = std::fs::File::create(path).map_err(Error::io(path))?;
    let meta: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tens: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    candle_core::quantized::gguf_file::write(&mut file, &meta, &tens)?;
    Ok(())
}

/// Writes a generated model of `config` to `path`.
pub fn write_model(path: &Path, config: &SynthConfig) -> Result<()> {
    write_gguf(path, &metadata(config), &tensors(config)?)
}
