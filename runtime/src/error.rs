//! Errors of the runtime.

use std::path::PathBuf;

/// Everything the runtime can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The model file is not there.
    #[error("model file {path} not found: run scripts/fetch-model (or pass --model / set ATTNSTORE_MODEL)")]
    ModelMissing {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// The GGUF file lacks something the llama runtime needs, or has an unsupported value.
    #[error("model {what}: {detail}")]
    BadModel {
        /// What was wrong (a metadata key or tensor name).
        what: String,
        /// What was expected.
        detail: String,
    },
    /// A tensor operation failed inside candle.
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
    /// The tokenizer could not be built or could not encode/decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The attention engine refused a request.
    #[error("attnstore engine: {0}")]
    Engine(#[from] attnstore::Error),
    /// Bad input from the caller (empty prompt, too long a context, unknown token id...).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// A trace directory is missing a file, is truncated or fails its checksum.
    #[error("trace {path}: {detail}")]
    BadTrace {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
    /// An I/O error on a named file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// Result of the runtime.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { path, source }
    }
}
