//! The engine's error type: everything a caller can get wrong, and the typed failures of the
//! layers below, each with what was expected and what came.

use crate::ContextId;
use std::path::PathBuf;

/// Errors of the engine API.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// No context with this id exists (never created, or dropped).
    #[error("unknown context {0}")]
    UnknownContext(ContextId),
    /// The layer index is beyond the context's layers.
    #[error("unknown layer {layer} of context {context}: it has {layers} layers")]
    UnknownLayer {
        /// The context.
        context: ContextId,
        /// The layer asked for.
        layer: usize,
        /// Layers the context has.
        layers: usize,
    },
    /// A buffer had the wrong number of elements.
    #[error("{what}: expected {expected}, got {got} elements")]
    ShapeMismatch {
        /// Which argument, with its expected layout.
        what: &'static str,
        /// Elements expected (or a multiple of it, as the message says).
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// Input contained NaN or ±Inf.
    #[error("{what} contains a non-finite value ({value}) at element {index}")]
    NonFinite {
        /// Which argument.
        what: &'static str,
        /// Index of the first bad element.
        index: usize,
        /// The value found.
        value: f32,
    },
    /// A budget field is out of range.
    #[error("invalid budget: {0}")]
    InvalidBudget(String),
    /// A context spec or engine config is unusable.
    #[error("invalid spec: {0}")]
    InvalidSpec(String),
    /// A layer was prefilled twice; later tokens go through `append`.
    #[error("layer {layer} of context {context} already holds {tokens} tokens: prefill a layer once, then append")]
    AlreadyPrefilled {
        /// The context.
        context: ContextId,
        /// The layer.
        layer: usize,
        /// Tokens it holds.
        tokens: usize,
    },
    /// The context changed between planning and execution: tokens were appended, or its
    /// index was rebuilt and swapped in (then the token counts are equal).
    #[error(
        "stale plan: layer {layer} of context {context} changed since it was planned ({planned} tokens then, \
         {now} now: rows appended or its index rebuilt); plan again"
    )]
    StalePlan {
        /// The context.
        context: ContextId,
        /// The layer.
        layer: usize,
        /// Tokens at plan time.
        planned: usize,
        /// Tokens now.
        now: usize,
    },
    /// A request index or query head beyond the plan.
    #[error("{what} {got} out of range (plan has {limit})")]
    OutOfRange {
        /// Which index.
        what: &'static str,
        /// The index given.
        got: usize,
        /// The number of valid entries.
        limit: usize,
    },
    /// An access method rejected its input or parameters.
    #[error(transparent)]
    Index(attnstore_index::Error),
    /// A kernel rejected its input.
    #[error(transparent)]
    Kernel(#[from] attnstore_kernels::Error),
    /// The buffer manager refused (out of memory, bad block size).
    #[error(transparent)]
    Buffer(#[from] attnstore_buffer::Error),
    /// The write-ahead log failed: I/O error, a poisoned writer (an earlier fsync failed,
    /// so durable writes are refused), or corruption in a log or manifest file.
    #[error(transparent)]
    Wal(#[from] attnstore_wal::Error),
    /// Stored bytes fail a check: a data-file chunk, a record payload or the manifest's
    /// catalog. Never served; the engine refuses to open.
    #[error("{file}: corrupt at offset {offset}: {detail}")]
    Corrupt {
        /// The file.
        file: PathBuf,
        /// Byte offset of the bad chunk or record frame.
        offset: u64,
        /// What was expected and what came.
        detail: String,
    },
    /// A data file that committed records point into does not exist.
    #[error("{file}: data file missing, the log commits {committed_bytes} bytes in it")]
    MissingDataFile {
        /// The data file.
        file: PathBuf,
        /// Bytes the manifest and log say it holds.
        committed_bytes: u64,
    },
    /// A data file is shorter than what the log says was committed to it.
    #[error("{file}: data file holds {got_bytes} bytes, the log commits {expected_bytes}")]
    DataFileShort {
        /// The data file.
        file: PathBuf,
        /// Committed bytes.
        expected_bytes: u64,
        /// Bytes found.
        got_bytes: u64,
    },
    /// The log files a directory must have are gone (every opened directory keeps at least
    /// the file its log continues in).
    #[error("{file}: missing, the log must continue there (at lsn {expected_lsn})")]
    MissingLog {
        /// The log file that should be there.
        file: PathBuf,
        /// The LSN replay must start at.
        expected_lsn: u64,
    },
    /// A file the directory must have is gone.
    #[error("{file}: missing: {why}")]
    MissingFile {
        /// The file.
        file: PathBuf,
        /// How recovery knows it should be there.
        why: String,
    },
    /// Another engine (in this or another process) has the directory open.
    #[error("{dir}: already opened by another engine (lock file {lock} is held)")]
    DirectoryLocked {
        /// The engine directory.
        dir: PathBuf,
        /// The lock file.
        lock: PathBuf,
    },
    /// The directory is not an engine directory (it has no `IDENTITY` file) and was not to be
    /// made one: nothing in it was changed.
    #[error("{}: not an attnstore engine directory: found {found}", dir.display())]
    NotAnEngineDirectory {
        /// The directory.
        dir: PathBuf,
        /// What is there instead.
        found: String,
    },
    /// A GPU execution was asked for a layer whose codec's GPU kernels cannot serve the
    /// request (`kv43`: host-made plans, exact or of one selection per KV head, on
    /// `Engine::execute_gpu`, with key groups and value blocks of whole 64-row blocks and a
    /// head dimension that is a multiple of 64): run it with [`crate::Engine::execute`] on
    /// the CPU.
    #[error("{context} layer {layer}: the {codec} codec cannot run on the GPU here: {why}; execute it on the CPU (Engine::execute)")]
    NoGpuKernels {
        /// The context.
        context: ContextId,
        /// The layer.
        layer: usize,
        /// The layer's codec.
        codec: attnstore_kernels::Codec,
        /// What the GPU kernels would need.
        why: String,
    },
    /// A durable operation (checkpoint, sync) was asked of an in-memory engine.
    #[error("{0} needs a durable engine (Engine::open), this one is in memory")]
    NotDurable(&'static str),
}

/// The class of an [`Error`], for embeddings that map errors to their own kinds (the C
/// ABI's status codes, the Python exception classes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// An array of the wrong shape, or NaN/Inf in it.
    Shape,
    /// No such context or layer.
    UnknownContext,
    /// A bad budget, spec or argument (e.g. a second prefill of a layer).
    InvalidArgument,
    /// A layer changed since its plan was made.
    StalePlan,
    /// Stored data failed its checks.
    Corrupt,
    /// The buffer manager, disk or log failed or is full.
    Storage,
    /// Anything else.
    Other,
}

impl Error {
    /// This error's class.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::ShapeMismatch { .. } | Error::NonFinite { .. } => ErrorKind::Shape,
            Error::UnknownContext(_) | Error::UnknownLayer { .. } => ErrorKind::UnknownContext,
            Error::InvalidBudget(_)
            | Error::InvalidSpec(_)
            | Error::AlreadyPrefilled { .. }
            | Error::OutOfRange { .. }
            | Error::NoGpuKernels { .. } => ErrorKind::InvalidArgument,
            Error::StalePlan { .. } => ErrorKind::StalePlan,
            Error::Corrupt { .. } | Error::DataFileShort { .. } => ErrorKind::Corrupt,
            Error::Buffer(_) | Error::Wal(_) => ErrorKind::Storage,
            _ => ErrorKind::Other,
        }
    }
}

impl From<attnstore_index::Error> for Error {
    /// An index error, except that a failure of the buffer manager homing the index's rows
    /// comes back as the buffer manager's own [`Error::Buffer`].
    fn from(e: attnstore_index::Error) -> Self {
        if let attnstore_index::Error::Home(home) = &e {
            if let Some(buffer) = home.0.downcast_ref::<attnstore_buffer::Error>() {
                return Error::Buffer(buffer.clone());
            }
        }
        Error::Index(e)
    }
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Returns an error naming the first non-finite element of `data`.
pub(crate) fn check_finite(what: &'static str, data: &[f32]) -> Result<()> {
    match attnstore_kernels::first_non_finite(data) {
        Some(index) => Err(Error::NonFinite { what, index, value: data[index] }),
        None => Ok(()),
    }
}
