//! The durable engine: KV data files, a write-ahead log with group commit, checkpoints and
//! recovery, under one directory:
//!
//! ```text
//! DIR/IDENTITY                       the directory's random id (in every file's checksums)
//! DIR/LOCK                           flock held while an engine has the directory open
//! DIR/MANIFEST                       catalog as of the last checkpoint (atomic replace)
//! DIR/wal/wal-<first lsn>.log        log files (attnstore-wal framing)
//! DIR/data/ctx-<id>-layer-<l>.kv     one append-only chunk file per (context, layer)
//! DIR/index/                         checkpointed index layouts, and the 2-bit homes of
//!                                    hack2 wave layers (`home.rs`)
//! ```
//!
//! An append writes its chunk to the data file, then appends an `AppendKv` record and waits
//! for group commit (which fsyncs the data file before the log); only then does the batch
//! become visible in memory. `Engine::in_memory` has no [`Durable`] and skips all of this.

mod check;
mod datafile;
mod fuzz;
mod fuzz_recover;
mod home;
mod home_kv43;
mod identity;
pub(crate) mod layout;
mod open;
mod rebuild;
pub(crate) mod records;
pub(crate) use open::open;
mod recovery;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use attnstore_wal::{write_manifest, LogWriter, Lsn, RecordKind, StdStorage, Storage, StorageFile, WriterConfig};
use parking_lot::{Mutex, RwLock};

use crate::catalog::ContextCatalog;
use crate::context::ContextId;
use crate::error::{Error, Result};
use crate::spec::ContextSpec;

pub use attnstore_wal::{LogCut, RecoveryMode};
pub use check::{check, CheckReport, LayerCheck};
use datafile::ChunkOwner;
pub use datafile::{chunk_bytes, StoredBatch};
pub use fuzz::fuzz_decode_catalog;
pub use fuzz_recover::fuzz_recover;
use identity::EngineDir;
pub use identity::IDENTITY_FILE;
pub use layout::INDEX_DIR;
pub use rebuild::IndexRebuild;
use records::{
    encode, AppendRecord, CheckpointRecord, CreateContextRecord, DropContextRecord, Manifest, ManifestContext,
    ManifestHome, ManifestLayer, SpecRecord,
};
pub use recovery::RecoveryReport;

/// Name of the manifest file in an engine directory.
pub const MANIFEST_FILE: &str = "MANIFEST";
/// Lock file that keeps a second engine from opening the same directory.
pub const LOCK_FILE: &str = "LOCK";
/// Sub-directory of the log files.
pub const WAL_DIR: &str = "wal";
/// Sub-directory of the KV data files.
pub const DATA_DIR: &str = "data";

/// Settings of the durable part of an engine.
#[derive(Debug, Clone)]
pub struct DurableConfig {
    /// Sync policy and log file size of the write-ahead log.
    pub wal: WriterConfig,
    /// The file system writes go through (a fault-injecting one in tests).
    pub storage: Arc<dyn Storage>,
    /// Whether opening waits for recovered indexes to be rebuilt.
    pub index_rebuild: IndexRebuild,
    /// What recovery does with damage that may hide acknowledged appends: refuse to open
    /// (the default), or cut the log there and report what was cut
    /// ([`RecoveryReport::log_cut`]).
    pub recovery: RecoveryMode,
    /// Whether a directory that does not exist, or is empty, is made an engine directory
    /// (default `true`). A directory with other files in it is never made one.
    pub create: bool,
}

impl Default for DurableConfig {
    fn default() -> Self {
        Self {
            wal: WriterConfig::default(),
            storage: Arc::new(StdStorage),
            index_rebuild: IndexRebuild::Blocking,
            recovery: RecoveryMode::Strict,
            create: true,
        }
    }
}

/// What a checkpoint did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointReport {
    /// The manifest's new generation.
    pub generation: u64,
    /// Replay now starts at this LSN.
    pub wal_start_lsn: Lsn,
    /// Log files deleted because the manifest covers them.
    pub removed_log_files: usize,
    /// Contexts in the manifest.
    pub contexts: usize,
    /// Size of the manifest's payload.
    pub manifest_bytes: usize,
    /// Index layouts written: wave layers whose segments changed since the last checkpoint,
    /// PQ layers whose codebooks are not on disk yet.
    pub layouts_written: usize,
    /// Bytes of those layouts' payloads.
    pub layout_bytes: usize,
    /// PQ layers whose codebook build was still running: nothing to keep yet (a later
    /// checkpoint writes them; `Engine::wait_index` waits for a build).
    pub layouts_pending: usize,
    /// Layouts larger than one record may be (64 MiB): not written, rebuilt on reopen.
    pub layouts_oversized: usize,
    /// `hack2` wave layers whose 2-bit home was written (new segment files and the home).
    pub homes_written: usize,
    /// Bytes of those files' payloads.
    pub home_bytes: usize,
    /// Data file bytes punched out because a 2-bit home now holds their tokens (0 where the
    /// file system cannot punch holes; the bytes then stay, unread).
    pub data_bytes_freed: u64,
}

/// The durable state attached to an [`Engine`] made by [`Engine::open`].
pub(crate) struct Durable {
    dir: EngineDir,
    storage: Arc<dyn Storage>,
    wal: LogWriter,
    /// Appends, creates and drops hold it shared; a checkpoint holds it exclusively, so the
    /// catalog it writes matches the log position it rotates to.
    gate: RwLock<()>,
    catalog: Mutex<Catalog>,
    /// Held while a drop is logged.
    drop_lock: Mutex<()>,
    /// The open, `flock`ed `DIR/LOCK`: released when the engine (and its rebuild thread) let go.
    _lock: std::fs::File,
    report: RecoveryReport,
    rebuild: rebuild::RebuildProgress,
    /// Per (context, layer): the indexed end ([`attnstore_index::IndexLayout::indexed_end`])
    /// of the layout file on disk, so a checkpoint rewrites only layouts that changed.
    layouts: Mutex<BTreeMap<(u64, usize), u64>>,
    /// Per `hack2` wave layer: its 2-bit home on disk (`home.rs`).
    homes: Mutex<BTreeMap<(u64, usize), home::HomeState>>,
}

/// The durable catalog: what the next manifest will say.
#[derive(Default)]
pub(crate) struct Catalog {
    pub generation: u64,
    pub contexts: BTreeMap<u64, CatalogContext>,
}

pub(crate) struct CatalogContext {
    pub spec: SpecRecord,
    pub layers: Vec<CatalogLayer>,
}

#[derive(Default)]
pub(crate) struct CatalogLayer {
    /// Open handle of the data file, once written to in this process.
    pub file: Option<Arc<dyn StorageFile>>,
    /// End of the chunks whose log records are committed or queued (submitted appends are
    /// in the data file before their record is queued; a checkpoint commits them first).
    pub committed_bytes: u64,
    pub tokens: u64,
    pub chunks: u64,
}

impl CatalogLayer {
    fn manifest(&self) -> ManifestLayer {
        ManifestLayer { committed_bytes: self.committed_bytes, tokens: self.tokens, chunks: self.chunks }
    }
}

/// `error` as a message that names `path` once (a WAL error about a file names it already).
fn named(path: &Path, error: &attnstore_wal::Error) -> String {
    let message = error.to_string();
    match message.starts_with(&path.display().to_string()) {
        true => message,
        false => format!("{}: {message}", path.display()),
    }
}

fn data_path(dir: &Path, context: u64, layer: usize) -> PathBuf {
    dir.join(DATA_DIR).join(datafile::data_file_name(context, layer))
}

impl Durable {
    fn data_dir(&self) -> PathBuf {
        self.dir.join(DATA_DIR)
    }

    fn owner(&self, id: ContextId, layer: usize) -> ChunkOwner {
        ChunkOwner { dir_id: self.dir.id, context: id.0, layer: layer as u32 }
    }

    pub(crate) fn log_create(&self, id: ContextId, spec: &ContextSpec) -> Result<()> {
        let _gate = self.gate.read();
        let spec = SpecRecord::from_spec(spec);
        let layers = (0..spec.layers.len()).map(|_| CatalogLayer::default()).collect();
        self.wal
            .append(RecordKind::CreateContext, &encode(&CreateContextRecord { context: id.0, spec: spec.clone() }))?;
        self.catalog.lock().contexts.insert(id.0, CatalogContext { spec, layers });
        Ok(())
    }

    pub(crate) fn log_drop(&self, id: ContextId) -> Result<()> {
        let _gate = self.gate.read();
        // Drops are serialized so one context is never logged as dropped twice (replay
        // refuses a drop of a context that does not exist).
        let _drop = self.drop_lock.lock();
        if !self.catalog.lock().contexts.contains_key(&id.0) {
            return Err(Error::UnknownContext(id));
        }
        self.wal.append(RecordKind::DropContext, &encode(&DropContextRecord { context: id.0 }))?;
        let dropped = self.catalog.lock().contexts.remove(&id.0);
        // The drop is committed: the files are garbage now. Deleting them is best effort,
        // recovery removes data files of contexts it does not know.
        if let Some(ctx) = dropped {
            for layer in 0..ctx.layers.len() {
                let _ = std::fs::remove_file(data_path(&self.dir, id.0, layer));
            }
            let _ = self.storage.sync_dir(&self.data_dir());
            // A 2-bit home is the bulk of a hack2 context's bytes: it goes now too (the
            // next checkpoint or recovery removes whatever is left of it and its layouts).
            self.homes.lock().retain(|&(c, _), _| c != id.0);
            home::remove_files(&self.dir, id.0, ctx.layers.len());
        }
        Ok(())
    }

    /// Makes one ingest batch (`tokens`, keys, values) durable: chunk to the data file, then
    /// the `AppendKv` record through group commit (`wait`), or queued for the next group
    /// commit (not `wait`: acknowledged by `LogWriter::wait_durable` of the returned LSN).
    /// The caller holds the layer's write lock, so batches of one layer are written in the
    /// order they become visible.
    pub(crate) fn log_ingest(
        &self,
        id: ContextId,
        layer: usize,
        prefill: bool,
        spec: &ContextSpec,
        (tokens, keys, values): (usize, &[f32], &[f32]),
        wait: bool,
    ) -> Result<Lsn> {
        let _gate = self.gate.read();
        let path = data_path(&self.dir, id.0, layer);
        let (file, offset) = {
            let mut catalog = self.catalog.lock();
            let entry = catalog.contexts.get_mut(&id.0).ok_or(Error::UnknownContext(id))?;
            let state = &mut entry.layers[layer];
            if state.file.is_none() {
                let opened = if state.committed_bytes > 0 {
                    self.storage.open(&path).map_err(|e| attnstore_wal::Error::io("open", &path, &e))?
                } else {
                    let file = self.storage.create(&path).map_err(|e| attnstore_wal::Error::io("create", &path, &e))?;
                    let data_dir = self.data_dir();
                    self.storage
                        .sync_dir(&data_dir)
                        .map_err(|e| attnstore_wal::Error::io("fsync dir", &data_dir, &e))?;
                    file
                };
                state.file = Some(opened);
            }
            (state.file.clone().expect("opened above"), state.committed_bytes)
        };
        let chunk = datafile::encode_chunk((self.owner(id, layer), offset), spec.dtype, prefill, tokens, keys, values);
        // A failed write (e.g. a full disk) leaves at most garbage after the committed end,
        // which the next write at the same offset overwrites and recovery truncates.
        file.write_all_at(&chunk.bytes, offset).map_err(|e| attnstore_wal::Error::io("write", &path, &e))?;
        let record = AppendRecord {
            context: id.0,
            layer: layer as u32,
            prefill,
            offset,
            chunk_bytes: chunk.bytes.len() as u64,
            tokens: tokens as u64,
            payload_crc: chunk.payload_crc,
        };
        let lsn = match wait {
            true => self.wal.append_after(RecordKind::AppendKv, &encode(&record), Some(file))?,
            false => self.wal.submit(RecordKind::AppendKv, &encode(&record), Some(file))?,
        };
        let mut catalog = self.catalog.lock();
        if let Some(entry) = catalog.contexts.get_mut(&id.0) {
            let state = &mut entry.layers[layer];
            state.committed_bytes = offset + chunk.bytes.len() as u64;
            state.tokens += tokens as u64;
            state.chunks += 1;
        }
        Ok(lsn)
    }

    /// Waits until the record at `lsn` and every earlier one are committed.
    pub(crate) fn wait_durable(&self, lsn: Lsn) -> Result<()> {
        Ok(self.wal.wait_durable(lsn)?)
    }

    fn checkpoint(
        &self,
        next_context_id: u64,
        layouts: Vec<(u64, usize, attnstore_index::IndexLayout)>,
        layouts_pending: usize,
        homes: Vec<home::HomeJob>,
    ) -> Result<CheckpointReport> {
        // Index layouts first: each is valid on its own (it covers tokens that are already
        // committed and never change), so no ordering with the manifest is needed.
        let (mut layouts_written, mut layout_bytes, mut layouts_oversized) = (0, 0, 0);
        // `layouts` holds only those that changed since the file on disk (`Engine::checkpoint`).
        for (context, layer, l) in &layouts {
            let key = (*context, *layer);
            if l.is_empty() {
                continue;
            }
            match layout::write_layout(&*self.storage, &self.dir, *context, *layer, l)? {
                Some(bytes) => {
                    layout_bytes += bytes;
                    layouts_written += 1;
                    self.layouts.lock().insert(key, l.indexed_end());
                }
                None => layouts_oversized += 1,
            }
        }
        let (homes_written, home_bytes) = self.write_homes(&homes)?;
        let _gate = self.gate.write();
        // Everything logged so far becomes durable (data files included) and lies in older files.
        let wal_start_lsn = self.wal.rotate()?;
        let mut catalog = self.catalog.lock();
        let generation = catalog.generation + 1;
        let manifest = Manifest {
            generation,
            wal_start_lsn,
            next_context_id,
            contexts: catalog
                .contexts
                .iter()
                .map(|(&context, c)| ManifestContext {
                    context,
                    spec: c.spec.clone(),
                    layers: c.layers.iter().map(CatalogLayer::manifest).collect(),
                })
                .collect(),
            homes: self
                .homes
                .lock()
                .iter()
                .filter(|((c, _), h)| catalog.contexts.contains_key(c) && h.data_bytes > 0)
                .map(|(&(context, layer), h)| ManifestHome { context, layer: layer as u32, data_bytes: h.data_bytes })
                .collect(),
        };
        let payload = encode(&manifest);
        write_manifest(&*self.storage, &self.dir, MANIFEST_FILE, self.dir.file(MANIFEST_FILE), &payload)?;
        catalog.generation = generation;
        drop(catalog);
        self.wal.append(RecordKind::Checkpoint, &encode(&CheckpointRecord { generation }))?;
        let removed_log_files = self.wal.remove_files_before(wal_start_lsn)?;
        let live = manifest.contexts.iter().flat_map(|c| (0..c.layers.len()).map(move |l| (c.context, l))).collect();
        layout::remove_stale(&self.dir, &live);
        self.layouts.lock().retain(|key, _| live.contains(key));
        self.homes.lock().retain(|key, _| live.contains(key));
        // The manifest now says where those tokens live: their f16 chunks can go.
        let data_bytes_freed = self.punch_homed(&manifest.homes)?;
        Ok(CheckpointReport {
            generation,
            wal_start_lsn,
            removed_log_files,
            contexts: manifest.contexts.len(),
            manifest_bytes: payload.len(),
            layouts_written,
            layout_bytes,
            layouts_pending,
            layouts_oversized,
            homes_written,
            home_bytes,
            data_bytes_freed,
        })
    }

    /// Writes the 2-bit homes of `jobs` (each: new segment files, then the home), once
    /// every record their data bytes depend on is durable; returns how many were written
    /// and their bytes.
    fn write_homes(&self, jobs: &[home::HomeJob]) -> Result<(usize, usize)> {
        if jobs.is_empty() {
            return Ok((0, 0));
        }
        // A home replaces the one before it, whose punched bytes are gone: it may only
        // cover chunks whose records are durable (submitted appends may still be queued).
        self.wal.sync()?;
        let (mut written, mut bytes) = (0, 0);
        for job in jobs {
            let key = (job.context, job.layer);
            if job.layout_end.is_some_and(|end| self.layouts.lock().get(&key) != Some(&end)) {
                // Its layout (the codebooks) is not on disk: too large for one file. The
                // layer keeps its data file as its home.
                continue;
            }
            let known = self.homes.lock().get(&key).cloned().unwrap_or_default();
            if let Some((state, n)) = home::write_home(&*self.storage, &self.dir, job, &known)? {
                self.homes.lock().insert(key, state);
                written += 1;
                bytes += n;
            }
        }
        Ok((written, bytes))
    }

    /// Punches the bytes of every homed layer's data file that the manifest just written
    /// says its home holds; returns the bytes freed.
    fn punch_homed(&self, homes: &[ManifestHome]) -> Result<u64> {
        let mut freed = 0;
        for h in homes {
            let key = (h.context, h.layer as usize);
            let punched = self.homes.lock().get(&key).map_or(0, |s| s.punched);
            if punched >= h.data_bytes {
                continue;
            }
            let path = data_path(&self.dir, h.context, h.layer as usize);
            let file = self.storage.open(&path).map_err(|e| attnstore_wal::Error::io("open", &path, &e))?;
            let done = file
                .punch_hole(punched, h.data_bytes - punched)
                .map_err(|e| attnstore_wal::Error::io("punch hole in", &path, &e))?;
            if done {
                freed += h.data_bytes - punched;
            }
            if let Some(state) = self.homes.lock().get_mut(&key) {
                state.punched = h.data_bytes;
            }
        }
        Ok(freed)
    }

    pub(crate) fn stored_batches(&self, id: ContextId, layer: usize, spec: &ContextSpec) -> Result<Vec<StoredBatch>> {
        let _gate = self.gate.read();
        let committed = {
            let catalog = self.catalog.lock();
            let entry = catalog.contexts.get(&id.0).ok_or(Error::UnknownContext(id))?;
            entry.layers[layer].committed_bytes
        };
        if committed == 0 {
            return Ok(Vec::new());
        }
        let row = spec.shape.kv_heads * spec.shape.head_dim;
        // Bytes a 2-bit home holds may be punched out: read from where they end.
        let punched = self.homes.lock().get(&(id.0, layer)).map_or(0, |h| h.punched);
        let path = data_path(&self.dir, id.0, layer);
        let mut reader =
            datafile::ChunkReader::open(&path, self.owner(id, layer), committed, spec.dtype, row)?.starting_at(punched);
        let mut batches = Vec::new();
        while let Some(batch) = reader.next_chunk()? {
            batches.push(batch);
        }
        Ok(batches)
    }
}

impl Durable {
    /// Checkpoints `contexts` (see `Engine::checkpoint`): collects, under each layer's read
    /// lock, the index layouts that changed and the 2-bit homes to write, then writes the
    /// manifest.
    pub(crate) fn checkpoint_catalog(&self, contexts: &ContextCatalog) -> Result<CheckpointReport> {
        let durable = self;
        let (mut layouts, mut pending, mut homes) = (Vec::new(), 0, Vec::new());
        for id in contexts.ids() {
            let Ok(ctx) = contexts.get(id) else { continue }; // dropped meanwhile
            for (layer, state) in ctx.layers.iter().enumerate() {
                let guard = state.read();
                if guard.rebuilding {
                    continue;
                }
                let Some(snaps) = guard.method.snapshots() else { continue };
                if let Some(segments) = snaps.encoded_segments() {
                    if segments > 0 {
                        // Under the layer's lock the catalog matches the index: appends
                        // update both while holding it for writing (lock order layer → catalog).
                        let known = durable.homes.lock().get(&(id.0, layer)).cloned().unwrap_or_default();
                        let catalog = durable.catalog.lock();
                        let Some(c) = catalog.contexts.get(&id.0).map(|c| &c.layers[layer]) else { continue };
                        // A PQ home holds rows only: its codebooks and codes are the
                        // layer's layout, written below, and the home needs that file.
                        let needs_layout = snaps.home_needs_layout();
                        if c.committed_bytes != known.data_bytes {
                            if let Some(home) = snaps.encoded_home(known.segment_crcs.len()) {
                                homes.push(home::HomeJob {
                                    context: id.0,
                                    layer,
                                    home: home?,
                                    data_bytes: c.committed_bytes,
                                    chunks: c.chunks,
                                    tokens: c.tokens,
                                    head_dim: ctx.spec.shape.head_dim,
                                    layout_end: if needs_layout { snaps.layout_end() } else { None },
                                });
                            }
                        }
                        if !needs_layout {
                            continue;
                        }
                    }
                }
                match snaps.layout_end() {
                    // Already on disk as it is: no copy.
                    Some(end) if durable.layouts.lock().get(&(id.0, layer)) == Some(&end) => {}
                    Some(_) => layouts.extend(snaps.layout().map(|l| (id.0, layer, l))),
                    None => pending += usize::from(guard.method.build_handle().is_some_and(|h| !h.is_ready())),
                }
            }
        }
        durable.checkpoint(contexts.next_id(), layouts, pending, homes)
    }

    /// Waits up to `timeout` for the background index rebuild: `Ok(true)` once every
    /// recovered layer has its index, `Ok(false)` at the deadline, or the error that
    /// stopped the rebuild.
    pub(crate) fn wait_rebuild(&self, timeout: std::time::Duration) -> Result<bool> {
        let deadline = std::time::Instant::now() + timeout;
        let mut state = self.rebuild.state.lock();
        loop {
            if let Some(error) = &state.error {
                return Err(error.clone());
            }
            if state.pending_layers == 0 {
                return Ok(true);
            }
            if self.rebuild.done.wait_until(&mut state, deadline).timed_out() {
                return Ok(state.pending_layers == 0 && state.error.is_none());
            }
        }
    }

    /// How long the background index rebuild took, once it has finished.
    pub(crate) fn rebuild_time(&self) -> Option<std::time::Duration> {
        self.rebuild.state.lock().elapsed
    }

    /// What opening recovered.
    pub(crate) fn report(&self) -> &RecoveryReport {
        &self.report
    }

    /// Makes everything acknowledged so far durable, whatever the sync policy.
    pub(crate) fn sync(&self) -> Result<()> {
        self.wal.sync()?;
        Ok(())
    }

    /// Counters of the write-ahead log.
    pub(crate) fn wal_stats(&self) -> attnstore_wal::WriterStats {
        self.wal.stats()
    }
}
