//! Index builds that run in the background (a PQ index's codebook training), as the engine
//! sees them: a [`BuildHandle`] to wait on and the [`BuildReport`] of what the build did.
//! Methods with such a build return a handle from
//! [`AccessMethod::build_handle`](crate::AccessMethod::build_handle); the handle knows the
//! build only through the crate-private [`BuildState`], so this module names no method.

use crate::error::Result;
use crate::pq::PqLayout;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a codebook build did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BuildReport {
    /// Sub-spaces and bits.
    pub layout: PqLayout,
    /// Centroids per sub-space actually trained (≤ `2^b`; fewer for tiny contexts).
    pub codes: usize,
    /// Tokens encoded per head.
    pub tokens: usize,
    /// Rows each codebook was trained on.
    pub train_rows: usize,
    /// The iteration limit (from the time budget, or the cap).
    pub iters_limit: usize,
    /// Most iterations any sub-space ran.
    pub iters_run: usize,
    /// Sub-space jobs that converged before the limit, of `jobs`.
    pub converged_jobs: usize,
    /// Jobs (KV heads × sub-spaces).
    pub jobs: usize,
    /// The caller's budget, if one was given.
    pub budget: Option<Duration>,
    /// Build time the time model predicted for the limit (with a budget).
    pub predicted: Option<Duration>,
    /// Wall time of the build.
    pub elapsed: Duration,
}

/// A build as its handle sees it (implemented by the method that runs it).
pub(crate) trait BuildState: Send + Sync + fmt::Debug {
    /// What the build did, once it is done and succeeded.
    fn report(&self) -> Option<BuildReport>;
    /// Waits until the build has finished or `deadline` passed: `Ok(true)` when it is
    /// ready, `Ok(false)` when still running, the build's error if it failed.
    fn wait_until(&self, deadline: Instant) -> Result<bool>;
}

/// A handle on an index build that may still be running in the background.
#[derive(Debug, Clone)]
pub struct BuildHandle {
    state: Arc<dyn BuildState>,
}

impl BuildHandle {
    pub(crate) fn new(state: Arc<dyn BuildState>) -> Self {
        Self { state }
    }

    /// True once the index is built and plans use it.
    pub fn is_ready(&self) -> bool {
        self.state.report().is_some()
    }

    /// Waits up to `timeout` for the build: `Ok(true)` when ready, `Ok(false)` when still
    /// running at the deadline, the build's error if it failed (plans then stay exact).
    pub fn wait(&self, timeout: Duration) -> Result<bool> {
        self.state.wait_until(Instant::now() + timeout)
    }

    /// What the build did, once it is done.
    pub fn report(&self) -> Option<BuildReport> {
        self.state.report()
    }
}
