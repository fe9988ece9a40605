//! `attnstore check`: a durable engine's directory verified read-only, without opening it
//! (no lock, no repair): the manifest and log decoded into the committed catalog as
//! recovery would ([`read_state`]), then every committed chunk read with its checksums.

use std::fmt;
use std::path::{Path, PathBuf};

use attnstore_wal::{LogFileSummary, Lsn, RecoveryMode, TornTail};

use super::data_path;
use super::identity::EngineDir;
use super::recovery::{check_lock_file, data_files, read_layer, read_state, usable_home, RecordCounts, Start};
use crate::error::Result;
use crate::spec::LayerKind;

/// One layer as [`check`] found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerCheck {
    /// The context.
    pub context: u64,
    /// The layer.
    pub layer: usize,
    /// Its data file.
    pub file: PathBuf,
    /// Committed chunks, all verified.
    pub chunks: u64,
    /// Committed tokens.
    pub tokens: u64,
    /// Committed bytes.
    pub committed_bytes: u64,
    /// Bytes after the committed end (an append whose record never committed).
    pub uncommitted_bytes: u64,
    /// Leading data bytes whose tokens a `hack2` or `kv43` layer's encoded home holds (its segment files
    /// verified instead of those chunks); 0 without a home.
    pub homed_bytes: u64,
    /// Segment files of that home, all verified.
    pub home_segments: usize,
}

/// What [`check`] found in a directory: everything verified, nothing changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckReport {
    /// Generation of the manifest, if any.
    pub manifest_generation: Option<u64>,
    /// LSN replay would start at.
    pub wal_start_lsn: Lsn,
    /// Log files read.
    pub log_files: Vec<LogFileSummary>,
    /// Records after the checkpoint, per kind.
    pub records: RecordCounts,
    /// A torn tail recovery would cut.
    pub torn_tail: Option<TornTail>,
    /// Contexts and their specs, in words.
    pub contexts: Vec<(u64, String)>,
    /// Every layer with data.
    pub layers: Vec<LayerCheck>,
    /// Data files of contexts that do not exist.
    pub orphan_data_files: Vec<PathBuf>,
    /// Damage that costs no committed data (an index layout or a 2-bit home that recovery
    /// would not use and rebuild from the KV instead), each naming its file.
    pub problems: Vec<String>,
}

impl CheckReport {
    /// Whether everything checked is intact.
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Verifies every checksum in an engine directory (its identity, the manifest, every log
/// record, every committed chunk, the 2-bit homes and segments, the index layouts) without
/// changing anything. Damage that opening would fail on is that typed error; damage that
/// opening repairs by rebuilding is listed in [`CheckReport::problems`].
pub fn check(dir: &Path) -> Result<CheckReport> {
    // Not `create`: a directory that is not an engine directory is refused, never made one.
    let engine_dir = EngineDir::open(&attnstore_wal::StdStorage, dir, false)?;
    check_lock_file(dir)?;
    let dir = &engine_dir;
    let state = read_state(dir, RecoveryMode::Strict)?;
    let mut layers = Vec::new();
    let mut problems = Vec::new();
    for (&context, ctx) in &state.contexts {
        for (layer, committed) in ctx.layers.iter().enumerate() {
            let file = data_path(dir, context, layer);
            let on_disk = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
            let home = match committed.committed_bytes {
                0 => None,
                _ => usable_home(dir, &state, (context, layer), &mut problems)?,
            };
            // Index layouts are read and decoded as recovery would; an unusable one costs a
            // rebuild from the KV, never data, but it is damage all the same.
            if ctx.spec.layers[layer] == LayerKind::Global && home.is_none() {
                if let Err(why) = super::layout::read_layout(dir, context, layer, ctx.spec.method.name()) {
                    problems.push(format!("index layout unusable (recovery rebuilds it from the KV): {why}"));
                }
            }
            let (start, home_segments) = home.map_or((Start::default(), 0), |h| {
                (Start { offset: h.data_bytes, tokens: h.tokens, chunks: h.chunks }, h.home.segments.len())
            });
            if committed.committed_bytes > 0 {
                read_layer(dir, &state, (context, layer), start, |_| Ok(()))?;
            }
            layers.push(LayerCheck {
                context,
                layer,
                file,
                chunks: committed.chunks,
                tokens: committed.tokens,
                committed_bytes: committed.committed_bytes,
                uncommitted_bytes: on_disk.saturating_sub(committed.committed_bytes),
                homed_bytes: start.offset,
                home_segments,
            });
        }
    }
    let orphan_data_files =
        data_files(dir)?.into_iter().filter(|(c, _, _)| !state.contexts.contains_key(c)).map(|(_, _, p)| p).collect();
    Ok(CheckReport {
        manifest_generation: state.manifest_generation,
        wal_start_lsn: state.wal_start_lsn,
        log_files: state.replay.files.clone(),
        records: state.replayed,
        torn_tail: state.replay.torn.clone(),
        contexts: state
            .contexts
            .iter()
            .map(|(&c, ctx)| {
                let s = &ctx.spec;
                let words = format!(
                    "{} q heads / {} kv heads, d={}, {} layers, codec {}, {}",
                    s.shape.q_heads,
                    s.shape.kv_heads,
                    s.shape.head_dim,
                    s.layers.len(),
                    s.layer_codecs(),
                    s.method.name()
                );
                (c, words)
            })
            .collect(),
        layers,
        orphan_data_files,
        problems,
    })
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.manifest_generation {
            Some(g) => writeln!(f, "manifest: generation {g}, log replays from lsn {}", self.wal_start_lsn)?,
            None => writeln!(f, "manifest: none (no checkpoint yet), log replays from lsn {}", self.wal_start_lsn)?,
        }
        for l in &self.log_files {
            writeln!(
                f,
                "log {}: first lsn {}, {} records, {} bytes, ok",
                l.path.display(),
                l.first_lsn,
                l.records,
                l.bytes
            )?;
        }
        let r = self.records;
        writeln!(
            f,
            "records after the checkpoint: {} creates, {} appends, {} drops, {} checkpoints",
            r.creates, r.appends, r.drops, r.checkpoints
        )?;
        if let Some(t) = &self.torn_tail {
            writeln!(
                f,
                "torn tail: {} at offset {} ({} bytes would be cut by recovery)",
                t.file.display(),
                t.valid_up_to,
                t.file_bytes - t.valid_up_to
            )?;
        }
        for (c, words) in &self.contexts {
            writeln!(f, "context {c}: {words}")?;
        }
        for l in &self.layers {
            write!(
                f,
                "  context {} layer {}: {} tokens in {} chunks, {} bytes, checksums ok",
                l.context, l.layer, l.tokens, l.chunks, l.committed_bytes
            )?;
            if l.homed_bytes > 0 {
                write!(
                    f,
                    "; the first {} bytes' tokens in an encoded home of {} segment files, ok",
                    l.homed_bytes, l.home_segments
                )?;
            }
            if l.uncommitted_bytes > 0 {
                write!(f, " (+{} uncommitted bytes recovery would cut)", l.uncommitted_bytes)?;
            }
            writeln!(f)?;
        }
        for p in &self.orphan_data_files {
            writeln!(f, "orphan data file (context gone): {}", p.display())?;
        }
        for p in &self.problems {
            writeln!(f, "DAMAGE: {p}")?;
        }
        match self.problems.len() {
            0 => write!(f, "ok"),
            n => write!(f, "damaged: {n} problems (no committed data is lost; recovery rebuilds what is listed)"),
        }
    }
}
