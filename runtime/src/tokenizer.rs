//! The tokenizer, built in memory from the GGUF's own vocabulary: byte-level BPE with the
//! merges (`tokenizer.ggml.model = gpt2`; SmolLM2's and Qwen2's pre-tokenizers, chosen by
//! `tokenizer.ggml.pre`) or SentencePiece-style score merging with byte fallback
//! (`tokenizer.ggml.model = llama`, Gemma-3). Control tokens written in a text map to their
//! ids; the chat template and the BOS token follow the model.

use crate::error::{Error, Result};
use crate::gguf::Meta;
use crate::model::Arch;
use candle_core::quantized::gguf_file;
use std::collections::{BinaryHeap, HashMap};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

/// GGUF token type of control tokens.
const CONTROL: i32 = 3;
/// GGUF token type of user-defined tokens (Gemma-3's runs of newlines and spaces).
const USER_DEFINED: i32 = 4;

/// Qwen2's pre-tokenizer split (as llama.cpp and the model's `tokenizer.json` define it).
const QWEN2_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The tokenizer of a model, with its chat template.
pub struct Tokenizer {
    inner: Inner,
    eos: u32,
    bos: Option<u32>,
    arch: Arch,
}

enum Inner {
    Bpe(Box<tokenizers::Tokenizer>),
    Spm(Box<Spm>),
}

impl Tokenizer {
    pub(crate) fn from_gguf(content: &gguf_file::Content, arch: Arch) -> Result<Self> {
        let meta = Meta(content);
        let tokens = meta.strings("tokenizer.ggml.tokens")?;
        let types = meta.per_token("tokenizer.ggml.token_type", tokens.len(), 1, |v| v.to_i32())?;
        let eos = meta.u32("tokenizer.ggml.eos_token_id")?;
        let bos = match meta.optional("tokenizer.ggml.add_bos_token", |v| v.to_bool())? {
            Some(true) => Some(meta.u32("tokenizer.ggml.bos_token_id")?),
            _ => None,
        };
        let model = meta.string("tokenizer.ggml.model")?;
        let inner = match model.as_str() {
            "gpt2" => Inner::Bpe(Box::new(bpe(&meta, &tokens, &types)?)),
            "llama" => {
                let scores = meta.per_token("tokenizer.ggml.scores", tokens.len(), 0.0, |v| v.to_f32())?;
                let unk = meta.u32("tokenizer.ggml.unknown_token_id").unwrap_or(0);
                if meta.optional("tokenizer.ggml.add_space_prefix", |v| v.to_bool())? == Some(true) {
                    return Err(Error::BadModel {
                        what: "tokenizer.ggml.add_space_prefix".into(),
                        detail: "true is not supported (Gemma-3's SentencePiece vocabulary has false)".into(),
                    });
                }
                Inner::Spm(Box::new(Spm::new(tokens, scores, &types, unk)))
            }
            other => {
                return Err(Error::BadModel {
                    what: "tokenizer.ggml.model".into(),
                    detail: format!("{other}, expected gpt2 (byte-level BPE) or llama (SentencePiece)"),
                })
            }
        };
        let vocab = match &inner {
            Inner::Bpe(t) => t.get_vocab_size(true),
            Inner::Spm(s) => s.pieces.len(),
        } as u32;
        if let Some(id) = [Some(eos), bos].into_iter().flatten().find(|&id| id >= vocab) {
            return Err(Error::BadModel {
                what: "tokenizer.ggml.eos_token_id / bos_token_id".into(),
                detail: format!("token {id} is outside the vocabulary of {vocab}"),
            });
        }
        Ok(Self { inner, eos, bos, arch })
    }

    /// Token ids of `text` (no BOS); control tokens written in the text (`<|im_end|>`,
    /// `<start_of_turn>`) map to their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.inner {
            Inner::Bpe(t) => Ok(t.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?.get_ids().to_vec()),
            Inner::Spm(s) => Ok(s.encode(text)),
        }
    }

    /// Token ids of a prompt: the BOS token where the model wants one (Gemma-3), then
    /// [`Self::encode`] of `text`.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids: Vec<u32> = self.bos.into_iter().collect();
        ids.extend(self.encode(text)?);
        Ok(ids)
    }

    /// Text of `ids` (control tokens kept, so a transcript shows turn boundaries).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match &self.inner {
            Inner::Bpe(t) => t.decode(ids, false).map_err(|e| Error::Tokenizer(e.to_string())),
            Inner::Spm(s) => s.decode(ids),
        }
    }

    /// The end-of-sequence token (SmolLM2's `<|im_end|>`, Gemma-3's `<eos>`).
    pub fn eos(&self) -> u32 {
        self.eos
    }

    /// The token every prompt starts with, if the model has one (`tokenizer.ggml.add_bos_token`).
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The model's chat template around one user turn, ending where the answer starts:
    /// ChatML with SmolLM2's default system prompt (llama), ChatML with Qwen2's (qwen2), or
    /// Gemma's turns (gemma3). The BOS token is not in the text ([`Self::encode_prompt`]).
    pub fn chat_prompt(&self, user: &str) -> String {
        match self.arch {
            Arch::Llama => format!(
                "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
                 <|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
            ),
            Arch::Qwen2 => format!(
                "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n\
                 <|im_start|>assistant\n"
            ),
            Arch::Gemma3 => format!("<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"),
        }
    }
}

/// A byte-level BPE tokenizer from the GGUF's vocabulary and merges, its pre-tokenizer named
/// by `tokenizer.ggml.pre`.
fn bpe(meta: &Meta, tokens: &[String], types: &[i32]) -> Result<tokenizers::Tokenizer> {
    let merges = meta
        .strings("tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())).ok_or_else(|| Error::BadModel {
                what: "tokenizer.ggml.merges".into(),
                detail: format!("merge {m:?} is not two symbols separated by a space"),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(|e| Error::Tokenizer(e.to_string()))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let pre = meta.0.metadata.get("tokenizer.ggml.pre").and_then(|v| v.to_string().ok().cloned());
    let byte_level = |regex: bool| PreTokenizerWrapper::from(ByteLevel::new(false, true, regex));
    let steps: Vec<PreTokenizerWrapper> = match pre.as_deref() {
        // SmolLM2: every digit alone, then GPT-2's byte-level split.
        Some("smollm") => vec![Digits::new(true).into(), byte_level(true)],
        Some("qwen2") => {
            let split = Split::new(SplitPattern::Regex(QWEN2_SPLIT.into()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| Error::Tokenizer(e.to_string()))?;
            vec![split.into(), byte_level(false)]
        }
        None | Some("default") | Some("gpt-2") | Some("gpt2") => vec![byte_level(true)],
        Some(other) => {
            return Err(Error::BadModel {
                what: "tokenizer.ggml.pre".into(),
                detail: format!("{other} is not supported: expected smollm, qwen2 or gpt-2"),
            })
        }
    };
    inner.with_pre_tokenizer(Some(Sequence::new(steps)));
    inner.with_decoder(Some(ByteLevel::new(false, true, true)));
    let specials: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|(_, &t)| t == CONTROL)
        .map(|(s, _)| AddedToken::from(s.clone(), true))
        .collect();
    inner.add_special_tokens(specials).map_err(|e| Error::Tokenizer(e.to_string()))?;
    Ok(inner)
}

/// SentencePiece-style tokenization from pieces and scores (Gemma-3): control and
/// user-defined tokens are cut out of the text first, longest first; each remaining piece of
/// text, spaces written `▁`, starts as one symbol per character and the adjacent pair whose
/// concatenation is the highest-scoring vocabulary piece is merged until none is; symbols not
/// in the vocabulary fall back to their UTF-8 bytes (`<0xNN>`). The same procedure as
/// llama.cpp's, so the ids agree with it (checked by `scripts/llamacpp-check`).
struct Spm {
    pieces: Vec<String>,
    scores: Vec<f32>,
    ids: HashMap<String, u32>,
    /// Control and user-defined tokens, longest first.
    specials: Vec<(String, u32)>,
    /// Byte-fallback token of every byte value.
    bytes: [Option<u32>; 256],
    /// Per token, the byte a byte-fallback token stands for.
    byte_of: HashMap<u32, u8>,
    unk: u32,
}

/// A bigram candidate of the merge loop: higher score first, then the leftmost.
#[derive(PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    len: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.score.total_cmp(&other.score).then(other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// A symbol of the merge loop: a byte range of the text, linked to its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    fn new(pieces: Vec<String>, scores: Vec<f32>, types: &[i32], unk: u32) -> Self {
        let ids: HashMap<String, u32> = pieces.iter().enumerate().map(|(i, p)| (p.clone(), i as u32)).collect();
        let mut specials: Vec<(String, u32)> = pieces
            .iter()
            .zip(types)
            .enumerate()
            .filter(|(_, (p, &t))| (t == CONTROL || t == USER_DEFINED) && !p.is_empty())
            .map(|(i, (p, _))| (p.clone(), i as u32))
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let mut bytes = [None; 256];
        let mut byte_of = HashMap::new();
        for (b, slot) in bytes.iter_mut().enumerate() {
            if let Some(&id) = ids.get(&format!("<0x{b:02X}>")) {
                *slot = Some(id);
                byte_of.insert(id, b as u8);
            }
        }
        Self { pieces, scores, ids, specials, bytes, byte_of, unk }
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        // Cut the special tokens out, longest first: fragments are raw text or a token.
        let mut fragments: Vec<std::result::Result<&str, u32>> = vec![Ok(text)];
        for (special, id) in &self.specials {
            if !text.contains(special.as_str()) {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len());
            for f in fragments {
                match f {
                    Ok(raw) if raw.contains(special.as_str()) => {
                        let mut rest = raw;
                        while let Some(at) = rest.find(special.as_str()) {
                            if at > 0 {
                                next.push(Ok(&rest[..at]));
                            }
                            next.push(Err(*id));
                            rest = &rest[at + special.len()..];
                        }
                        if !rest.is_empty() {
                            next.push(Ok(rest));
                        }
                    }
                    other => next.push(other),
                }
            }
            fragments = next;
        }
        let mut out = Vec::with_capacity(text.len() / 3);
        for f in fragments {
            match f {
                Ok(raw) => self.encode_raw(raw, &mut out),
                Err(id) => out.push(id),
            }
        }
        out
    }

    fn encode_raw(&self, raw: &str, out: &mut Vec<u32>) {
        let text = raw.replace(' ', "\u{2581}");
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, ch)) in text.char_indices().enumerate() {
            symbols.push(Symbol { start, len: ch.len_utf8(), prev: i.checked_sub(1), next: Some(i + 1) });
        }
        let Some(last) = symbols.last_mut() else { return };
        last.next = None;
        let mut queue = BinaryHeap::new();
        let try_pair = |queue: &mut BinaryHeap<Bigram>, symbols: &[Symbol], left: Option<usize>| {
            let Some(l) = left else { return };
            let Some(r) = symbols[l].next else { return };
            let (s, e) = (symbols[l].start, symbols[r].start + symbols[r].len);
            if let Some(&id) = self.ids.get(&text[s..e]) {
                queue.push(Bigram { score: self.scores[id as usize], left: l, len: e - s });
            }
        };
        for i in 0..symbols.len() {
            try_pair(&mut queue, &symbols, Some(i));
        }
        while let Some(b) = queue.pop() {
            let left = symbols[b.left];
            let Some(r) = left.next else { continue };
            let right = symbols[r];
            if left.len == 0 || right.len == 0 || left.len + right.len != b.len {
                continue; // stale: one side merged since
            }
            symbols[b.left].len += right.len;
            symbols[b.left].next = right.next;
            symbols[r].len = 0;
            if let Some(n) = right.next {
                symbols[n].prev = Some(b.left);
            }
            try_pair(&mut queue, &symbols, left.prev);
            try_pair(&mut queue, &symbols, Some(b.left));
        }
        let mut at = Some(0);
        while let Some(i) = at {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => out.extend(piece.bytes().map(|b| self.bytes[b as usize].unwrap_or(self.unk))),
            }
            at = s.next;
        }
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            if let Some(&b) = self.byte_of.get(&id) {
                bytes.push(b);
                continue;
            }
            let piece = self.pieces.get(id as usize).ok_or_else(|| {
                Error::Tokenizer(format!("token id {id} is outside the vocabulary of {}", self.pieces.len()))
            })?;
            bytes.extend_from_slice(piece.replace('\u{2581}', " ").as_bytes());
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}
