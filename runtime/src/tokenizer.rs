//! The tokenizer, built in memory from the GGUF's own vocabulary and merges: byte-level BPE
//! with SmolLM2's pre-tokenizer (every digit alone, then GPT-2's byte-level split), control
//! tokens (`<|im_start|>`, `<|im_end|>`, ...) as special tokens, no BOS.

use crate::error::{Error, Result};
use candle_core::quantized::gguf_file;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::AddedToken;

/// GGUF token type of control tokens.
const CONTROL: i32 = 3;

/// A byte-level BPE tokenizer with the model's chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    eos: u32,
}

impl Tokenizer {
    pub(crate) fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        let get = |key: &str| {
            content.metadata.get(key).ok_or_else(|| Error::BadModel {
                what: key.into(),
                detail: "tokenizer metadata missing (a gpt2-style BPE vocabulary is expected)".into(),
            })
        };
        let list = |key: &str| -> Result<&Vec<gguf_file::Value>> {
            get(key)?.to_vec().map_err(|e| Error::BadModel { what: key.into(), detail: e.to_string() })
        };
        let strings = |key: &str| -> Result<Vec<String>> {
            list(key)?
                .iter()
                .map(|v| {
                    v.to_string().cloned().map_err(|e| Error::BadModel { what: key.into(), detail: e.to_string() })
                })
                .collect()
        };
        let model = get("tokenizer.ggml.model")?.to_string().map_err(|e| Error::Tokenizer(e.to_string()))?;
        if model != "gpt2" {
            return Err(Error::BadModel {
                what: "tokenizer.ggml.model".into(),
                detail: format!("{model}, expected gpt2"),
            });
        }
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())).ok_or_else(|| Error::BadModel {
                    what: "tokenizer.ggml.merges".into(),
                    detail: format!("merge {m:?} is not two symbols separated by a space"),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let types: Vec<i32> = match content.metadata.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()
                .map_err(|e| Error::Tokenizer(e.to_string()))?
                .iter()
                .map(|t| t.to_i32().unwrap_or(1))
                .collect(),
            None => vec![1; tokens.len()],
        };
        let eos = get("tokenizer.ggml.eos_token_id")?.to_u32().map_err(|e| Error::Tokenizer(e.to_string()))?;
        let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let bpe =
            BPE::builder().vocab_and_merges(vocab, merges).build().map_err(|e| Error::Tokenizer(e.to_string()))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(Sequence::new(vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ])));
        inner.with_decoder(Some(ByteLevel::new(false, true, true)));
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == CONTROL)
            .map(|(s, _)| AddedToken::from(s.clone(), true))
            .collect();
        inner.add_special_tokens(specials).map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(Self { inner, eos })
    }

    /// Token ids of `text`; control tokens written in the text (`<|im_end|>`) map to their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.inner.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?.get_ids().to_vec())
    }

    /// Text of `ids` (control tokens kept, so a transcript shows turn boundaries).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// The end-of-turn token (`<|im_end|>`).
    pub fn eos(&self) -> u32 {
        self.eos
    }

    /// The model's chat template (ChatML with its default system prompt) around one user turn,
    /// ending where the assistant's answer starts.
    pub fn chat_prompt(user: &str) -> String {
        format!(
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        )
    }
}
