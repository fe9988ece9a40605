//! The engine façade: the public API over the catalog (`catalog.rs`), durability
//! (`durable/`), the planner (`plan.rs`) and the executor (`exec/`). It validates, logs
//! what must be durable, and hands the work to them.

use crate::budget::Budget;
use crate::buffers::Buffers;
use crate::catalog::{Batch, ContextCatalog};
use crate::config::EngineConfig;
use crate::context::{Context, ContextId, Layer};
use crate::durable::{CheckpointReport, Durable, DurableConfig, RecoveryReport, StoredBatch};
use crate::error::{Error, Result};
use crate::plan::{Plan, Request};
use crate::spec::ContextSpec;
use attnstore_index::{BuildReport, IndexStats};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

pub(crate) use crate::catalog::layer_of;

/// A batch given to [`Engine::submit_append`]: visible at once, acknowledged as committed
/// once [`Engine::wait_durable`] returns for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a submitted append is acknowledged only by Engine::wait_durable"]
pub struct AppendTicket {
    /// LSN of its log record; `None` on an in-memory engine (nothing to wait for).
    lsn: Option<attnstore_wal::Lsn>,
}

impl AppendTicket {
    /// The log sequence number of the batch's record (`None` on an in-memory engine).
    pub fn lsn(&self) -> Option<u64> {
        self.lsn
    }
}

/// An attnstore engine: owns contexts and plans and executes attention over them.
///
/// ```
/// use attnstore::{Budget, ContextSpec, Engine, EngineConfig, Request};
/// use attnstore_kernels::AttnShape;
///
/// let engine = Engine::in_memory(EngineConfig::default()).unwrap();
/// let shape = AttnShape::new(4, 2, 8).unwrap();
/// let ctx = engine.create_context(ContextSpec::new(shape, 1)).unwrap();
/// let tokens = 100;
/// let keys: Vec<f32> = (0..shape.kv_len(tokens)).map(|i| (i % 7) as f32 * 0.1).collect();
/// engine.prefill(ctx, 0, &keys, &keys).unwrap();
/// let plan = engine.plan(&[Request::new(ctx, 0, vec![0.5; shape.query_len()])], &Budget::full()).unwrap();
/// println!("{}", plan.explain());
/// let out = engine.execute(&plan).unwrap();
/// assert_eq!(out[0].len(), shape.query_len());
/// ```
pub struct Engine {
    config: EngineConfig,
    /// The contexts and their layers.
    catalog: ContextCatalog,
    /// The log, data files and catalog of an engine made by [`Engine::open`]; `None` in memory.
    pub(crate) durable: Option<Arc<crate::durable::Durable>>,
    /// The buffer manager, when [`EngineConfig::buffers`] is set.
    buffers: Option<Buffers>,
    /// GPU backends of [`Engine::execute_gpu`].
    #[cfg(feature = "cuda")]
    pub(crate) gpu: crate::gpu::GpuExec,
}

impl Engine {
    /// An engine that keeps all KV in host memory and nothing on disk.
    pub fn in_memory(config: EngineConfig) -> Result<Self> {
        if !(config.host_read_gbps.is_finite() && config.host_read_gbps > 0.0) {
            return Err(Error::InvalidSpec(format!("host_read_gbps {} must be positive", config.host_read_gbps)));
        }
        let buffers = config.buffers.as_ref().map(|b| Buffers::start(b, config.block)).transpose()?;
        Ok(Self {
            catalog: ContextCatalog::new(config.host_memory_bytes, buffers.as_ref().map(|b| Arc::clone(&b.manager))),
            buffers,
            #[cfg(feature = "cuda")]
            gpu: crate::gpu::GpuExec::default(),
            config,
            durable: None,
        })
    }

    /// The engine's settings.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Tier statistics of the buffer manager (capacity, used, hit ratio, bytes and latency
    /// moved, evictions, dropped access records, failures): what `attnstore inspect` prints.
    /// `None` without [`EngineConfig::buffers`].
    pub fn buffer_stats(&self) -> Option<attnstore_buffer::BufferStats> {
        self.buffers.as_ref().map(|b| b.manager.stats())
    }

    /// Whether the buffer maintainer thread died of a panic (reads still work; nothing is
    /// admitted into the Gpu tier any more). `false` without a maintainer.
    pub fn maintainer_poisoned(&self) -> bool {
        self.buffers.as_ref().and_then(|b| b.maintainer.as_ref()).is_some_and(|m| m.is_poisoned())
    }

    /// The buffer manager, when configured (for tests and tools that inspect or inject faults).
    pub fn buffer_manager(&self) -> Option<&Arc<attnstore_buffer::BufferManager>> {
        self.buffers.as_ref().map(|b| &b.manager)
    }

    /// Bytes of host memory held by stored KV.
    pub fn host_bytes_used(&self) -> usize {
        self.catalog.host_bytes_used()
    }

    /// Creates an empty context.
    pub fn create_context(&self, spec: ContextSpec) -> Result<ContextId> {
        let (id, ctx) = self.catalog.build(spec)?;
        if let Some(durable) = &self.durable {
            durable.log_create(id, &ctx.spec)?;
        }
        self.catalog.insert(id, ctx);
        Ok(id)
    }

    /// Drops a context and releases its memory (a durable engine logs it and deletes its files).
    pub fn drop_context(&self, id: ContextId) -> Result<()> {
        if let Some(durable) = &self.durable {
            self.context(id)?;
            durable.log_drop(id)?;
        }
        self.catalog.remove(id)?;
        #[cfg(feature = "cuda")]
        self.gpu.forget(id);
        Ok(())
    }

    /// Ids of all contexts, ascending.
    pub fn contexts(&self) -> Vec<ContextId> {
        self.catalog.ids()
    }

    /// The spec a context was created with.
    pub fn spec(&self, id: ContextId) -> Result<ContextSpec> {
        Ok(self.context(id)?.spec.clone())
    }

    /// Sizes of one layer's stored KV and index.
    pub fn stats(&self, id: ContextId, layer: usize) -> Result<IndexStats> {
        let ctx = self.context(id)?;
        let guard = layer_of(&ctx, id, layer)?.read();
        Ok(guard.method.stats())
    }

    /// Waits up to `timeout` for a layer's background index build (PQ codebooks) and says
    /// whether the index is ready: `Ok(true)` at once for methods without a background
    /// build, `Ok(false)` if it is still running at the deadline. Plans made before then
    /// attend those tokens exactly (EXPLAIN says so). The layer is not locked while waiting;
    /// once the build is ready, the tokens appended while it ran are encoded (a short write
    /// lock), so the index is the same as if the build had finished before those appends.
    pub fn wait_index(&self, id: ContextId, layer: usize, timeout: Duration) -> Result<bool> {
        let ctx = self.context(id)?;
        let state = layer_of(&ctx, id, layer)?;
        let handle = state.read().method.build_handle();
        let ready = match handle {
            Some(h) => h.wait(timeout)?,
            None => return Ok(true),
        };
        if ready {
            let mut guard = state.write();
            if guard.method.catch_up()? {
                guard.version += 1;
            }
        }
        Ok(ready)
    }

    /// What a layer's background index build did (iteration limit, iterations run, time),
    /// once it has finished; `None` for methods without one or while it runs.
    pub fn index_build(&self, id: ContextId, layer: usize) -> Result<Option<BuildReport>> {
        let ctx = self.context(id)?;
        let handle = layer_of(&ctx, id, layer)?.read().method.build_handle();
        Ok(handle.and_then(|h| h.report()))
    }

    /// Stores the prompt's KV of one layer: `keys`/`values` are `kv_heads × tokens × head_dim`
    /// (post-RoPE keys), f32, converted to the context's storage type. The wave index
    /// clusters it before returning; the PQ index trains its codebooks in the background
    /// (see [`Engine::wait_index`]). A layer is prefilled once; later tokens are appended.
    pub fn prefill(&self, id: ContextId, layer: usize, keys: &[f32], values: &[f32]) -> Result<()> {
        let _span = tracing::debug_span!("prefill", context = id.0, layer, values = keys.len()).entered();
        self.ingest(id, layer, keys, values, true)
    }

    /// Appends decode tokens to one layer (same layout as [`Engine::prefill`]). On a durable
    /// engine it returns once the batch is committed (its log record fsynced under the sync
    /// policy, shared with concurrent appends by group commit).
    pub fn append(&self, id: ContextId, layer: usize, keys: &[f32], values: &[f32]) -> Result<()> {
        let _span = tracing::trace_span!("append", context = id.0, layer, values = keys.len()).entered();
        self.ingest(id, layer, keys, values, false)
    }

    /// Appends decode tokens like [`Engine::append`] without waiting for the commit: the
    /// batch is written to its data file, its log record is queued, and it is visible to
    /// plans at once. It is **acknowledged** only when [`Engine::wait_durable`] returns for
    /// its ticket (or a later one, or [`Engine::sync`]): a crash before that may lose it, and
    /// every batch submitted after it, but never an acknowledged one. Keeping many batches
    /// in flight lets one fsync commit all of them (`attnstore bench-wal`). If the log fails
    /// before the commit, `wait_durable` returns the error and the engine refuses further
    /// durable writes; the batch stays visible in this process only. On an in-memory engine
    /// this is `append`, and the ticket is acknowledged at once.
    pub fn submit_append(&self, id: ContextId, layer: usize, keys: &[f32], values: &[f32]) -> Result<AppendTicket> {
        let lsn = self.ingest_with(id, layer, Batch { keys, values, prefill: false, layout: None }, false)?;
        Ok(AppendTicket { lsn })
    }

    /// Waits until the batch of `ticket`, and every batch submitted or appended before it on
    /// this engine, is committed (data files and log record fsynced, whatever the sync
    /// policy). A ticket of another engine, newer than anything logged here, is an error.
    pub fn wait_durable(&self, ticket: AppendTicket) -> Result<()> {
        match (&self.durable, ticket.lsn) {
            (Some(durable), Some(lsn)) => durable.wait_durable(lsn),
            _ => Ok(()),
        }
    }

    /// Stores a batch, waiting for its commit on a durable engine (prefill, append).
    fn ingest(&self, id: ContextId, layer: usize, keys: &[f32], values: &[f32], prefill: bool) -> Result<()> {
        self.ingest_with(id, layer, Batch { keys, values, prefill, layout: None }, true).map(|_| ())
    }

    /// Stores a batch in the catalog; on a durable engine its data file and log record are
    /// written first, under the layer's lock (group commit, or queued when not `wait`), and
    /// the LSN of the record is returned. A prefill with a layout (its clustering computed
    /// elsewhere, e.g. on the GPU) restores the index from it; the log records the KV as a
    /// plain prefill either way.
    pub(crate) fn ingest_with(
        &self,
        id: ContextId,
        layer: usize,
        batch: Batch<'_>,
        wait: bool,
    ) -> Result<Option<attnstore_wal::Lsn>> {
        self.catalog.ingest(id, layer, batch, |spec, tokens| {
            let Some(durable) = &self.durable else { return Ok(None) };
            let kv = (tokens, batch.keys, batch.values);
            Ok(Some(durable.log_ingest(id, layer, batch.prefill, spec, kv, wait)?))
        })
    }

    /// Plans attention for a batch of requests under one budget. Plans are data: inspect
    /// them with [`Plan::explain`], run them with [`Engine::execute`].
    pub fn plan(&self, requests: &[Request], budget: &Budget) -> Result<Plan> {
        let _span = tracing::debug_span!("plan", requests = requests.len()).entered();
        let start = std::time::Instant::now();
        let plan = self.plan_on(requests, budget, false)?;
        crate::metrics::planned(&plan, start.elapsed());
        Ok(plan)
    }

    /// Like [`Engine::plan`], but sparse wave plans whose rows the GPU can read in place
    /// (f16 rows, or `hack2` rows with per-token keys and a head dimension that is a
    /// multiple of 64, homed in the buffer manager; one selection per KV head) leave the choice
    /// of clusters to the GPU ([`crate::DeviceSelection`]): planning reads no meta data, and
    /// [`Engine::execute_gpu`] runs the whole step on the device. Other requests are planned
    /// as by [`Engine::plan`]. [`Engine::execute`] runs such a plan on the CPU too.
    pub fn plan_gpu(&self, requests: &[Request], budget: &Budget) -> Result<Plan> {
        let start = std::time::Instant::now();
        let plan = self.plan_on(requests, budget, true)?;
        crate::metrics::planned(&plan, start.elapsed());
        Ok(plan)
    }

    fn plan_on(&self, requests: &[Request], budget: &Budget, on_device: bool) -> Result<Plan> {
        budget.validate()?;
        let plans = requests
            .iter()
            .map(|r| {
                let ctx = self.context(r.context)?;
                let guard = layer_of(&ctx, r.context, r.layer)?.read_recursive();
                crate::plan::plan_request(&ctx.spec, &guard, r, budget, &self.config, on_device)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Plan { budget: *budget, requests: plans, host_read_gbps: self.config.host_read_gbps })
    }

    /// Runs a plan: one `q_heads × head_dim` output per request, in request order. Fails
    /// with [`Error::StalePlan`] if a layer changed since it was planned.
    pub fn execute(&self, plan: &Plan) -> Result<Vec<Vec<f32>>> {
        let _span = tracing::debug_span!("execute", requests = plan.requests.len()).entered();
        let start = std::time::Instant::now();
        let out = self.execute_unrecorded(plan)?;
        crate::metrics::executed(plan, start.elapsed(), false);
        Ok(out)
    }

    /// [`Engine::execute`] without its metrics (the GPU executor's CPU fallback: the
    /// `execute_gpu` call records the request).
    pub(crate) fn execute_unrecorded(&self, plan: &Plan) -> Result<Vec<Vec<f32>>> {
        self.with_layers(plan, |layers| crate::exec::run(plan, layers))
    }

    /// EXPLAIN ANALYZE: executes `plan` like [`Engine::execute`] (same outputs) while
    /// counting, per request and zone, the rows attended, the bytes read from the access
    /// method's memory and the blocks (and bytes) pinned from each tier, and the time of the
    /// zone's tasks. [`crate::Analysis::explain`] prints them against the plan.
    pub fn execute_analyze(&self, plan: &Plan) -> Result<(Vec<Vec<f32>>, crate::Analysis)> {
        let _span = tracing::debug_span!("execute_analyze", requests = plan.requests.len()).entered();
        let meters: Vec<crate::exec::Meter> = plan.requests.iter().map(|_| Default::default()).collect();
        let start = std::time::Instant::now();
        let out = self.with_layers(plan, |layers| crate::exec::run_metered(plan, layers, Some(&meters)))?;
        let wall = start.elapsed();
        let requests = meters.iter().map(crate::exec::Meter::actual).collect();
        Ok((out, crate::Analysis { requests, wall, device_time: None }))
    }

    /// Runs `f` over the read-locked layers of `plan`'s requests (one per request, in order),
    /// each checked to be the version the plan was made on.
    fn with_layers<T>(&self, plan: &Plan, f: impl FnOnce(&[&Layer]) -> Result<T>) -> Result<T> {
        let ctxs = plan.requests.iter().map(|r| self.context(r.context)).collect::<Result<Vec<_>>>()?;
        let guards = plan
            .requests
            .iter()
            .zip(&ctxs)
            .map(|(r, ctx)| {
                let g = layer_of(ctx, r.context, r.layer)?.read_recursive();
                check_fresh(r, &g)?;
                Ok(g)
            })
            .collect::<Result<Vec<_>>>()?;
        let layers: Vec<&Layer> = guards.iter().map(|g| &**g).collect();
        f(&layers)
    }

    /// Token positions that query head `q_head` of request `request` attends exactly under
    /// `plan` (steady plus retrieved; for recall measurements).
    pub fn exact_positions(&self, plan: &Plan, request: usize, q_head: usize) -> Result<Vec<u32>> {
        let r = plan.requests.get(request).ok_or(Error::OutOfRange {
            what: "request",
            got: request,
            limit: plan.requests.len(),
        })?;
        if q_head >= r.shape.q_heads {
            return Err(Error::OutOfRange { what: "query head", got: q_head, limit: r.shape.q_heads });
        }
        let ctx = self.context(r.context)?;
        let guard = layer_of(&ctx, r.context, r.layer)?.read_recursive();
        check_fresh(r, &guard)?;
        let g = r.shape.group();
        let (heads, _) = crate::exec::cpu_heads(r, &guard);
        Ok(guard.method.exact_positions(q_head / g, &heads[q_head / g], q_head % g))
    }

    pub(crate) fn context(&self, id: ContextId) -> Result<Arc<Context>> {
        self.catalog.get(id)
    }
}

/// Durability: opening, checkpoints, sync and what recovery did (`durable/`).
impl Engine {
    /// Opens (or creates) a durable engine in `dir` with the default [`DurableConfig`]
    /// (fsync every group commit): loads the manifest, replays the log after it, verifies
    /// every chunk it loads, and rebuilds each layer's index from the recovered KV.
    ///
    /// ```
    /// use attnstore::{AttnShape, ContextSpec, Engine, EngineConfig};
    ///
    /// let dir = tempfile::tempdir().unwrap();
    /// let shape = AttnShape::new(4, 2, 8).unwrap();
    /// let keys = vec![0.25; shape.kv_len(10)];
    /// let ctx = {
    ///     let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    ///     let ctx = engine.create_context(ContextSpec::new(shape, 1)).unwrap();
    ///     engine.prefill(ctx, 0, &keys, &keys).unwrap(); // durable once it returns
    ///     ctx
    /// };
    /// let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    /// assert_eq!(engine.stats(ctx, 0).unwrap().tokens, 10);
    /// ```
    pub fn open(dir: impl AsRef<Path>, config: EngineConfig) -> Result<Engine> {
        Self::open_with(dir, config, DurableConfig::default())
    }

    /// [`Engine::open`] with a chosen sync policy and storage. Recovery replays into the
    /// new engine's catalog; the engine gets its durability once everything is loaded.
    pub fn open_with(dir: impl AsRef<Path>, config: EngineConfig, durable: DurableConfig) -> Result<Engine> {
        let _span = tracing::info_span!("open", dir = %dir.as_ref().display()).entered();
        let mut engine = Engine::in_memory(config)?;
        let attached = crate::durable::open(dir.as_ref(), &engine.catalog, engine.buffer_manager(), durable)?;
        tracing::info!(report = %attached.report(), "recovered");
        engine.durable = Some(attached);
        Ok(engine)
    }

    /// Whether this engine writes to disk (made by [`Engine::open`]).
    pub fn is_durable(&self) -> bool {
        self.durable.is_some()
    }

    fn durable(&self, what: &'static str) -> Result<&Durable> {
        self.durable.as_deref().ok_or(Error::NotDurable(what))
    }

    /// Writes a manifest of the whole catalog atomically and deletes the log files it
    /// covers; appends wait while it runs. Index layouts that changed are written first;
    /// `hack2` wave layers instead get their 2-bit home (new segment files and the home),
    /// `hack2` PQ layers get both (their home needs their codebooks), and once the
    /// manifest records a home the f16 chunks it holds are punched out of the data file
    /// (`durable/home.rs`).
    pub fn checkpoint(&self) -> Result<CheckpointReport> {
        let _span = tracing::info_span!("checkpoint").entered();
        let report = self.durable("checkpoint")?.checkpoint_catalog(&self.catalog)?;
        tracing::info!(?report, "checkpoint written");
        Ok(report)
    }

    /// Makes everything acknowledged so far durable, whatever the sync policy.
    pub fn sync(&self) -> Result<()> {
        self.durable("sync")?.sync()
    }

    /// What opening this engine recovered; `None` for an in-memory engine.
    pub fn recovery_report(&self) -> Option<&RecoveryReport> {
        self.durable.as_deref().map(Durable::report)
    }

    /// Waits up to `timeout` for the background index rebuild after recovery
    /// ([`IndexRebuild::Background`](crate::IndexRebuild::Background)): `Ok(true)` once
    /// every recovered layer has its index (at once for in-memory engines and blocking
    /// rebuilds), `Ok(false)` at the deadline, or the error that stopped the rebuild (those
    /// layers stay served exactly).
    pub fn wait_index_rebuild(&self, timeout: Duration) -> Result<bool> {
        self.durable.as_deref().map_or(Ok(true), |d| d.wait_rebuild(timeout))
    }

    /// How long the background index rebuild took, once it has finished.
    pub fn index_rebuild_time(&self) -> Option<Duration> {
        self.durable.as_deref().and_then(Durable::rebuild_time)
    }

    /// Counters of the write-ahead log (records, group writes, fsyncs).
    pub fn wal_stats(&self) -> Result<attnstore_wal::WriterStats> {
        Ok(self.durable("wal_stats")?.wal_stats())
    }

    /// The committed batches of one layer as stored in its data file (checksums verified),
    /// in commit order, widened to f32. For a `hack2` wave layer whose tokens a checkpoint
    /// moved to its 2-bit home, only the batches still in the data file (those after the
    /// punched range).
    pub fn stored_batches(&self, id: ContextId, layer: usize) -> Result<Vec<StoredBatch>> {
        let spec = self.spec(id)?;
        if layer >= spec.layers.len() {
            return Err(Error::UnknownLayer { context: id, layer, layers: spec.layers.len() });
        }
        self.durable("stored_batches")?.stored_batches(id, layer, &spec)
    }
}

/// Refuses a plan made before the layer last changed.
pub(crate) fn check_fresh(r: &crate::plan::RequestPlan, layer: &Layer) -> Result<()> {
    if layer.version == r.version {
        return Ok(());
    }
    Err(Error::StalePlan { context: r.context, layer: r.layer, planned: r.tokens, now: layer.method.stats().tokens })
}

#[cfg(test)]
mod layout_tests {
    use crate::*;

    /// A prefill with a layout computed elsewhere (`Engine::prefill_gpu`'s path) restores
    /// exactly that layout, and a `hack2` layer restored from any valid layout — here the
    /// CPU's with every segment's rows shuffled and cut into clusters of random sizes —
    /// answers alike with its 2-bit rows homed in the buffer manager or kept in memory.
    #[test]
    fn a_hack2_layer_restored_from_any_layout_answers_alike_homed_or_not() {
        let shape = AttnShape::new(8, 2, 64).unwrap();
        let tokens = 16_952; // two prefill segments and pending tokens
        let n = shape.kv_heads * tokens * 64;
        let mut rng = attnstore_kernels::random::SplitMix64::new(5);
        let k: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
        let v: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
        let q: Vec<f32> = (0..8 * 64).map(|_| rng.normal()).collect();
        let mut outs = Vec::new();
        let mut layout = None;
        for buffers in [false, true] {
            let config = EngineConfig {
                buffers: buffers.then(|| BufferSettings { maintainer_idle: None, ..BufferSettings::new(20_000) }),
                ..EngineConfig::default()
            };
            let engine = Engine::in_memory(config).unwrap();
            let spec = ContextSpec::new(shape, 1).with_codec(Codec::Hack2(HackParams::default()));
            let (a, b) = (engine.create_context(spec.clone()).unwrap(), engine.create_context(spec).unwrap());
            engine.prefill(a, 0, &k, &v).unwrap();
            let layout_of = |c| {
                let ctx = engine.context(c).unwrap();
                let g = crate::engine::layer_of(&ctx, c, 0).unwrap().read();
                g.method.snapshots().unwrap().layout()
            };
            if layout.is_none() {
                let Some(attnstore_index::IndexLayout::Wave(mut w)) = layout_of(a) else { panic!("a wave layout") };
                for h in w.segments.iter_mut().flat_map(|s| s.heads.iter_mut()) {
                    let total: u32 = h.sizes.iter().sum();
                    for i in (1..h.positions.len()).rev() {
                        h.positions.swap(i, rng.below(i + 1));
                    }
                    h.sizes.clear();
                    let mut left = total;
                    while left > 0 {
                        let size = (1 + rng.below(40) as u32).min(left);
                        h.sizes.push(size);
                        left -= size;
                    }
                }
                layout = Some(attnstore_index::IndexLayout::Wave(w));
            }
            let batch = crate::catalog::Batch { keys: &k, values: &v, prefill: true, layout: layout.as_ref() };
            engine.ingest_with(b, 0, batch, true).unwrap();
            assert_eq!(layout_of(b), layout, "the layer keeps the layout it was given");
            let run = |c| engine.execute(&engine.plan(&[Request::new(c, 0, q.clone())], &Budget::full()).unwrap());
            outs.push((run(a).unwrap(), run(b).unwrap()));
        }
        assert_eq!(outs[0].0, outs[1].0, "the CPU's layout, in memory and homed");
        assert_eq!(outs[0].1, outs[1].1, "the shuffled layout, in memory and homed");
        assert_ne!(outs[0].0, outs[0].1, "another layout groups other rows into value blocks");
    }
}
