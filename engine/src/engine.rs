//! The engine: a catalog of contexts, ingest (prefill/append) with validation and memory
//! budgets, and the entry points of the query-plan API (`plan`, `execute`).

use crate::budget::Budget;
use crate::buffers::{BufferSettings, Buffers};
use crate::context::{Context, ContextId, Layer};
use crate::error::{check_finite, Error, Result};
use crate::plan::{Plan, Request};
use crate::spec::{ContextSpec, LayerKind};
use attnstore_buffer::{BlockLayout, MemoryBudget, Tier};
use attnstore_index::{BuildReport, IndexStats};
use parking_lot::RwLock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Settings of an engine.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Host memory the engine may fill with KV (bytes); beyond it ingest fails with a typed
    /// out-of-memory error.
    pub host_memory_bytes: usize,
    /// Host read bandwidth assumed by the cost model of EXPLAIN (GB/s).
    pub host_read_gbps: f64,
    /// Block size: of the buffer manager's blocks, and used to count blocks in plans.
    pub block: BlockLayout,
    /// A buffer manager homing the indexed rows of wave contexts (`None`: rows stay in the
    /// indexes, as before). See [`BufferSettings`].
    pub buffers: Option<BufferSettings>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self { host_memory_bytes: usize::MAX, host_read_gbps: 10.0, block: BlockLayout::default(), buffers: None }
    }
}

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
    host: Arc<MemoryBudget>,
    contexts: RwLock<HashMap<ContextId, Arc<Context>>>,
    next_id: AtomicU64,
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
            host: MemoryBudget::new(Tier::Host, config.host_memory_bytes),
            buffers,
            #[cfg(feature = "cuda")]
            gpu: crate::gpu::GpuExec::default(),
            config,
            contexts: RwLock::new(HashMap::new()),
            next_id: AtomicU64::new(1),
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
        self.host.used_bytes()
    }

    /// Creates an empty context.
    pub fn create_context(&self, spec: ContextSpec) -> Result<ContextId> {
        spec.validate()?;
        // Relaxed: ids only need to be unique, which fetch_add guarantees at any ordering.
        let id = ContextId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let ctx = Arc::new(Context::new(spec, id, self.buffer_manager())?);
        if let Some(durable) = &self.durable {
            durable.log_create(id, &ctx.spec)?;
        }
        self.contexts.write().insert(id, ctx);
        Ok(id)
    }

    /// Inserts a recovered context under its stored id; later ids are above it.
    pub(crate) fn insert_context(&self, id: ContextId, spec: ContextSpec) -> Result<()> {
        spec.validate()?;
        let ctx = Arc::new(Context::new(spec, id, self.buffer_manager())?);
        // Relaxed: recovery runs on one thread before the engine is shared.
        self.next_id.fetch_max(id.0 + 1, Ordering::Relaxed);
        self.contexts.write().insert(id, ctx);
        Ok(())
    }

    /// The id the next created context gets.
    pub(crate) fn next_context_id(&self) -> u64 {
        self.next_id.load(Ordering::Relaxed)
    }

    /// Raises the id the next created context gets (ids of dropped contexts are not reused).
    pub(crate) fn reserve_context_ids(&self, next: u64) {
        self.next_id.fetch_max(next, Ordering::Relaxed);
    }

    /// Drops a context and releases its memory (a durable engine logs it and deletes its files).
    pub fn drop_context(&self, id: ContextId) -> Result<()> {
        if let Some(durable) = &self.durable {
            self.context(id)?;
            durable.log_drop(id)?;
        }
        self.contexts.write().remove(&id).ok_or(Error::UnknownContext(id))?;
        #[cfg(feature = "cuda")]
        self.gpu.forget(id);
        Ok(())
    }

    /// Ids of all contexts, ascending.
    pub fn contexts(&self) -> Vec<ContextId> {
        let mut ids: Vec<_> = self.contexts.read().keys().copied().collect();
        ids.sort_unstable();
        ids
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
        self.ingest(id, layer, keys, values, true)
    }

    /// Appends decode tokens to one layer (same layout as [`Engine::prefill`]). On a durable
    /// engine it returns once the batch is committed (its log record fsynced under the sync
    /// policy, shared with concurrent appends by group commit).
    pub fn append(&self, id: ContextId, layer: usize, keys: &[f32], values: &[f32]) -> Result<()> {
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
        let lsn = self.ingest_with(id, layer, keys, values, false, false, None)?;
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

    /// Stores a batch, waiting for its commit on a durable engine (prefill, append, recovery).
    pub(crate) fn ingest(
        &self,
        id: ContextId,
        layer: usize,
        keys: &[f32],
        values: &[f32],
        prefill: bool,
    ) -> Result<()> {
        self.ingest_with(id, layer, keys, values, prefill, true, None).map(|_| ())
    }

    /// Stores a batch; on a durable engine returns the LSN of its log record, committed when
    /// `wait`, queued otherwise. A prefill with a `layout` (its clustering computed elsewhere,
    /// e.g. on the GPU) restores the index from it instead of clustering; the log records the
    /// KV as a plain prefill either way.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ingest_with(
        &self,
        id: ContextId,
        layer: usize,
        keys: &[f32],
        values: &[f32],
        prefill: bool,
        wait: bool,
        layout: Option<&attnstore_index::IndexLayout>,
    ) -> Result<Option<attnstore_wal::Lsn>> {
        let ctx = self.context(id)?;
        let shape = ctx.spec.shape;
        let row = shape.kv_heads * shape.head_dim;
        if !keys.len().is_multiple_of(row) {
            return Err(Error::ShapeMismatch {
                what: "keys (kv_heads × tokens × head_dim): a multiple of kv_heads × head_dim",
                expected: row,
                got: keys.len(),
            });
        }
        if values.len() != keys.len() {
            return Err(Error::ShapeMismatch {
                what: "values (same shape as keys)",
                expected: keys.len(),
                got: values.len(),
            });
        }
        check_finite("keys", keys)?;
        check_finite("values", values)?;
        let tokens = keys.len() / row;
        let mut guard = layer_of(&ctx, id, layer)?.write();
        if prefill && guard.prefilled {
            return Err(Error::AlreadyPrefilled { context: id, layer, tokens: guard.method.stats().tokens });
        }
        let before = guard.method.stats().tokens;
        let kept_after = match guard.kind {
            LayerKind::Global => before + tokens,
            LayerKind::SlidingWindow(w) => (before + tokens).min(w),
        };
        let added_bytes = kept_after.saturating_sub(before) * 2 * row * ctx.spec.dtype.size_bytes();
        let batch = self.host.reserve(added_bytes)?;
        let mut lsn = None;
        if let Some(durable) = &self.durable {
            // Data file, then the WAL record (group commit, or queued when not waiting);
            // only then is it visible here.
            lsn = Some(durable.log_ingest(id, layer, prefill, &ctx.spec, (tokens, keys, values), wait)?);
        }
        let layer_state: &mut Layer = &mut guard;
        if prefill {
            let restored = match layout {
                Some(layout) => match layer_state.method.snapshots_mut() {
                    Some(s) => s.restore(layout, keys, values)?,
                    None => false,
                },
                None => false,
            };
            if !restored {
                layer_state.method.prefill(keys, values)?;
            }
        } else {
            layer_state.method.append(keys, values)?;
        }
        match &mut layer_state.reservation {
            Some(r) => r.absorb(batch),
            None => layer_state.reservation = Some(batch),
        }
        layer_state.prefilled = true;
        layer_state.version += 1;
        Ok(lsn)
    }

    /// Restores an empty layer from a checkpointed index layout and the KV it covers
    /// (recovery): no clustering. A layout that does not fit is a typed error and leaves the
    /// layer empty; a method without layouts ingests the KV as a prefill instead.
    pub(crate) fn restore_layer(
        &self,
        id: ContextId,
        layer: usize,
        layout: &attnstore_index::IndexLayout,
        keys: &[f32],
        values: &[f32],
    ) -> Result<()> {
        let shape = self.context(id)?.spec.shape;
        let row = shape.kv_heads * shape.head_dim;
        self.restore_with(id, layer, keys.len() / row.max(1), |method| {
            if !method.snapshots_mut().map_or(Ok(false), |s| s.restore(layout, keys, values))? {
                method.prefill(keys, values)?;
            }
            Ok(())
        })
    }

    /// Restores an empty `hack2` wave layer from its checkpointed encoded home (recovery):
    /// the 2-bit segments, cluster means and plain rows as they were, nothing recomputed.
    /// A home that does not fit is a typed error and leaves the layer empty.
    pub(crate) fn restore_encoded_layer(
        &self,
        id: ContextId,
        layer: usize,
        home: attnstore_index::EncodedHome,
    ) -> Result<()> {
        self.restore_with(id, layer, home.tokens as usize, |method| {
            if method.snapshots_mut().map_or(Ok(false), |s| s.restore_encoded(home))? {
                return Ok(());
            }
            Err(Error::InvalidSpec(format!("layer {layer} of context {id} keeps no 2-bit segments to restore")))
        })
    }

    /// Runs `restore` on an empty layer's method and accounts for its `tokens` like a
    /// prefill of them.
    fn restore_with(
        &self,
        id: ContextId,
        layer: usize,
        tokens: usize,
        restore: impl FnOnce(&mut dyn attnstore_index::AccessMethod) -> Result<()>,
    ) -> Result<()> {
        let ctx = self.context(id)?;
        let row = ctx.spec.shape.kv_heads * ctx.spec.shape.head_dim;
        let mut guard = layer_of(&ctx, id, layer)?.write();
        if guard.prefilled {
            return Err(Error::AlreadyPrefilled { context: id, layer, tokens: guard.method.stats().tokens });
        }
        let batch = self.host.reserve(tokens * 2 * row * ctx.spec.dtype.size_bytes())?;
        restore(&mut *guard.method)?;
        guard.reservation = Some(batch);
        guard.prefilled = true;
        guard.version += 1;
        Ok(())
    }

    /// Plans attention for a batch of requests under one budget. Plans are data: inspect
    /// them with [`Plan::explain`], run them with [`Engine::execute`].
    pub fn plan(&self, requests: &[Request], budget: &Budget) -> Result<Plan> {
        self.plan_on(requests, budget, false)
    }

    /// Like [`Engine::plan`], but sparse wave plans whose rows the GPU can read in place
    /// (f16 rows homed in the buffer manager, one selection per KV head) leave the choice
    /// of clusters to the GPU ([`crate::DeviceSelection`]): planning reads no meta data, and
    /// [`Engine::execute_gpu`] runs the whole step on the device. Other requests are planned
    /// as by [`Engine::plan`]. [`Engine::execute`] runs such a plan on the CPU too.
    pub fn plan_gpu(&self, requests: &[Request], budget: &Budget) -> Result<Plan> {
        self.plan_on(requests, budget, true)
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
        crate::exec::run(plan, &layers)
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
        self.contexts.read().get(&id).cloned().ok_or(Error::UnknownContext(id))
    }
}

/// Refuses a plan made before the layer last changed.
pub(crate) fn check_fresh(r: &crate::plan::RequestPlan, layer: &Layer) -> Result<()> {
    if layer.version == r.version {
        return Ok(());
    }
    Err(Error::StalePlan { context: r.context, layer: r.layer, planned: r.tokens, now: layer.method.stats().tokens })
}

/// Layer `layer` of context `ctx` (id `id`), or [`Error::UnknownLayer`].
pub(crate) fn layer_of(ctx: &Context, id: ContextId, layer: usize) -> Result<&RwLock<Layer>> {
    ctx.layers.get(layer).ok_or(Error::UnknownLayer { context: id, layer, layers: ctx.layers.len() })
}
