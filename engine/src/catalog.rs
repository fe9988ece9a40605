//! The catalog: the engine's contexts and their layers, at the bottom of the engine crate.
//! It creates contexts, applies batches to a layer's access method under the layer's lock
//! with the host-memory budget, and restores layers from checkpoints. The engine façade
//! ([`crate::Engine`]) validates, logs (durable engines) and calls it; recovery replays into
//! it. It knows nothing of durability, planning or execution.

use crate::context::{Context, ContextId, Layer};
use crate::error::{check_finite, Error, Result};
use crate::spec::{ContextSpec, LayerKind};
use attnstore_buffer::{BufferManager, MemoryBudget, Tier};
use attnstore_index::{AccessMethod, EncodedHome, IndexLayout};
use parking_lot::RwLock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A batch of KV for one layer: `keys`/`values` are `kv_heads × tokens × head_dim`.
#[derive(Clone, Copy)]
pub(crate) struct Batch<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    /// A prefill (the layer's first batch) rather than an append.
    pub prefill: bool,
    /// For a prefill, an index layout computed elsewhere (e.g. on the GPU) to restore
    /// instead of clustering.
    pub layout: Option<&'a IndexLayout>,
}

/// The contexts of an engine.
pub(crate) struct ContextCatalog {
    contexts: RwLock<HashMap<ContextId, Arc<Context>>>,
    next_id: AtomicU64,
    /// Host memory held by stored KV.
    host: Arc<MemoryBudget>,
    /// Where wave and PQ layers home their indexed rows.
    buffers: Option<Arc<BufferManager>>,
}

impl ContextCatalog {
    /// An empty catalog holding at most `host_memory_bytes` of KV.
    pub fn new(host_memory_bytes: usize, buffers: Option<Arc<BufferManager>>) -> Self {
        Self {
            contexts: RwLock::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            host: MemoryBudget::new(Tier::Host, host_memory_bytes),
            buffers,
        }
    }

    /// Bytes of host memory held by stored KV.
    pub fn host_bytes_used(&self) -> usize {
        self.host.used_bytes()
    }

    /// A new context of `spec` under a fresh id, not yet in the catalog ([`Self::insert`]
    /// makes it visible).
    pub fn build(&self, spec: ContextSpec) -> Result<(ContextId, Arc<Context>)> {
        spec.validate()?;
        // Relaxed: ids only need to be unique, which fetch_add guarantees at any ordering.
        let id = ContextId(self.next_id.fetch_add(1, Ordering::Relaxed));
        Ok((id, Arc::new(Context::new(spec, id, self.buffers.as_ref())?)))
    }

    /// Makes a built context visible.
    pub fn insert(&self, id: ContextId, ctx: Arc<Context>) {
        self.contexts.write().insert(id, ctx);
    }

    /// Inserts a recovered context under its stored id; later ids are above it.
    pub fn insert_recovered(&self, id: ContextId, spec: ContextSpec) -> Result<()> {
        spec.validate()?;
        let ctx = Arc::new(Context::new(spec, id, self.buffers.as_ref())?);
        // Relaxed: recovery runs on one thread before the engine is shared.
        self.next_id.fetch_max(id.0 + 1, Ordering::Relaxed);
        self.insert(id, ctx);
        Ok(())
    }

    /// Removes a context (its memory is released when the last plan using it is done).
    pub fn remove(&self, id: ContextId) -> Result<()> {
        self.contexts.write().remove(&id).map(|_| ()).ok_or(Error::UnknownContext(id))
    }

    /// The context `id`, or [`Error::UnknownContext`].
    pub fn get(&self, id: ContextId) -> Result<Arc<Context>> {
        self.contexts.read().get(&id).cloned().ok_or(Error::UnknownContext(id))
    }

    /// Ids of all contexts, ascending.
    pub fn ids(&self) -> Vec<ContextId> {
        let mut ids: Vec<_> = self.contexts.read().keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// The id the next created context gets.
    pub fn next_id(&self) -> u64 {
        self.next_id.load(Ordering::Relaxed)
    }

    /// Raises the id the next created context gets (ids of dropped contexts are not reused).
    pub fn reserve_ids(&self, next: u64) {
        self.next_id.fetch_max(next, Ordering::Relaxed);
    }

    /// Applies `batch` to layer `layer` of context `id` after checking it completely
    /// (shape, finiteness, a second prefill, host memory). `log` runs under the layer's
    /// write lock once the batch is accepted and before it is applied (a durable engine
    /// writes its data file and log record there, so batches of a layer are logged in the
    /// order they become visible); what it returns is returned.
    pub fn ingest<T>(
        &self,
        id: ContextId,
        layer: usize,
        batch: Batch<'_>,
        log: impl FnOnce(&ContextSpec, usize) -> Result<T>,
    ) -> Result<T> {
        let start = std::time::Instant::now();
        let ctx = self.get(id)?;
        let (keys, values) = (batch.keys, batch.values);
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
        if batch.prefill && guard.prefilled {
            return Err(Error::AlreadyPrefilled { context: id, layer, tokens: guard.method.stats().tokens });
        }
        let before = guard.method.stats().tokens;
        let kept_after = match guard.kind {
            LayerKind::Global => before + tokens,
            LayerKind::SlidingWindow(w) => (before + tokens).min(w),
        };
        let added_bytes = kept_after.saturating_sub(before) * 2 * row * ctx.spec.dtype.size_bytes();
        let reserved = self.host.reserve(added_bytes)?;
        let checked = std::time::Instant::now();
        let logged = log(&ctx.spec, tokens)?;
        let indexing = std::time::Instant::now();
        let layer_state: &mut Layer = &mut guard;
        if batch.prefill {
            // A layout is an optimization (the log records a plain prefill either way): one
            // that does not fit this KV or these parameters is reported and the batch is
            // indexed from its rows, never served wrong. A failed restore changes nothing.
            let restored = match (batch.layout, layer_state.method.snapshots_mut()) {
                (Some(layout), Some(s)) => s.restore(layout, keys, values).unwrap_or_else(|e| {
                    tracing::warn!(context = id.0, layer, error = %e, "index layout not used");
                    false
                }),
                _ => false,
            };
            if !restored {
                layer_state.method.prefill(keys, values)?;
            }
        } else {
            layer_state.method.append(keys, values)?;
        }
        match &mut layer_state.reservation {
            Some(r) => r.absorb(reserved),
            None => layer_state.reservation = Some(reserved),
        }
        layer_state.prefilled = true;
        layer_state.version += 1;
        let op = if batch.prefill { "prefill" } else { "append" };
        crate::metrics::ingested(
            op,
            tokens,
            [("checks", checked - start), ("log", indexing - checked), ("index", indexing.elapsed())],
        );
        Ok(logged)
    }

    /// Applies a recovered batch (nothing to log).
    pub fn replay(&self, id: ContextId, layer: usize, keys: &[f32], values: &[f32], prefill: bool) -> Result<()> {
        self.ingest(id, layer, Batch { keys, values, prefill, layout: None }, |_, _| Ok(()))
    }

    /// Restores an empty layer from a checkpointed index layout and the KV it covers
    /// (recovery): no clustering. A layout that does not fit is a typed error and leaves the
    /// layer empty; a method without layouts ingests the KV as a prefill instead.
    pub fn restore_layer(
        &self,
        id: ContextId,
        layer: usize,
        layout: &IndexLayout,
        keys: &[f32],
        values: &[f32],
    ) -> Result<()> {
        let shape = self.get(id)?.spec.shape;
        let row = shape.kv_heads * shape.head_dim;
        self.restore_with(id, layer, keys.len() / row.max(1), |method| {
            if !method.snapshots_mut().map_or(Ok(false), |s| s.restore(layout, keys, values))? {
                method.prefill(keys, values)?;
            }
            Ok(())
        })
    }

    /// Restores an empty `hack2` layer from its checkpointed encoded home (recovery): the
    /// 2-bit segments, cluster means and plain rows as they were, nothing recomputed. A
    /// home that does not fit is a typed error and leaves the layer empty.
    pub fn restore_encoded_layer(&self, id: ContextId, layer: usize, home: EncodedHome) -> Result<()> {
        self.restore_with(id, layer, home.tokens as usize, |method| {
            if method.snapshots_mut().map_or(Ok(false), |s| s.restore_encoded(home))? {
                return Ok(());
            }
            Err(Error::InvalidSpec(format!("layer {layer} of context {id} keeps no encoded segments to restore")))
        })
    }

    /// Runs `restore` on an empty layer's method and accounts for its `tokens` like a
    /// prefill of them.
    fn restore_with(
        &self,
        id: ContextId,
        layer: usize,
        tokens: usize,
        restore: impl FnOnce(&mut dyn AccessMethod) -> Result<()>,
    ) -> Result<()> {
        let ctx = self.get(id)?;
        let row = ctx.spec.shape.kv_heads * ctx.spec.shape.head_dim;
        let mut guard = layer_of(&ctx, id, layer)?.write();
        if guard.prefilled {
            return Err(Error::AlreadyPrefilled { context: id, layer, tokens: guard.method.stats().tokens });
        }
        let reserved = self.host.reserve(tokens * 2 * row * ctx.spec.dtype.size_bytes())?;
        restore(&mut *guard.method)?;
        guard.reservation = Some(reserved);
        guard.prefilled = true;
        guard.version += 1;
        Ok(())
    }
}

/// Layer `layer` of context `ctx` (id `id`), or [`Error::UnknownLayer`].
pub(crate) fn layer_of(ctx: &Context, id: ContextId, layer: usize) -> Result<&RwLock<Layer>> {
    ctx.layers.get(layer).ok_or(Error::UnknownLayer { context: id, layer, layers: ctx.layers.len() })
}
