//! Timing wave steps on the device: stream marks, and one step's phases measured with events.

use super::*;

/// A point on a backend's stream ([`GpuBackend::mark`]).
pub struct StreamMark(CudaEvent);

impl StreamMark {
    /// Milliseconds of device time from this mark to `later` (waits for `later`).
    pub fn ms_until(&self, later: &StreamMark) -> Result<f64> {
        later.0.synchronize().map_err(gpu_err("waiting for a mark"))?;
        Ok(f64::from(self.0.elapsed_ms(&later.0).map_err(gpu_err("reading an event"))?))
    }
}

impl GpuBackend {
    /// A timing mark on the backend's stream (after everything enqueued so far), to time a
    /// step's device work without changing how it is launched (see [`StreamMark::ms_until`]).
    pub fn mark(&self) -> Result<StreamMark> {
        let e = self
            .stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(gpu_err("recording an event"))?;
        Ok(StreamMark(e))
    }

    /// A timing mark after everything enqueued so far on lanes `0..lanes` of `batch` (steps
    /// of [`GpuBackend::launch_wave_lane`]): the backend's stream waits for those lanes, then
    /// records it. The lanes themselves do not wait for anything.
    pub fn mark_lanes(&self, batch: &WaveBatch, lanes: usize) -> Result<StreamMark> {
        for (main, _) in batch.lanes.iter().take(lanes) {
            self.stream.join(main).map_err(gpu_err("ordering the streams"))?;
        }
        self.mark()
    }

    /// Runs one step like [`GpuBackend::launch_wave`] (eagerly, not from a graph) and returns
    /// the milliseconds of its phases, measured with events: selection (scoring + top-r),
    /// estimation (on the side stream, from the end of the selection), row list, attention,
    /// merge (which waits for the estimation first).
    pub fn wave_phases(
        &self,
        wave: &DeviceWave,
        kv: KvPointers,
        cache: Option<WaveCache<'_>>,
        job: &mut WaveJob,
    ) -> Result<Vec<f64>> {
        let record = |stream: &CudaStream| {
            stream
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(gpu_err("recording an event"))
        };
        self.check_steps(&[WaveStep { wave, kv, cache, job: &mut *job }])?;
        let start = record(&self.stream)?;
        let mut events: Vec<(&'static str, bool, CudaEvent)> = Vec::new();
        self.wave_step(&self.stream, &self.side, wave, kv, cache, job, &mut |name, stream| {
            events.push((name, std::ptr::eq(stream, &*self.side), record(stream)?));
            Ok(())
        })?;
        self.stream.synchronize().map_err(gpu_err("synchronizing"))?;
        // Each phase runs from the previous event on its stream; the side stream's first
        // phase starts when the selection ends.
        let elapsed =
            |a: &CudaEvent, b: &CudaEvent| Ok(f64::from(a.elapsed_ms(b).map_err(gpu_err("reading an event"))?));
        let mut out = Vec::new();
        let (mut main_prev, mut side_prev): (&CudaEvent, Option<&CudaEvent>) = (&start, None);
        for (name, side, e) in &events {
            if *side {
                out.push(elapsed(side_prev.unwrap_or(main_prev), e)?);
                side_prev = Some(e);
            } else {
                out.push(elapsed(main_prev, e)?);
                main_prev = e;
                if *name == "select" {
                    side_prev = Some(e);
                }
            }
        }
        Ok(out)
    }
}
