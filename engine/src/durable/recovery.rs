//! Recovery: manifest, then the log after it, then the data files the two commit to.
//!
//! [`read_state`] is read-only and shared by `Engine::open` and [`check`]: it decodes the
//! manifest and every log record into the committed catalog (contexts, and per layer the
//! committed length of its data file). Opening then repairs (cuts the torn log tail and
//! uncommitted data-file bytes), loads every chunk with its checksums verified, and rebuilds
//! the indexes by replaying the batches into the engine's catalog (`open.rs`).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use attnstore_wal::{
    read_manifest, replay_dir, LogCut, LogFileSummary, LogReplay, Lsn, RecordKind, RecoveryMode, TornTail,
};

use super::datafile::ChunkOwner;
use super::datafile::{parse_data_file_name, ChunkReader, StoredBatch};
use super::home::read_home;
use super::identity::EngineDir;
use super::records::{
    decode, decode_catalog, AppendRecord, CreateContextRecord, DropContextRecord, Manifest, SpecRecord,
};
use super::{data_path, DATA_DIR, LOCK_FILE, MANIFEST_FILE, WAL_DIR};
use crate::error::{Error, Result};
use crate::spec::{ContextSpec, LayerKind, Method};

/// What opening a durable engine found and did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RecoveryReport {
    /// Generation of the manifest loaded, `None` if there was none (a new directory or no
    /// checkpoint yet).
    pub manifest_generation: Option<u64>,
    /// LSN replay started at.
    pub wal_start_lsn: Lsn,
    /// Log files read.
    pub log_files: Vec<LogFileSummary>,
    /// Records replayed, per kind: create, append, drop, checkpoint.
    pub replayed: RecordCounts,
    /// Appends skipped because their context was dropped later in the log.
    pub skipped_appends: u64,
    /// The torn log tail that was cut off, if a crash left one.
    pub torn_tail: Option<TornTail>,
    /// Under point-in-time recovery ([`RecoveryMode::PointInTime`]): the damage the log
    /// was cut at, and what was dropped with it (acknowledged appends may be among it).
    pub log_cut: Option<LogCut>,
    /// Data files cut back to what the log commits, and the bytes cut from each (chunks
    /// whose records never committed, or were cut with a damaged log).
    pub data_files_cut: Vec<(PathBuf, u64)>,
    /// Bytes after the committed end of data files (chunks whose record never committed), cut off.
    pub uncommitted_data_bytes: u64,
    /// Data files of contexts that no longer exist, deleted.
    pub orphan_data_files: Vec<PathBuf>,
    /// Contexts recovered.
    pub contexts: usize,
    /// Layers whose KV was loaded.
    pub layers_loaded: usize,
    /// Tokens loaded, summed over layers.
    pub tokens_loaded: u64,
    /// Bytes of KV chunks read and verified.
    pub kv_bytes_loaded: u64,
    /// The LSN the log continues at.
    pub next_lsn: Lsn,
    /// Time reading and verifying chunks (and 2-bit homes' segment files).
    pub read_time: Duration,
    /// Time rebuilding indexes (ingest of the recovered batches).
    pub rebuild_time: Duration,
    /// Wall time of the whole open.
    pub total_time: Duration,
    /// Layers loaded exactly whose index is being rebuilt in the background.
    pub background_rebuild_layers: usize,
    /// Wave and PQ layers restored from a checkpointed layout (no clustering or codebook
    /// training of the tokens it covers).
    pub layouts_restored: usize,
    /// Layout files that could not be used (why, naming the file); those layers were rebuilt
    /// from their KV.
    pub layout_errors: Vec<String>,
    /// Layout files of contexts that no longer exist, deleted.
    pub stale_layout_files: Vec<PathBuf>,
    /// `hack2` wave layers restored from their 2-bit home (segment files), nothing recomputed.
    pub homes_restored: usize,
    /// Bytes of those homes' files read and verified.
    pub home_bytes_loaded: u64,
}

/// Records of each kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecordCounts {
    /// `CreateContext` records.
    pub creates: u64,
    /// `AppendKv` records.
    pub appends: u64,
    /// `DropContext` records.
    pub drops: u64,
    /// `Checkpoint` records.
    pub checkpoints: u64,
}

impl fmt::Display for RecoveryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.manifest_generation {
            Some(g) => writeln!(f, "manifest: generation {g}, replay from lsn {}", self.wal_start_lsn)?,
            None => writeln!(f, "manifest: none, replay from lsn {}", self.wal_start_lsn)?,
        }
        let log_bytes: u64 = self.log_files.iter().map(|l| l.bytes).sum();
        let r = self.replayed;
        writeln!(
            f,
            "log: {} files, {log_bytes} bytes; replayed {} creates, {} appends ({} skipped: context dropped), {} drops, {} checkpoints; next lsn {}",
            self.log_files.len(),
            r.creates,
            r.appends,
            self.skipped_appends,
            r.drops,
            r.checkpoints,
            self.next_lsn
        )?;
        match &self.torn_tail {
            Some(t) => writeln!(
                f,
                "torn tail: {} cut at offset {} ({} bytes dropped)",
                t.file.display(),
                t.valid_up_to,
                t.file_bytes - t.valid_up_to
            )?,
            None => writeln!(f, "torn tail: none")?,
        }
        if let Some(cut) = &self.log_cut {
            writeln!(
                f,
                "POINT-IN-TIME RECOVERY: the log was cut at {} offset {} (records from lsn {} on are gone: {} bytes dropped, {} later log files removed), because: {}",
                cut.file.display(),
                cut.offset,
                cut.next_lsn,
                cut.bytes_dropped,
                cut.later_files.len(),
                cut.damage
            )?;
        }
        for (file, bytes) in &self.data_files_cut {
            writeln!(f, "data file {} cut by {bytes} bytes the log does not commit", file.display())?;
        }
        writeln!(
            f,
            "data: {} contexts, {} layers, {} tokens, {} KV bytes verified; {} uncommitted bytes cut; {} orphan files removed",
            self.contexts,
            self.layers_loaded,
            self.tokens_loaded,
            self.kv_bytes_loaded,
            self.uncommitted_data_bytes,
            self.orphan_data_files.len()
        )?;
        if self.layouts_restored > 0 || !self.layout_errors.is_empty() || !self.stale_layout_files.is_empty() {
            writeln!(
                f,
                "index layouts: {} layers restored without clustering or codebook training; {} unusable (rebuilt from KV); {} stale files removed",
                self.layouts_restored,
                self.layout_errors.len(),
                self.stale_layout_files.len()
            )?;
            for why in &self.layout_errors {
                writeln!(f, "  unusable layout: {why}")?;
            }
        }
        if self.homes_restored > 0 {
            writeln!(
                f,
                "2-bit homes: {} hack2 layers restored from {} bytes of segment files",
                self.homes_restored, self.home_bytes_loaded
            )?;
        }
        if self.background_rebuild_layers > 0 {
            writeln!(
                f,
                "indexes: {} layers served exactly while rebuilt in the background",
                self.background_rebuild_layers
            )?;
        }
        write!(
            f,
            "time: {:.1} ms total ({:.1} ms reading chunks, {:.1} ms rebuilding indexes)",
            ms(self.total_time),
            ms(self.read_time),
            ms(self.rebuild_time)
        )
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The committed state of a directory, read without changing anything.
pub(crate) struct State {
    pub manifest_generation: Option<u64>,
    pub wal_start_lsn: Lsn,
    pub next_context_id: u64,
    pub contexts: BTreeMap<u64, CommittedContext>,
    pub replay: LogReplay,
    pub replayed: RecordCounts,
    pub skipped_appends: u64,
    /// Payload crc of each chunk the replayed log committed, by (context, layer, offset).
    pub logged_crcs: HashMap<(u64, usize, u64), u32>,
    /// Per layer homed in 2-bit segment files: the data bytes the manifest says its home
    /// holds (and which may be punched out of its data file).
    pub homes: BTreeMap<(u64, usize), u64>,
}

pub(crate) struct CommittedContext {
    pub spec_record: SpecRecord,
    pub spec: ContextSpec,
    pub layers: Vec<super::records::ManifestLayer>,
}

/// Reads manifest and log of `dir` into the committed catalog; damage in the log is an
/// error, or under [`RecoveryMode::PointInTime`] the end of the log.
pub(crate) fn read_state(dir: &EngineDir, mode: RecoveryMode) -> Result<State> {
    let manifest_path = dir.join(MANIFEST_FILE);
    let manifest: Option<Manifest> = match read_manifest(dir, MANIFEST_FILE, dir.file(MANIFEST_FILE))? {
        Some(payload) => Some(decode_catalog(&payload).map_err(|detail| Error::Corrupt {
            file: manifest_path.clone(),
            offset: attnstore_wal::FileHeader::SIZE as u64,
            detail: format!("manifest catalog does not decode: {detail}"),
        })?),
        None => None,
    };
    let wal_start_lsn = manifest.as_ref().map_or(1, |m| m.wal_start_lsn);
    if manifest.is_none() {
        // Without a checkpoint the log starts at lsn 1; a later start means a checkpoint
        // deleted the log before it, and its manifest is what is missing.
        if let Some((first, _)) = attnstore_wal::list_log_files(&dir.join(WAL_DIR))?.first() {
            if *first > 1 {
                return Err(Error::MissingFile {
                    file: manifest_path,
                    why: format!("the log starts at lsn {first}, so a checkpoint was written and its manifest is gone"),
                });
            }
        }
    }
    let mut contexts = BTreeMap::new();
    let mut next_context_id = 1;
    if let Some(m) = &manifest {
        next_context_id = m.next_context_id;
        for c in &m.contexts {
            let corrupt = |detail: String| Error::Corrupt {
                file: manifest_path.clone(),
                offset: attnstore_wal::FileHeader::SIZE as u64,
                detail,
            };
            let spec = c.spec.to_spec().map_err(|e| corrupt(format!("context {}: bad spec: {e}", c.context)))?;
            if c.layers.len() != spec.layers.len() {
                return Err(corrupt(format!(
                    "context {}: expected {} layers, got {}",
                    c.context,
                    spec.layers.len(),
                    c.layers.len()
                )));
            }
            let entry = CommittedContext { spec_record: c.spec.clone(), spec, layers: c.layers.clone() };
            if contexts.insert(c.context, entry).is_some() {
                return Err(corrupt(format!("context {} listed twice", c.context)));
            }
        }
    }
    let replay = replay_dir(&dir.join(WAL_DIR), dir.id, wal_start_lsn, mode)?;
    // An opened directory always keeps the log file it continues in: with none left, a
    // checkpointed or written directory has lost its log (do not treat it as empty).
    if replay.files.is_empty() && (manifest.is_some() || !data_files(dir)?.is_empty()) {
        let expected = dir.join(WAL_DIR).join(attnstore_wal::log_file_name(wal_start_lsn));
        return Err(Error::MissingLog { file: expected, expected_lsn: wal_start_lsn });
    }
    // Appends to a context dropped later in the log are skipped: its files may be gone.
    let mut dropped_later = std::collections::HashSet::new();
    for record in &replay.records {
        if record.kind == RecordKind::DropContext {
            if let Ok(r) = decode::<DropContextRecord>(&record.payload) {
                dropped_later.insert(r.context);
            }
        }
    }
    let mut state = State {
        manifest_generation: manifest.as_ref().map(|m| m.generation),
        wal_start_lsn,
        next_context_id,
        contexts,
        replay: LogReplay::default(),
        replayed: RecordCounts::default(),
        skipped_appends: 0,
        logged_crcs: HashMap::new(),
        homes: manifest.iter().flat_map(|m| &m.homes).map(|h| ((h.context, h.layer as usize), h.data_bytes)).collect(),
    };
    for record in &replay.records {
        let corrupt =
            |detail: String| Error::Corrupt { file: record.file.clone(), offset: record.offset as u64, detail };
        let bad_payload =
            |e: String| corrupt(format!("{} record (lsn {}) does not decode: {e}", record.kind, record.lsn));
        match record.kind {
            RecordKind::CreateContext => {
                let r: CreateContextRecord = decode(&record.payload).map_err(bad_payload)?;
                let spec = r.spec.to_spec().map_err(|e| corrupt(format!("context {}: bad spec: {e}", r.context)))?;
                let layers =
                    vec![super::records::ManifestLayer { committed_bytes: 0, tokens: 0, chunks: 0 }; spec.layers.len()];
                if state.contexts.insert(r.context, CommittedContext { spec_record: r.spec, spec, layers }).is_some() {
                    return Err(corrupt(format!("context {} created twice", r.context)));
                }
                state.next_context_id = state.next_context_id.max(r.context + 1);
                state.replayed.creates += 1;
            }
            RecordKind::AppendKv => {
                let r: AppendRecord = decode(&record.payload).map_err(bad_payload)?;
                state.replayed.appends += 1;
                let Some(ctx) = state.contexts.get_mut(&r.context) else {
                    if dropped_later.contains(&r.context) {
                        state.skipped_appends += 1;
                        continue;
                    }
                    return Err(corrupt(format!("append to context {} which does not exist", r.context)));
                };
                let layers = ctx.layers.len();
                let Some(layer) = ctx.layers.get_mut(r.layer as usize) else {
                    return Err(corrupt(format!(
                        "append to layer {} of context {} which has {layers}",
                        r.layer, r.context
                    )));
                };
                if r.offset != layer.committed_bytes {
                    return Err(corrupt(format!(
                        "append to context {} layer {}: expected its chunk at data offset {}, record says {}",
                        r.context, r.layer, layer.committed_bytes, r.offset
                    )));
                }
                layer.committed_bytes += r.chunk_bytes;
                layer.tokens += r.tokens;
                layer.chunks += 1;
                state.logged_crcs.insert((r.context, r.layer as usize, r.offset), r.payload_crc);
            }
            RecordKind::DropContext => {
                let r: DropContextRecord = decode(&record.payload).map_err(bad_payload)?;
                if state.contexts.remove(&r.context).is_none() {
                    return Err(corrupt(format!("drop of context {} which does not exist", r.context)));
                }
                state.replayed.drops += 1;
            }
            RecordKind::Checkpoint => state.replayed.checkpoints += 1,
            RecordKind::SegmentBuilt => {
                return Err(corrupt("SegmentBuilt records are not written by this version".into()));
            }
        }
    }
    state.replay = replay;
    let contexts = &state.contexts;
    state.homes.retain(|(c, l), _| contexts.get(c).is_some_and(|ctx| *l < ctx.layers.len()));
    Ok(state)
}

/// Where reading a layer's data file starts: a byte offset on a chunk boundary, and the
/// tokens and chunks before it (held by a 2-bit home).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Start {
    pub offset: u64,
    pub tokens: u64,
    pub chunks: u64,
}

/// Reads and verifies the committed chunks of one layer from `start`, cross-checking the
/// payload crc of every chunk the replayed log named, and the token count.
pub(super) fn read_layer(
    dir: &EngineDir,
    state: &State,
    (context, layer): (u64, usize),
    start: Start,
    mut sink: impl FnMut(StoredBatch) -> Result<()>,
) -> Result<(u64, u64)> {
    let ctx = &state.contexts[&context];
    let committed = ctx.layers[layer];
    let path = data_path(dir, context, layer);
    let row = ctx.spec.shape.kv_heads * ctx.spec.shape.head_dim;
    let owner = ChunkOwner { dir_id: dir.id, context, layer: layer as u32 };
    let mut reader =
        ChunkReader::open(&path, owner, committed.committed_bytes, ctx.spec.dtype, row)?.starting_at(start.offset);
    let (mut tokens, mut chunks) = (start.tokens, start.chunks);
    while let Some(batch) = reader.next_chunk()? {
        if let Some(&logged) = state.logged_crcs.get(&(context, layer, batch.offset)) {
            if logged != batch.payload_crc {
                return Err(Error::Corrupt {
                    file: path,
                    offset: batch.offset,
                    detail: format!(
                        "chunk payload crc {:#010x}, the log record committed {logged:#010x}",
                        batch.payload_crc
                    ),
                });
            }
        }
        tokens += batch.tokens as u64;
        chunks += 1;
        sink(batch)?;
    }
    if (tokens, chunks) != (committed.tokens, committed.chunks) {
        return Err(Error::Corrupt {
            file: path,
            offset: committed.committed_bytes,
            detail: format!(
                "expected {} tokens in {} chunks, the data file holds {tokens} in {chunks}",
                committed.tokens, committed.chunks
            ),
        });
    }
    Ok((tokens, committed.committed_bytes - start.offset))
}

/// The encoded home of a `hack2` or `kv43` wave or PQ layer, when it has one that fits its
/// committed data (a PQ home with its codebooks, read from the layer's layout file):
/// `Ok(None)` when it has none (or one not to rely on, reason pushed to `unusable`), an
/// error when the manifest relies on a home that is missing or does not fit (the data file
/// no longer holds those tokens).
pub(super) fn usable_home(
    dir: &EngineDir,
    state: &State,
    (context, layer): (u64, usize),
    unusable: &mut Vec<String>,
) -> Result<Option<super::home::LoadedHome>> {
    let ctx = &state.contexts[&context];
    // hack2 and kv43 wave and PQ layers have encoded homes.
    let codec = attnstore_index::RowCodec::of(ctx.spec.codec_of(layer));
    let (true, Method::Wave(_) | Method::Pq(_), LayerKind::Global) =
        (codec.is_encoded(), ctx.spec.method, ctx.spec.layers[layer])
    else {
        return Ok(None);
    };
    let pq = matches!(ctx.spec.method, Method::Pq(_));
    let relied_on = state.homes.get(&(context, layer)).copied().unwrap_or(0);
    let committed = ctx.layers[layer];
    let shape = (ctx.spec.shape.kv_heads, ctx.spec.shape.head_dim);
    let why = match read_home(dir, context, layer, shape, codec) {
        Ok(Some(mut h)) => {
            let fits = h.data_bytes >= relied_on
                && h.data_bytes <= committed.committed_bytes
                && h.tokens <= committed.tokens
                && h.chunks <= committed.chunks;
            if !fits {
                format!(
                    "home of context {context} layer {layer}: covers {} data bytes ({} tokens, {} chunks), the layer has {} committed ({} tokens, {} chunks) and the manifest relies on {relied_on}",
                    h.data_bytes, h.tokens, h.chunks, committed.committed_bytes, committed.tokens, committed.chunks
                )
            } else if !pq {
                return Ok(Some(h));
            } else {
                // A PQ home holds rows; its codebooks and codes are the layer's layout.
                match super::layout::read_layout(dir, context, layer, "pq") {
                    Ok(Some(attnstore_index::IndexLayout::Pq(snapshot))) => {
                        h.home.pq = Some(snapshot);
                        return Ok(Some(h));
                    }
                    Ok(_) => format!(
                        "home of context {context} layer {layer}: its codebooks ({}) are missing",
                        dir.join(super::layout::INDEX_DIR)
                            .join(super::layout::layout_name(context, layer, "pq").unwrap_or_default())
                            .display()
                    ),
                    Err(why) => format!("home of context {context} layer {layer}: its codebooks: {why}"),
                }
            }
        }
        Ok(None) if relied_on == 0 => return Ok(None),
        Ok(None) => format!("home of context {context} layer {layer}: missing"),
        Err(why) => why,
    };
    if relied_on == 0 {
        unusable.push(why);
        return Ok(None);
    }
    Err(home_lost(dir, (context, layer), relied_on, &why))
}

/// The error of a home the manifest relies on (its first `relied_on` data bytes may be
/// punched out) that cannot be used, and `why`.
pub(super) fn home_lost(dir: &Path, (context, layer): (u64, usize), relied_on: u64, why: &str) -> Error {
    Error::Corrupt {
        file: dir.join(super::layout::INDEX_DIR).join(super::home::home_name(context, layer)),
        offset: 0,
        detail: format!("{why}; the manifest says its first {relied_on} data bytes live only there"),
    }
}

pub(super) fn data_files(dir: &Path) -> Result<Vec<(u64, usize, PathBuf)>> {
    let data_dir = dir.join(DATA_DIR);
    let mut files = Vec::new();
    let entries = match std::fs::read_dir(&data_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(files),
        Err(e) => return Err(attnstore_wal::Error::io("list", &data_dir, &e).into()),
    };
    for entry in entries {
        let entry = entry.map_err(|e| attnstore_wal::Error::io("list", &data_dir, &e))?;
        if let Some((context, layer)) = entry.file_name().to_str().and_then(parse_data_file_name) {
            files.push((context, layer, entry.path()));
        }
    }
    files.sort();
    Ok(files)
}

pub(super) fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |e| attnstore_wal::Error::io(op, path, &e).into()
}

/// Checks that `DIR/LOCK`, if there, is a regular file (not a link, a directory or a device).
pub(super) fn check_lock_file(dir: &Path) -> Result<()> {
    let path = dir.join(LOCK_FILE);
    match std::fs::symlink_metadata(&path) {
        Ok(meta) if !meta.file_type().is_file() => {
            let found = if meta.file_type().is_symlink() { "a symbolic link" } else { "not a regular file" };
            Err(attnstore_wal::Error::NotRegularFile { path, found: found.into() }.into())
        }
        _ => Ok(()),
    }
}

/// Takes an exclusive `flock` on `DIR/LOCK`, held as long as the returned file is open
/// (the OS releases it when the process dies, so a crash never leaves it behind). The lock
/// file must be a regular file: a link or anything else there is refused, not followed.
pub(super) fn lock_directory(dir: &Path) -> Result<std::fs::File> {
    check_lock_file(dir)?;
    let path = dir.join(LOCK_FILE);
    let file =
        std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path).map_err(io("open", &path))?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(file),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(Error::DirectoryLocked { dir: dir.to_path_buf(), lock: path }),
        Err(errno) => Err(io("lock", &path)(errno.into())),
    }
}
