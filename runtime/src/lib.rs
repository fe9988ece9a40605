//! attnstore-runtime: SmolLM2 (the llama architecture) on the CPU with candle, its decode
//! attention served by attnstore — the way an inference runtime embeds the engine.
//!
//! [`Model::load`] reads a GGUF file (weights and tokenizer), [`Model::prefill`] runs a
//! prompt with exact causal attention and returns every layer's KV, and a [`Session`]
//! stores that KV in an engine context and runs each decode step's attention as one plan
//! per layer under a method (exact, wave, pq, oracle top-k) and budget.

mod error;
pub mod eval;
mod model;
mod session;
mod tokenizer;
pub mod trace;

pub use error::{Error, Result};
pub use model::{argmax, kl_divergence, log_softmax, AttentionBackend, Model, ModelConfig, Prefill, Weights};
pub use session::{
    default_budget, relative_l2, AttnConfig, AttnMethod, Session, SessionStats, RETRIEVE_FLOOR_TOKENS,
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
