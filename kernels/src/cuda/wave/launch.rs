//! Launching wave steps: one request, one lane of a batch, or a batch of requests at once,
//! each from graphs captured per set of buffers (or eagerly), and the events that mark a
//! step done.

use super::*;

/// Graphs kept per job or batch: a job alternating between a few sets of buffers (e.g. with
/// and without a cache) replays each set's graph.
const GRAPHS_KEPT: usize = 4;

/// Captured steps, newest last, each under the key of the buffers it launches over.
#[derive(Default)]
pub(super) struct Graphs {
    cached: Vec<(Vec<u64>, CudaGraph)>,
    pub(super) off: bool,
}

// SAFETY: a CudaGraph holds driver handles of an instantiated graph (and an Arc of the
// stream it launches on). The driver API may be called on them from any thread once the
// context is current, which cudarc's launch does; `Graphs` is only used through `&mut` (a
// job's or batch's exclusive borrow), so moving it between threads never makes two threads
// use one graph at once.
#[allow(unsafe_code, reason = "cudarc's graph type carries raw driver handles and is not Send")]
unsafe impl Send for Graphs {}

/// A request's main and side streams in a batch.
pub(super) type Lane = (Arc<CudaStream>, Arc<CudaStream>);

/// Streams (two per request) and captured graphs for batched wave steps.
pub struct WaveBatch {
    pub(super) lanes: Vec<Lane>,
    graphs: Graphs,
    /// Recorded once after each batch launch; every job of the batch waits for it.
    done: Arc<CudaEvent>,
}

impl WaveBatch {
    /// Lane `lane`'s streams, or an error naming the batch's size.
    pub(super) fn lane(&self, lane: usize) -> Result<&Lane> {
        self.lanes.get(lane).ok_or_else(|| Error::InvalidArgument {
            what: "wave lane",
            message: format!("lane {lane} of a batch of {} lanes", self.lanes.len()),
        })
    }

    /// Requests a step of this batch can hold.
    pub fn capacity(&self) -> usize {
        self.lanes.len()
    }

    /// Waits for everything enqueued on the batch's streams (after a failed launch: nothing
    /// may still read a step's buffers or slots when the caller lets them go).
    pub fn synchronize(&self) -> Result<()> {
        for (main, side) in &self.lanes {
            main.synchronize().map_err(gpu_err("synchronizing a lane"))?;
            side.synchronize().map_err(gpu_err("synchronizing a lane"))?;
        }
        Ok(())
    }

    /// Whether steps are captured into graphs (the default) or launched kernel by kernel.
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs.off = !on;
    }
}

impl GpuBackend {
    /// Enqueues one decode step of `job` over `wave`, whose KV rows are at `kv` (device or
    /// mapped host memory, `kv_heads × rows × head_dim`), with the blocks `table` names read
    /// from `cache` instead. Returns before the kernels finish; [`GpuBackend::fetch_wave`]
    /// waits and returns the output. The step's launches are captured into a CUDA graph the
    /// first time this job runs over these buffers and replayed after that (one host call
    /// per step instead of about ten; see [`WaveJob::set_graphs`]).
    pub fn launch_wave(
        &self,
        wave: &DeviceWave,
        kv: KvPointers,
        cache: Option<WaveCache<'_>>,
        job: &mut WaveJob,
    ) -> Result<()> {
        let home = (Arc::clone(&self.stream), Arc::clone(&self.side));
        self.launch_one(&home, WaveStep { wave, kv, cache, job }, false)
    }

    /// Enqueues one decode step of `step` alone on lane `lane` of `batch` (the lane's own
    /// streams) and returns: a caller stepping many requests launches each as soon as its
    /// query is set, so the device runs the first while the host prepares the next, and the
    /// requests on different lanes run at once like a [`GpuBackend::launch_wave_batch`]. Each
    /// job keeps its graphs per lane (a single-request graph launches in ~2 µs of host time;
    /// one graph of six lanes took ~23 µs on the H100 host). [`GpuBackend::fetch_wave`] of
    /// the job waits for this step only.
    pub fn launch_wave_lane(&self, batch: &WaveBatch, lane: usize, step: &mut WaveStep<'_>) -> Result<()> {
        let home = batch.lane(lane)?;
        let step = WaveStep { wave: step.wave, kv: step.kv, cache: step.cache, job: &mut *step.job };
        self.launch_one(home, step, batch.graphs.off)
    }

    /// One step alone on `home`'s streams, from the job's own graphs (eagerly when the job's
    /// graphs are off, or `eager`), its job's own event marking it done.
    fn launch_one(&self, home: &Lane, step: WaveStep<'_>, eager: bool) -> Result<()> {
        let mut steps = [step];
        self.check_steps(&steps)?;
        let mut graphs = std::mem::take(&mut steps[0].job.graphs);
        let own = graphs.off;
        graphs.off |= eager;
        let done = self.launch_steps(&mut graphs, home, &[], &mut steps, None);
        graphs.off = own;
        steps[0].job.graphs = graphs;
        done
    }

    /// Streams for batches of up to `requests` wave steps ([`GpuBackend::launch_wave_batch`]).
    pub fn wave_batch(&self, requests: usize) -> Result<WaveBatch> {
        let lanes = (0..requests)
            .map(|_| Ok((self.stream.fork()?, self.stream.fork()?)))
            .collect::<std::result::Result<Vec<_>, cudarc::driver::DriverError>>()
            .map_err(gpu_err("creating streams"))?;
        let done = self
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(gpu_err("creating an event"))?;
        Ok(WaveBatch { lanes, graphs: Graphs::default(), done: Arc::new(done) })
    }

    /// Enqueues one decode step of every request in `steps` (each its own layer, KV, cache
    /// and job), all running at once on the batch's streams: one request alone leaves most
    /// of the GPU idle (its selection and row list are a few CTAs per head), a batch fills
    /// it. Captured into a graph per set of buffers like [`GpuBackend::launch_wave`]; the
    /// backend's stream waits for every request, so [`GpuBackend::fetch_wave`] of any job
    /// returns its output.
    pub fn launch_wave_batch(&self, batch: &mut WaveBatch, steps: &mut [WaveStep<'_>]) -> Result<()> {
        if steps.is_empty() || steps.len() > batch.lanes.len() {
            return Err(Error::InvalidArgument {
                what: "wave batch",
                message: format!("1..={} requests (the batch's streams), got {}", batch.lanes.len(), steps.len()),
            });
        }
        self.check_steps(steps)?;
        let home = (Arc::clone(&self.stream), Arc::clone(&self.side));
        self.launch_steps(&mut batch.graphs, &home, &batch.lanes, steps, Some(&batch.done))
    }

    /// Replays the graph of these steps' buffers (capturing it first when new), or launches
    /// them eagerly when graphs are off, from `home` (a main and a side stream: the backend's
    /// or a batch lane's). `lanes` empty: one step on `home`; else each step on a lane of its
    /// own, forked from and joined back to `home`. `done`: the batch's event, recorded once
    /// for every step (else each job's own).
    fn launch_steps(
        &self,
        graphs: &mut Graphs,
        home: &Lane,
        lanes: &[Lane],
        steps: &mut [WaveStep<'_>],
        done: Option<&Arc<CudaEvent>>,
    ) -> Result<()> {
        let main = &home.0;
        for s in steps.iter_mut() {
            s.job.io.write_descriptor();
        }
        if !graphs.off {
            // A graph launches on the stream it was captured from: the key names it.
            let from = std::iter::once(main.cu_stream() as u64);
            let key: Vec<u64> = from.chain(steps.iter().flat_map(|s| self.step_key(s))).collect();
            if let Some(i) = graphs.cached.iter().position(|(k, _)| *k == key) {
                let entry = graphs.cached.remove(i);
                entry.1.launch().map_err(gpu_err("launching a wave graph"))?;
                graphs.cached.push(entry);
                return self.record_done(main, steps, done);
            }
            main.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(gpu_err("capturing a wave step"))?;
            let enqueued = self.enqueue_steps(home, lanes, steps);
            let graph = main.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
            enqueued?;
            let graph = graph
                .map_err(gpu_err("capturing a wave step"))?
                .ok_or(Error::Gpu { what: "capturing a wave step", message: "the capture was empty".into() })?;
            graph.launch().map_err(gpu_err("launching a wave graph"))?;
            if graphs.cached.len() == GRAPHS_KEPT {
                graphs.cached.remove(0);
            }
            graphs.cached.push((key, graph));
            return self.record_done(main, steps, done);
        }
        self.enqueue_steps(home, lanes, steps)?;
        self.record_done(main, steps, done)
    }

    /// Marks each step's job done once `main` (which waits for every lane) reaches this
    /// point: with one record of `shared` (a batch's event) for all of them, or one of its
    /// own event per job.
    fn record_done(
        &self,
        main: &CudaStream,
        steps: &mut [WaveStep<'_>],
        shared: Option<&Arc<CudaEvent>>,
    ) -> Result<()> {
        let record = |e: &Arc<CudaEvent>| e.record(main).map_err(gpu_err("recording an event"));
        if let Some(e) = shared {
            record(e)?;
        }
        for s in steps {
            let e = match shared {
                Some(e) => Arc::clone(e),
                None => {
                    record(&s.job.io.done)?;
                    Arc::clone(&s.job.io.done)
                }
            };
            s.job.io.pending = Some(e);
        }
        Ok(())
    }

    /// The launches of `steps`: on `home`'s two streams (no lanes), or each step on its lane,
    /// forked from and joined back into `home`'s main stream.
    fn enqueue_steps(&self, home: &Lane, lanes: &[Lane], steps: &mut [WaveStep<'_>]) -> Result<()> {
        let nothing = &mut |_: &'static str, _: &CudaStream| Ok(());
        if lanes.is_empty() {
            let s = &mut steps[0];
            return self.wave_step(&home.0, &home.1, s.wave, s.kv, s.cache, s.job, nothing);
        }
        for (s, (main, side)) in steps.iter_mut().zip(lanes) {
            main.join(&home.0).map_err(gpu_err("ordering the streams"))?;
            self.wave_step(main, side, s.wave, s.kv, s.cache, s.job, nothing)?;
        }
        for (main, _) in &lanes[..steps.len()] {
            home.0.join(main).map_err(gpu_err("ordering the streams"))?;
        }
        Ok(())
    }

    /// Everything a step's launches depend on besides the job's own buffers (fixed from
    /// `prepare_wave` on): equal keys mean identical launches, so a graph captured under one
    /// key replays exactly what launching eagerly would enqueue.
    fn step_key(&self, s: &WaveStep<'_>) -> Vec<u64> {
        let (w, j) = (s.wave, &*s.job);
        let c = self.cache_args(s.cache);
        let size = |x: usize| x as u64;
        let at = |x: &CudaSlice<u16>| device_address(x, &self.stream);
        let (map, steady_k, steady_v, steady_len) = match &w.arena {
            Some(a) => (
                device_address(&a.row_map, &self.stream),
                at(&a.keys),
                at(&a.values),
                device_address(&a.len, &self.stream),
            ),
            None => (0, 0, 0, 0),
        };
        [
            device_address(&j.mark, &self.stream),
            at(&w.cent.data),
            at(&w.value_means),
            device_address(&w.log_size, &self.stream),
            device_address(&w.offsets, &self.stream),
            size(w.clusters),
            size(w.indexed),
            size(w.rows),
            s.kv.keys,
            s.kv.values,
            size(s.kv.rows),
            c.keys,
            c.values,
            c.rows as u64,
            c.table,
            c.block_rows as u64,
            c.blocks_per_head as u64,
            c.slot_rows as u64,
            map,
            steady_k,
            steady_v,
            steady_len,
            size(j.select.r),
            size(j.decode.chunks),
            size(j.est_chunks),
            u64::from(s.wave.arena.is_some()),
            j.io.q.addr as u64,
            j.io.out.addr as u64,
            j.io.sel.addr as u64,
            j.io.desc.addr as u64,
            j.io.status.addr as u64,
            device_address(&j.io.desc_dev, &self.stream),
            s.wave.arena.as_ref().map_or(0, |a| a.stage.dev),
            s.wave.arena.as_ref().map_or(0, |a| a.marks.dev),
        ]
        .into_iter()
        .chain(w.groups.as_ref().map(|g| g.key(&self.stream)).into_iter().flatten())
        .collect()
    }

    /// A step's cache as the kernels take it.
    pub(super) fn cache_args(&self, cache: Option<WaveCache<'_>>) -> CacheArgs {
        match cache {
            Some(WaveCache::Layer(c, t)) => CacheArgs {
                keys: device_address(&c.keys, &self.stream),
                values: device_address(&c.values, &self.stream),
                rows: c.slots as i32,
                table: device_address(&t.dev, &self.stream),
                block_rows: t.block_rows as i32,
                blocks_per_head: t.blocks_per_head as i32,
                slot_rows: 1,
            },
            Some(WaveCache::Arena(a)) => CacheArgs {
                keys: a.rows.keys,
                values: a.rows.values,
                rows: a.rows.rows as i32,
                table: a.table,
                block_rows: a.block_rows as i32,
                blocks_per_head: 0,
                slot_rows: a.block_rows as i32,
            },
            None => {
                CacheArgs { keys: 0, values: 0, rows: 0, table: 0, block_rows: 1, blocks_per_head: 0, slot_rows: 1 }
            }
        }
    }
}
