//! Opening a durable engine: prepare and lock the directory, read the committed state
//! (`recovery::read_state`), repair, replay every committed layer into the engine's catalog
//! (from a 2-bit home, a checkpointed layout, or batch by batch; or exactly now with the
//! index rebuilt in the background), then attach the log and the file catalog.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use attnstore_wal::LogWriter;
use parking_lot::{Mutex, RwLock};

use super::home::HomeState;
use super::identity::EngineDir;
use super::rebuild::{self, IndexRebuild, RebuildJob, RebuildProgress};
use super::recovery::{
    data_files, home_lost, io, lock_directory, read_layer, read_state, usable_home, CommittedContext, RecoveryReport,
    Start, State,
};
use super::{data_path, Catalog, CatalogContext, CatalogLayer, Durable, DurableConfig, MANIFEST_FILE, WAL_DIR};
use crate::catalog::ContextCatalog;
use crate::context::{make_method, ContextId};
use crate::error::Result;
use crate::spec::{LayerKind, Method};
use attnstore_buffer::BufferManager;

/// What replaying the committed layers produced besides the catalog's contents.
#[derive(Default)]
struct Replayed {
    report: RecoveryReport,
    /// Layers whose index the background thread rebuilds.
    jobs: Vec<RebuildJob>,
    /// 2-bit homes the recovered indexes hold as they are on disk.
    homes: BTreeMap<(u64, usize), HomeState>,
    /// Index layouts on disk that the recovered indexes hold as they are (a checkpoint
    /// rewrites a layout only when its end moved).
    layout_ends: BTreeMap<(u64, usize), u64>,
}

/// Opens the durable state in `dir` (see `Engine::open`), replaying every committed
/// context into `catalog` (empty; `buffers`: where its wave layers home rows), and returns
/// what the engine attaches to log from then on.
pub(crate) fn open(
    dir: &Path,
    catalog: &ContextCatalog,
    buffers: Option<&Arc<BufferManager>>,
    durable: DurableConfig,
) -> Result<Arc<Durable>> {
    let started = Instant::now();
    let storage = durable.storage.clone();
    let (engine_dir, lock) = prepare(dir, &durable)?;
    let dir = &engine_dir;
    let state = read_state(dir, durable.recovery)?;
    state.replay.repair(&*storage)?;
    let mut out = Replayed { report: first_report(&state), ..Replayed::default() };
    let background = durable.index_rebuild == IndexRebuild::Background;
    let into = Into { catalog, buffers, background };
    for (&context, ctx) in &state.contexts {
        catalog.insert_recovered(ContextId(context), ctx.spec.clone())?;
        for layer in 0..ctx.layers.len() {
            replay_layer(&into, dir, &durable, &state, (context, layer), &mut out)?;
        }
    }
    catalog.reserve_ids(state.next_context_id);
    let Replayed { mut report, jobs, homes, layout_ends } = out;
    for (context, _, path) in data_files(dir)? {
        if !state.contexts.contains_key(&context) {
            std::fs::remove_file(&path).map_err(io("remove", &path))?;
            report.orphan_data_files.push(path);
        }
    }
    let live = state.contexts.iter().flat_map(|(&c, ctx)| (0..ctx.layers.len()).map(move |l| (c, l))).collect();
    report.stale_layout_files = super::layout::remove_stale(dir, &live);
    let wal = LogWriter::resume(&dir.join(WAL_DIR), storage.clone(), durable.wal, dir.id, &state.replay)?;
    let generation = state.manifest_generation.unwrap_or(0);
    let files = file_catalog(generation, state.contexts);
    report.background_rebuild_layers = jobs.len();
    report.total_time = started.elapsed();
    let progress = RebuildProgress::default();
    progress.state.lock().pending_layers = jobs.len();
    let attached = Arc::new(Durable {
        dir: engine_dir.clone(),
        storage,
        wal,
        gate: RwLock::new(()),
        catalog: Mutex::new(files),
        drop_lock: Mutex::new(()),
        _lock: lock,
        report,
        rebuild: progress,
        layouts: Mutex::new(layout_ends),
        homes: Mutex::new(homes),
    });
    if !jobs.is_empty() {
        let for_thread = Arc::downgrade(&attached);
        std::thread::Builder::new()
            .name("attnstore-index-rebuild".into())
            .spawn(move || rebuild::run(for_thread, jobs))
            .map_err(io("spawn index rebuild for", dir))?;
    }
    Ok(attached)
}

/// Where recovery replays to.
struct Into<'a> {
    catalog: &'a ContextCatalog,
    buffers: Option<&'a Arc<BufferManager>>,
    /// Indexed layers are served exactly at once and their indexes rebuilt in the
    /// background ([`IndexRebuild::Background`]).
    background: bool,
}

/// Makes sure `dir` is an engine directory (creating one only when asked) with its
/// sub-folders, and locks it. Nothing is written to a directory that is not an engine
/// directory.
fn prepare(dir: &Path, durable: &DurableConfig) -> Result<(EngineDir, std::fs::File)> {
    let storage = &durable.storage;
    let engine_dir = EngineDir::open(&**storage, dir, durable.create)?;
    for sub in [dir.join(WAL_DIR), dir.join(super::DATA_DIR), dir.join(super::layout::INDEX_DIR)] {
        match std::fs::symlink_metadata(&sub) {
            Ok(meta) if !meta.is_dir() => {
                let found = "not a directory".to_string();
                return Err(attnstore_wal::Error::NotRegularFile { path: sub, found }.into());
            }
            Ok(_) => {}
            Err(_) => std::fs::create_dir(&sub).map_err(io("create dir", &sub))?,
        }
    }
    storage.sync_dir(dir).map_err(io("fsync dir", dir))?;
    let lock = lock_directory(dir)?;
    // A checkpoint that died before its rename leaves the new manifest half-made; the old one stands.
    let _ = std::fs::remove_file(dir.join(format!("{MANIFEST_FILE}.tmp")));
    Ok((engine_dir, lock))
}

/// The report's figures known once the state is read.
fn first_report(state: &State) -> RecoveryReport {
    RecoveryReport {
        manifest_generation: state.manifest_generation,
        wal_start_lsn: state.wal_start_lsn,
        log_files: state.replay.files.clone(),
        replayed: state.replayed,
        skipped_appends: state.skipped_appends,
        torn_tail: state.replay.torn.clone(),
        log_cut: state.replay.cut.clone(),
        contexts: state.contexts.len(),
        next_lsn: state.replay.next_lsn,
        ..RecoveryReport::default()
    }
}

/// Replays one committed layer into the engine's catalog: from its 2-bit home when it has
/// one that fits, else exactly now with the index rebuilt in the background (`background`),
/// else from its checkpointed layout plus the batches after it, else batch by batch. Data
/// bytes past the committed end are cut first.
fn replay_layer(
    into: &Into<'_>,
    dir: &EngineDir,
    durable: &DurableConfig,
    state: &State,
    (context, layer): (u64, usize),
    out: &mut Replayed,
) -> Result<()> {
    let (catalog, background) = (into.catalog, into.background);
    let (id, ctx) = (ContextId(context), &state.contexts[&context]);
    let committed = ctx.layers[layer].committed_bytes;
    let indexed = ctx.spec.layers[layer] == LayerKind::Global && ctx.spec.method != Method::Flat;
    // A hack2 wave layer's 2-bit home is loaded, not rebuilt: never in the background.
    let reading = Instant::now();
    let home = match committed {
        0 => None,
        _ => usable_home(dir, state, (context, layer), &mut out.report.layout_errors)?,
    };
    if home.is_some() {
        out.report.read_time += reading.elapsed();
    }
    if background && indexed && committed > 0 && home.is_none() {
        // Load into an exact (flat) method now; the real index follows in the background.
        let handle = catalog.get(id)?;
        let mut flat = ctx.spec.clone().with_method(Method::Flat);
        flat.layers[layer] = LayerKind::Global;
        let mut guard = handle.layers[layer].write();
        guard.method = make_method(&flat, layer, None)?;
        guard.rebuilding = true;
        drop(guard);
        let blocks = into.buffers.map(|b| crate::exec::home::BlockStore::new(Arc::clone(b), id.0, layer as u32));
        out.jobs.push(RebuildJob { context: handle, id, layer, loaded_bytes: committed, blocks });
    }
    cut_uncommitted(durable, dir, (context, layer), committed, &mut out.report)?;
    if committed == 0 {
        return Ok(());
    }
    if let Some(h) = home {
        let relied_on = state.homes.get(&(context, layer)).copied().unwrap_or(0);
        let started = Instant::now();
        let (start, bytes) = (Start { offset: h.data_bytes, tokens: h.tokens, chunks: h.chunks }, h.bytes);
        let state_on_disk = HomeState { punched: relied_on, ..h.state };
        let layout_end = h.home.pq.as_ref().map(|s| s.end);
        match catalog.restore_encoded_layer(id, layer, h.home) {
            Ok(()) => {
                out.layout_ends.extend(layout_end.map(|end| ((context, layer), end)));
                out.report.rebuild_time += started.elapsed();
                let read = Instant::now();
                let (tokens, kv_bytes) = read_layer(dir, state, (context, layer), start, |batch| {
                    catalog.replay(id, layer, &batch.keys, &batch.values, batch.prefill)
                })?;
                let report = &mut out.report;
                report.read_time += read.elapsed();
                report.homes_restored += 1;
                report.home_bytes_loaded += bytes;
                report.layers_loaded += 1;
                report.tokens_loaded += tokens;
                report.kv_bytes_loaded += kv_bytes;
                out.homes.insert((context, layer), state_on_disk);
                return Ok(());
            }
            Err(e) if relied_on > 0 => {
                return Err(home_lost(dir, (context, layer), relied_on, &format!("does not restore ({e})")));
            }
            // Nothing was changed and the data file still holds every token.
            Err(e) => out.report.layout_errors.push(format!("home of context {context} layer {layer}: {e}")),
        }
    }
    replay_batches(catalog, dir, state, ctx, (context, layer), background, out)
}

/// Cuts what an append wrote to a layer's data file before its record committed (if the
/// file exists at all).
fn cut_uncommitted(
    durable: &DurableConfig,
    dir: &EngineDir,
    (context, layer): (u64, usize),
    committed: u64,
    report: &mut RecoveryReport,
) -> Result<()> {
    let path = data_path(dir, context, layer);
    if let Ok(meta) = std::fs::metadata(&path) {
        if meta.len() > committed {
            report.uncommitted_data_bytes += meta.len() - committed;
            report.data_files_cut.push((path.clone(), meta.len() - committed));
            let file = durable.storage.open(&path).map_err(io("open", &path))?;
            file.set_len(committed).map_err(io("truncate", &path))?;
            file.sync_data().map_err(io("fsync", &path))?;
        }
    }
    Ok(())
}

/// Replays a layer's committed batches: a wave or PQ layer with a checkpointed layout is
/// restored from it without clustering or training (its batches collected first), and the
/// batches after the layout (or all of them, when the layout is unusable) are ingested as
/// they were committed; other layers (and background rebuilds) batch by batch.
fn replay_batches(
    catalog: &ContextCatalog,
    dir: &EngineDir,
    state: &State,
    ctx: &CommittedContext,
    (context, layer): (u64, usize),
    background: bool,
    out: &mut Replayed,
) -> Result<()> {
    let id = ContextId(context);
    let report = &mut out.report;
    let mut read_time = Duration::ZERO;
    let mut rebuild_time = Duration::ZERO;
    let mut last = Instant::now();
    let layout = match (ctx.spec.layers[layer], background) {
        (LayerKind::Global, false) => super::layout::read_layout(dir, context, layer, ctx.spec.method.name())
            .unwrap_or_else(|why| {
                report.layout_errors.push(why);
                None
            }),
        _ => None,
    };
    let mut held = Vec::new();
    let (tokens, bytes) = read_layer(dir, state, (context, layer), Start::default(), |batch| {
        read_time += last.elapsed();
        let rebuild = Instant::now();
        if layout.is_some() {
            held.push(batch);
        } else {
            catalog.replay(id, layer, &batch.keys, &batch.values, batch.prefill)?;
        }
        rebuild_time += rebuild.elapsed();
        last = Instant::now();
        Ok(())
    })?;
    if let Some(layout) = layout {
        let rebuild = Instant::now();
        let file = super::layout::layout_name(context, layer, layout.method()).unwrap_or_default();
        let restored = match super::layout::split_at(&held, layout.tokens(), ctx.spec.shape.kv_heads) {
            Some((keys, values, cut)) => match catalog.restore_layer(id, layer, &layout, &keys, &values) {
                Ok(()) => {
                    out.layout_ends.insert((context, layer), layout.indexed_end());
                    Some(cut)
                }
                Err(e) => {
                    report.layout_errors.push(format!("{file}: {e}"));
                    None
                }
            },
            None => {
                report.layout_errors.push(format!(
                    "{file}: covers {} tokens, which does not end on a committed batch",
                    layout.tokens()
                ));
                None
            }
        };
        // The batches the layout does not cover, or (an unusable layout: nothing was
        // changed) all of them, ingested as they were committed.
        report.layouts_restored += usize::from(restored.is_some());
        for batch in &held[restored.unwrap_or(0)..] {
            catalog.replay(id, layer, &batch.keys, &batch.values, batch.prefill)?;
        }
        rebuild_time += rebuild.elapsed();
    }
    report.read_time += read_time;
    report.rebuild_time += rebuild_time;
    report.layers_loaded += 1;
    report.tokens_loaded += tokens;
    report.kv_bytes_loaded += bytes;
    Ok(())
}

/// The durable engine's file catalog (data-file lengths per layer) of the recovered state.
fn file_catalog(generation: u64, contexts: BTreeMap<u64, CommittedContext>) -> Catalog {
    Catalog {
        generation,
        contexts: contexts
            .into_iter()
            .map(|(context, c)| {
                let layers = c
                    .layers
                    .iter()
                    .map(|l| CatalogLayer {
                        file: None,
                        committed_bytes: l.committed_bytes,
                        tokens: l.tokens,
                        chunks: l.chunks,
                    })
                    .collect();
                (context, CatalogContext { spec: c.spec_record, layers })
            })
            .collect(),
    }
}
