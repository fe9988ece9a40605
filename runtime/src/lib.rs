//! attnstore-runtime: GGUF decoders on the CPU with candle — `llama` (SmolLM2), `qwen2` and
//! `gemma3` (Gemma-3, with its sliding-window layers) — their decode attention served by
//! attnstore, the way an inference runtime embeds the engine.
//!
//! [`Model::load`] reads a GGUF file (weights and tokenizer; the architecture from its
//! metadata), [`Model::prefill`] runs a prompt with exact causal attention and returns every
//! layer's KV (a window layer's last `W` tokens only), and a [`Session`] stores that KV in an
//! engine context whose layer kinds are the model's and runs each decode step's attention as
//! one plan per layer under a method (exact, wave, pq, oracle top-k) and budget: global
//! layers by the method, sliding-window layers exactly over their window.
//! [`synth`] writes small models of each architecture with random weights for tests.

pub mod codec_policy;
mod error;
pub mod eval;
mod gguf;
mod model;
pub mod remote;
mod session;
pub mod synth;
mod tokenizer;
pub mod trace;

pub use error::{Error, Result};
pub use model::{
    argmax, kl_divergence, log_softmax, Arch, AttentionBackend, Model, ModelConfig, Numerics, Prefill, Weights,
    GEMMA3_WINDOW_PATTERN,
};
pub use session::{
    default_budget, relative_l2, AttnConfig, AttnMethod, CodecPolicy, Session, SessionStats, RETRIEVE_FLOOR_TOKENS,
    SHORT_CONTEXT_TOKENS,
};
pub use tokenizer::Tokenizer;

/// Where the model is looked for: `$ATTNSTORE_MODEL`, else `models/SmolLM2-135M-Instruct.Q4_1.gguf`
/// in the repository (where `scripts/fetch-model` puts it).
pub fn default_model_path() -> std::path::PathBuf {
    match std::env::var_os("ATTNSTORE_MODEL") {
        Some(p) => p.into(),
        None => std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    }
}
