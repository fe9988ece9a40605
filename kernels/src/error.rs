//! The error type of the kernels crate: every shape or value problem a kernel can detect.

/// Errors returned by kernel entry points when their inputs do not fit together.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// A buffer had the wrong number of elements for the shape it was described with.
    #[error("{what}: expected {expected} elements, got {got}")]
    ShapeMismatch {
        /// Which argument was wrong.
        what: &'static str,
        /// Elements the shape calls for.
        expected: usize,
        /// Elements that came.
        got: usize,
    },
    /// The number of query heads is not a multiple of the number of KV heads (GQA).
    #[error("GQA mismatch: {q_heads} query heads cannot be grouped over {kv_heads} KV heads (q_heads must be a positive multiple of kv_heads)")]
    GqaMismatch {
        /// Query heads given.
        q_heads: usize,
        /// KV heads given.
        kv_heads: usize,
    },
    /// A dimension that must be positive was zero.
    #[error("{what} must be positive, got 0")]
    ZeroDimension {
        /// Which dimension.
        what: &'static str,
    },
    /// The GPU (CUDA driver, NVRTC, a launch) failed, or there is no GPU.
    #[error("GPU: {what}: {message}")]
    Gpu {
        /// What was being done.
        what: &'static str,
        /// The driver's or compiler's message.
        message: String,
    },
    /// An argument was out of its valid range.
    #[error("invalid argument {what}: {message}")]
    InvalidArgument {
        /// Which argument.
        what: &'static str,
        /// What was wrong and what was expected.
        message: String,
    },
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
