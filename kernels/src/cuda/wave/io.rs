//! Queries and outputs in the caller's device memory: an embedding runtime's CUDA tensors
//! read and written in place, ordered after the work the caller queued on its own stream. A
//! device step reads its query from the caller's tensor and writes its output there inside
//! its own graph: the host names both in the job's I/O descriptor before the launch, the
//! step's first kernel (`step_ingest`) converts the f32 / f16 / bf16 query to the f32 the
//! step reads, and its last (`attn_merge`) writes the output in the tensor's type — no
//! launch besides the step's graph, and nothing crosses to the host but the step's selection.
//! Requests the device step does not serve go through `io_import` / `io_export` (`io.cu`).

use super::{gpu_err, GpuBackend, Result, WaveBatch, WaveJob, WaveStep};
use cudarc::driver::{sys, CudaEvent, CudaStream, LaunchConfig, PushKernelArg};

/// Element type of a tensor in the caller's device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IoDType {
    /// 32-bit floats.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
}

impl IoDType {
    /// The element type's code in `io.cu`.
    pub(super) fn code(self) -> i32 {
        match self {
            IoDType::F32 => 0,
            IoDType::F16 => 1,
            IoDType::Bf16 => 2,
        }
    }

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            IoDType::F32 => 4,
            IoDType::F16 | IoDType::Bf16 => 2,
        }
    }
}

/// A step's query and output in the caller's device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceIo {
    /// Device address of the query: `q_heads × head_dim` C-contiguous elements of `dtype`.
    pub query: u64,
    /// Device address of the output, the same shape and type.
    pub output: u64,
    /// The element type of both.
    pub dtype: IoDType,
    /// The caller's stream (a `CUstream` of the device's primary context; 0 is the legacy
    /// default stream): the query is read after the work queued on it so far.
    pub stream: u64,
}

/// Threads per CTA of the import and export kernels.
const IO_THREADS: u32 = 256;

impl GpuBackend {
    /// Enqueues one decode step of `step` on lane `lane` of `batch` like
    /// [`GpuBackend::launch_wave_lane`], its query read from and its output written to the
    /// caller's device memory `io` by the step's own kernels, after the work queued on
    /// `io.stream` so far. [`GpuBackend::fetch_wave_selected`] waits for the whole of it (the
    /// output's write included); then [`GpuBackend::io_status`] says whether the query was
    /// finite (if not, nothing was written to `io.output`).
    ///
    /// # Safety
    ///
    /// `io.query` must address `q_heads × head_dim` elements of `io.dtype` readable by this
    /// device and `io.output` as many writable ones, both in memory of the device's primary
    /// context and valid until the step is fetched; `io.stream` must be a stream of that
    /// context (or 0).
    #[allow(unsafe_code, reason = "the caller vouches for the device addresses the step's kernels use")]
    pub unsafe fn launch_wave_lane_io(
        &self,
        batch: &WaveBatch,
        lane: usize,
        step: &mut WaveStep<'_>,
        io: &DeviceIo,
    ) -> Result<()> {
        let main = &batch.lane(lane)?.0;
        // The job's last step must be done with its descriptor.
        step.job.io.wait()?;
        if step.job.io.caller.is_none() {
            step.job.io.caller = Some(self.event()?);
        }
        let caller = step.job.io.caller.as_ref().expect("made above");
        self.after_caller(main, caller, io.stream)?;
        step.job.io.device = Some(*io);
        let launched = self.launch_wave_lane(batch, lane, step);
        // A failed launch leaves no descriptor for the job's next step.
        step.job.io.device = None;
        launched
    }

    /// After the job's last step was fetched: `Some((i, x))` when element `i` of the query
    /// its last [`GpuBackend::launch_wave_lane_io`] read was not finite (`x`; the step ran on
    /// a zero there and wrote no output), `None` when all were or the step took a host query.
    pub fn io_status(&self, job: &WaveJob) -> Option<BadElement> {
        bad_element(job.io.status.as_slice())
    }

    /// Reads `len` elements of the caller's device tensor at `src` (type `dtype`) as f32,
    /// after the work queued on `stream`, for a request the device step does not serve; with
    /// a non-finite element's index and value if there was one (read as 0).
    ///
    /// # Safety
    ///
    /// As [`GpuBackend::launch_wave_lane_io`]'s query: `len` readable elements at `src`, a
    /// stream of the primary context.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    pub unsafe fn read_device(
        &self,
        src: u64,
        dtype: IoDType,
        len: usize,
        stream: u64,
    ) -> Result<(Vec<f32>, Option<BadElement>)> {
        let mut dst = self.mailbox::<f32>(len)?;
        let status = self.mailbox::<i32>(2)?;
        let caller = self.event()?;
        self.after_caller(&self.stream, &caller, stream)?;
        let (code, count, to, st) = (dtype.code(), len as i32, dst.dev, status.dev);
        let mut b = self.stream.launch_builder(&self.io_import);
        b.arg(&src).arg(&code).arg(&count).arg(&to).arg(&st);
        // SAFETY: `src` holds `len` elements of `dtype` (the contract); `to` and `st` are
        // mapped mailboxes of `len` floats and two ints, alive until the synchronize below.
        unsafe { b.launch(io_config(len)) }.map_err(gpu_err("launching io_import"))?;
        self.stream.synchronize().map_err(gpu_err("reading a device tensor"))?;
        Ok((dst.as_mut().to_vec(), bad_element(status.as_slice())))
    }

    /// Writes `values` into the caller's device tensor at `dst` (type `dtype`), ordered
    /// before the work the caller queues on `stream` after this returns.
    ///
    /// # Safety
    ///
    /// As [`GpuBackend::launch_wave_lane_io`]'s output: `values.len()` writable elements at
    /// `dst`, a stream of the primary context.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    pub unsafe fn write_device(&self, values: &[f32], dst: u64, dtype: IoDType, stream: u64) -> Result<()> {
        let mut src = self.mailbox::<f32>(values.len())?;
        src.as_mut().copy_from_slice(values);
        let status = self.mailbox::<i32>(2)?;
        let caller = self.event()?;
        self.after_caller(&self.stream, &caller, stream)?;
        let (code, count, from, st) = (dtype.code(), values.len() as i32, src.dev, status.dev);
        let mut b = self.stream.launch_builder(&self.io_export);
        b.arg(&from).arg(&dst).arg(&code).arg(&count).arg(&st);
        // SAFETY: `from` is a mapped mailbox of `values.len()` floats and `st` a zero word,
        // both alive until the synchronize below; `dst` holds as many elements of `dtype`.
        unsafe { b.launch(io_config(values.len())) }.map_err(gpu_err("launching io_export"))?;
        // Done before returning: the caller's later work on its stream sees the output.
        self.stream.synchronize().map_err(gpu_err("writing a device tensor"))
    }

    /// An event without timing.
    fn event(&self) -> Result<CudaEvent> {
        self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)).map_err(gpu_err("creating an event"))
    }

    /// Makes `ours` wait for the work queued on the caller's `stream` so far, through `event`.
    #[allow(unsafe_code, reason = "records an event on a stream cudarc does not own")]
    fn after_caller(&self, ours: &CudaStream, event: &CudaEvent, stream: u64) -> Result<()> {
        self.ctx.bind_to_thread().map_err(gpu_err("binding the context"))?;
        // SAFETY: `event` is a live event of this context and `stream` a stream of it (the
        // callers' contracts; 0 is the legacy default stream).
        let recorded = unsafe { sys::cuEventRecord(event.cu_event(), stream as sys::CUstream) };
        recorded.result().map_err(gpu_err("recording an event on the caller's stream"))?;
        ours.wait(event).map_err(gpu_err("waiting for the caller's stream"))
    }
}

/// A non-finite element of a query: its index and value.
pub type BadElement = (usize, f32);

/// The non-finite element an import's status names.
fn bad_element(status: &[i32]) -> Option<BadElement> {
    match status[0] {
        0 => None,
        at => Some((at as usize - 1, f32::from_bits(status[1] as u32))),
    }
}

/// A launch of `n` threads for the import and export kernels.
fn io_config(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(IO_THREADS).max(1), 1, 1),
        block_dim: (IO_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}
