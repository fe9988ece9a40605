//! The bench crate's error: what the engine, a kernel or the write-ahead log refused while
//! a bench ran, or a bench setting that makes its figures meaningless.

/// An error of a bench run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The engine refused or failed an operation.
    #[error(transparent)]
    Engine(#[from] attnstore::Error),
    /// A kernel rejected its input (the exact baseline's views of the synthetic KV).
    #[error(transparent)]
    Kernel(#[from] attnstore_kernels::Error),
    /// The write-ahead log, or a scratch file of the durability bench, failed.
    #[error(transparent)]
    Wal(#[from] attnstore_wal::Error),
    /// A bench setting is unusable (e.g. a rate over zero records).
    #[error("invalid bench setting: {0}")]
    InvalidSetting(String),
    /// A chart could not be drawn, rasterized or written.
    #[error("plot failed: {0}")]
    Plot(String),
}

/// `Result` with the bench crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
