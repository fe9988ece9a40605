//! Background index rebuild after recovery ([`IndexRebuild::Background`]).
//!
//! Recovery loads a recovered layer into a flat (exact) access method, so the first
//! attention after reopening needs only the KV read back; the planner attends such a layer
//! exactly and EXPLAIN says why. One background thread then builds each layer's real index
//! from its data file and swaps it in under the layer's write lock, first applying any
//! batches appended since recovery, so the swapped index holds exactly the committed KV.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use attnstore_index::AccessMethod;
use parking_lot::{Condvar, Mutex};

use super::datafile::{ChunkReader, StoredBatch};
use super::{data_path, Durable};
use crate::context::{make_method, Context, ContextId};
use crate::error::{Error, Result};

/// How a durable engine rebuilds the indexes of recovered layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IndexRebuild {
    /// `Engine::open` returns once every index is rebuilt: plans are the same as before the crash.
    #[default]
    Blocking,
    /// `Engine::open` returns once the KV is loaded; recovered layers are attended exactly
    /// until a background thread has rebuilt their indexes (`Engine::wait_index_rebuild`).
    /// Holds a second copy of those layers' KV in memory while it runs.
    Background,
}

/// One layer whose index the background thread rebuilds.
pub(crate) struct RebuildJob {
    pub context: Arc<Context>,
    pub id: ContextId,
    pub layer: usize,
    /// Committed end of the layer's data file when recovery loaded it.
    pub loaded_bytes: u64,
    /// Where the rebuilt index homes its segment rows (the engine's buffer manager).
    pub blocks: Option<crate::exec::home::BlockStore>,
}

/// Progress of the background rebuild.
#[derive(Default)]
pub(crate) struct RebuildState {
    pub pending_layers: usize,
    pub error: Option<Error>,
    pub elapsed: Option<Duration>,
}

/// The shared state and its condition variable.
#[derive(Default)]
pub(crate) struct RebuildProgress {
    pub state: Mutex<RebuildState>,
    pub done: Condvar,
}

fn apply(method: &mut dyn AccessMethod, batch: &StoredBatch) -> Result<()> {
    if batch.prefill {
        method.prefill(&batch.keys, &batch.values)?;
    } else {
        method.append(&batch.keys, &batch.values)?;
    }
    Ok(())
}

fn rebuild_layer(durable: &Durable, job: &RebuildJob) -> Result<()> {
    let spec = &job.context.spec;
    let path = data_path(&durable.dir, job.id.0, job.layer);
    let row = spec.shape.kv_heads * spec.shape.head_dim;
    let mut method = make_method(spec, job.layer, job.blocks.as_ref())?;
    let owner = durable.owner(job.id, job.layer);
    let mut reader = ChunkReader::open(&path, owner, job.loaded_bytes, spec.dtype, row)?;
    // A checkpointed layout (wave and PQ layers) restores the tokens it covers without
    // clustering or training; one that is missing or does not fit leaves the plain rebuild.
    let layout = super::layout::read_layout(&durable.dir, job.id.0, job.layer, method.name()).ok().flatten();
    match layout {
        Some(layout) => {
            let mut batches = Vec::new();
            while let Some(batch) = reader.next_chunk()? {
                batches.push(batch);
            }
            let cut = super::layout::split_at(&batches, layout.tokens(), spec.shape.kv_heads).and_then(
                |(keys, values, cut)| {
                    let s = method.snapshots_mut()?;
                    s.restore(&layout, &keys, &values).ok().filter(|&r| r).map(|_| cut)
                },
            );
            // A failed restore changes nothing: then every batch is applied.
            for batch in &batches[cut.unwrap_or(0)..] {
                apply(&mut *method, batch)?;
            }
        }
        _ => {
            while let Some(batch) = reader.next_chunk()? {
                apply(&mut *method, &batch)?;
            }
        }
    }
    // Lock order layer → catalog, as in the append path.
    let mut layer = job.context.layers[job.layer].write();
    let committed = durable.catalog.lock().contexts.get(&job.id.0).map(|c| c.layers[job.layer].committed_bytes);
    let Some(committed) = committed else { return Ok(()) }; // dropped meanwhile
    if committed > job.loaded_bytes {
        let mut reader = ChunkReader::open(&path, owner, committed, spec.dtype, row)?.starting_at(job.loaded_bytes);
        while let Some(batch) = reader.next_chunk()? {
            apply(&mut *method, &batch)?;
        }
    }
    layer.method = method;
    layer.rebuilding = false;
    layer.version += 1;
    Ok(())
}

/// Body of the rebuild thread: every job in order; the first error stops it (the layers
/// left keep being served exactly) and is reported by `Engine::wait_index_rebuild`.
pub(crate) fn run(durable: Weak<Durable>, jobs: Vec<RebuildJob>) {
    let started = Instant::now();
    for job in &jobs {
        // The engine was dropped: stop, and let its directory lock go.
        let Some(durable) = durable.upgrade() else { return };
        // A panic here must not leave waiters hanging: it becomes an error like any other.
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rebuild_layer(&durable, job)))
            .unwrap_or_else(|_| Err(Error::InvalidSpec("index rebuild panicked".into())));
        // A context dropped meanwhile may have lost its files: nothing to rebuild then.
        let dropped = || !durable.catalog.lock().contexts.contains_key(&job.id.0);
        let outcome = outcome.or_else(|error| if dropped() { Ok(()) } else { Err(error) });
        let mut state = durable.rebuild.state.lock();
        match outcome {
            Ok(()) => state.pending_layers -= 1,
            Err(error) => {
                state.error = Some(error);
                break;
            }
        }
    }
    if let Some(durable) = durable.upgrade() {
        durable.rebuild.state.lock().elapsed = Some(started.elapsed());
        durable.rebuild.done.notify_all();
    }
}
