//! Decode steps over the caller's device memory (feature `cuda`): an embedding runtime hands
//! attnstore its CUDA query tensors and output tensors (e.g. torch's, through DLPack) and
//! its stream; a device-selected step reads the query in place and writes the output in
//! place, ordered after the work the caller queued on that stream, with no host copy of
//! either ([`Engine::attend_device`]). Requests the device step does not serve (exact
//! plans, short contexts, layers not homed in the buffer manager) have their query read to
//! the host, run as [`Engine::execute_gpu`] runs them, and their output written back.

use std::time::Instant;

use attnstore_kernels::cuda::DeviceIo;
pub use attnstore_kernels::cuda::IoDType;

use crate::budget::Budget;
use crate::context::ContextId;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::gpu::GpuRun;
use crate::plan::Request;

/// A decode request whose query and output are tensors in the caller's GPU memory (GPU 0,
/// the device's primary context: torch's and cudarc's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRequest {
    /// The context.
    pub context: ContextId,
    /// The layer.
    pub layer: usize,
    /// Device address of the query: `q_heads × head_dim` C-contiguous elements of `dtype`.
    pub query: u64,
    /// Device address of the output, the same shape and type; written by the call.
    pub output: u64,
    /// Element type of the query and the output.
    pub dtype: IoDType,
}

impl Engine {
    /// Plans `requests` like [`Engine::plan_gpu`] under `budget` and runs them like
    /// [`Engine::execute_gpu`], each query read from and each output written to the
    /// caller's device memory, after the work queued on the caller's `stream` (a `CUstream`
    /// of the primary context; 0 for the legacy default stream) so far. When this returns
    /// the outputs are written (the caller's later work on any stream sees them). A
    /// non-finite query element is an [`Error::NonFinite`]; that request's
    /// output is left as it was. The returned [`GpuRun`] counts where requests ran.
    ///
    /// # Safety
    ///
    /// Each request's `query` must be the device address of `q_heads × head_dim` readable
    /// elements of `dtype` (the context's shape) and `output` of as many writable ones, in
    /// memory of GPU 0's primary context, valid until this returns; `stream` must be a
    /// stream of that context or 0.
    #[allow(unsafe_code, reason = "the caller's device pointers")]
    pub unsafe fn attend_device(&self, requests: &[DeviceRequest], budget: &Budget, stream: u64) -> Result<GpuRun> {
        let start = Instant::now();
        // Planned over zero queries: a device-selected plan reads no query on the host (its
        // selection runs on the device); the others are planned again with theirs below.
        let placeholders = requests
            .iter()
            .map(|r| Ok(Request::new(r.context, r.layer, vec![0.0; self.spec(r.context)?.shape.query_len()])))
            .collect::<Result<Vec<_>>>()?;
        let plan = self.plan_gpu(&placeholders, budget)?;
        plan.check_gpu_codecs(false)?;
        let io: Vec<Option<DeviceIo>> = plan
            .requests
            .iter()
            .zip(requests)
            .map(|(p, r)| {
                p.device.is_some().then_some(DeviceIo { query: r.query, output: r.output, dtype: r.dtype, stream })
            })
            .collect();
        let which: Vec<usize> = (0..requests.len()).filter(|&i| io[i].is_some()).collect();
        let mut run = GpuRun::default();
        let mut done: Vec<Option<Vec<f32>>> = vec![None; requests.len()];
        if !which.is_empty() {
            self.execute_device(&plan, &which, &io, &mut done, &mut run, None)?;
        }
        for (i, r) in requests.iter().enumerate() {
            if done[i].is_some() {
                continue;
            }
            let shape = plan.requests[i].shape;
            let gpu = self.gpu.backend(shape.head_dim)?;
            // SAFETY: the query holds query_len elements of its type (this function's
            // contract), on a stream of the primary context.
            let (q, bad) = unsafe { gpu.read_device(r.query, r.dtype, shape.query_len(), stream) }?;
            if let Some((index, value)) = bad {
                return Err(Error::NonFinite { what: "device queries", index, value });
            }
            let single = self.plan_gpu(&[Request::new(r.context, r.layer, q)], budget)?;
            let (mut out, one) = self.run_gpu(&single, None)?;
            run.absorb(&one);
            // SAFETY: the output holds as many writable elements (the contract).
            unsafe { gpu.write_device(&out.remove(0), r.output, r.dtype, stream) }?;
        }
        crate::metrics::executed(&plan, start.elapsed(), true);
        Ok(run)
    }
}
