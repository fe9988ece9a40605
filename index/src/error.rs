//! The error type of the index crate.

/// Errors of access methods: bad parameters or data that does not fit the index's shape.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// A parameter was out of range.
    #[error("invalid index parameter {what}: {message}")]
    InvalidParameter {
        /// Which parameter.
        what: &'static str,
        /// What was wrong and what is expected.
        message: String,
    },
    /// KV or query data did not match the index's heads and head dimension.
    #[error("{what}: expected {expected} elements, got {got}")]
    ShapeMismatch {
        /// Which argument.
        what: &'static str,
        /// Elements expected.
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// A kernel rejected its input.
    #[error(transparent)]
    Kernel(#[from] attnstore_kernels::Error),
    /// The row home could not store or serve rows (full tiers, a corrupt or lost block, an
    /// I/O failure, a lock timeout): never served as data.
    #[error("row home: {0}")]
    Home(crate::home::HomeError),
    /// Rows the index expected in the buffer manager are not mapped there.
    #[error("missing rows: {0}")]
    MissingRows(String),
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
