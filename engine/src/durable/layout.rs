//! Checkpointed index layouts: at a checkpoint, what recovery needs to restore each indexed
//! layer without training it again is written to `DIR/index/`, framed and checksummed like
//! the manifest and replaced atomically:
//! - wave layers, `ctx-<id>-layer-<l>.layout`: which tokens form each segment, each
//!   cluster's size and its token positions ([`WaveLayout`]); no k-means on reopen;
//! - PQ layers, `ctx-<id>-layer-<l>.pq`: the codebooks and the base region's codes
//!   ([`PqSnapshot`]); no codebook training on reopen.
//!
//! Recovery restores those layers from the KV it reads back and indexes only the tokens
//! the file does not cover. A layout file is an optimization: one that is missing, corrupt
//! or does not fit the data is reported and the layer is rebuilt from its KV, never served
//! wrong.

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use attnstore_index::{HeadLayout, IndexLayout, PqSnapshot, SegmentLayout, WaveLayout};
use attnstore_wal::{read_manifest, write_manifest, Storage, MAX_RECORD_BYTES};
use serde::{Deserialize, Serialize};

use super::identity::EngineDir;
use super::records::{decode, encode};
use crate::error::Result;

/// Sub-directory of the checkpointed index layouts and of the 2-bit homes of `hack2` layers.
pub const INDEX_DIR: &str = "index";

/// Access methods with layout files, and the suffix of each one's files.
const SUFFIXES: [(&str, &str); 2] = [("wave", "layout"), ("pq", "pq")];

/// File name of the layout of (`context`, `layer`) for access method `method` (`"wave"`,
/// `"pq"`); `None` for methods without layout files.
pub(crate) fn layout_name(context: u64, layer: usize, method: &str) -> Option<String> {
    let (_, suffix) = SUFFIXES.iter().find(|(m, _)| *m == method)?;
    Some(format!("ctx-{context}-layer-{layer}.{suffix}"))
}

/// A [`WaveLayout`] on disk, with the (context, layer) it belongs to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct LayoutRecord {
    context: u64,
    layer: u32,
    tokens: u64,
    sink_len: u64,
    tail_start: u64,
    segments: Vec<SegmentRecord>,
}

/// One head's clusters on disk: sizes, positions in cluster order.
type HeadRecord = (Vec<u32>, Vec<u32>);
/// One segment on disk: first token, tokens, heads.
type SegmentRecord = (u64, u64, Vec<HeadRecord>);

impl LayoutRecord {
    pub(crate) fn new(context: u64, layer: usize, l: &WaveLayout) -> Self {
        Self {
            context,
            layer: layer as u32,
            tokens: l.tokens,
            sink_len: l.sink_len,
            tail_start: l.tail_start,
            segments: l
                .segments
                .iter()
                .map(|s| (s.first, s.len, s.heads.iter().map(|h| (h.sizes.clone(), h.positions.clone())).collect()))
                .collect(),
        }
    }

    pub(crate) fn layout(self) -> WaveLayout {
        WaveLayout {
            tokens: self.tokens,
            sink_len: self.sink_len,
            tail_start: self.tail_start,
            segments: self
                .segments
                .into_iter()
                .map(|(first, len, heads)| SegmentLayout {
                    first,
                    len,
                    heads: heads.into_iter().map(|(sizes, positions)| HeadLayout { sizes, positions }).collect(),
                })
                .collect(),
        }
    }
}

/// A [`PqSnapshot`] on disk, with the (context, layer) it belongs to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct PqRecord {
    context: u64,
    layer: u32,
    tokens: u64,
    subspaces: u32,
    bits: u32,
    codes: u32,
    start: u64,
    end: u64,
    train_rows: u64,
    iters_limit: u32,
    iters_run: u32,
    converged_jobs: u32,
    codebooks: Vec<Vec<f32>>,
    packed: Vec<Vec<u8>>,
}

impl PqRecord {
    pub(crate) fn new(context: u64, layer: usize, s: &PqSnapshot) -> Self {
        Self {
            context,
            layer: layer as u32,
            tokens: s.tokens,
            subspaces: s.subspaces,
            bits: s.bits,
            codes: s.codes,
            start: s.start,
            end: s.end,
            train_rows: s.train_rows,
            iters_limit: s.iters_limit,
            iters_run: s.iters_run,
            converged_jobs: s.converged_jobs,
            codebooks: s.codebooks.clone(),
            packed: s.packed.clone(),
        }
    }

    pub(crate) fn snapshot(self) -> PqSnapshot {
        PqSnapshot {
            tokens: self.tokens,
            subspaces: self.subspaces,
            bits: self.bits,
            codes: self.codes,
            start: self.start,
            end: self.end,
            train_rows: self.train_rows,
            iters_limit: self.iters_limit,
            iters_run: self.iters_run,
            converged_jobs: self.converged_jobs,
            codebooks: self.codebooks,
            packed: self.packed,
        }
    }
}

/// Writes the layout of (`context`, `layer`) atomically (write new, fsync, rename, fsync
/// dir); returns its payload size, or `None` when the payload is larger than one record may
/// be (the layer is then rebuilt from its KV on reopen, as without a checkpoint).
pub(crate) fn write_layout(
    storage: &dyn Storage,
    dir: &EngineDir,
    context: u64,
    layer: usize,
    layout: &IndexLayout,
) -> Result<Option<usize>> {
    let payload = match layout {
        IndexLayout::Wave(l) => encode(&LayoutRecord::new(context, layer, l)),
        IndexLayout::Pq(s) => encode(&PqRecord::new(context, layer, s)),
    };
    if payload.len() > MAX_RECORD_BYTES as usize {
        return Ok(None);
    }
    let name = layout_name(context, layer, layout.method()).expect("every IndexLayout kind has a suffix");
    write_manifest(storage, &dir.join(INDEX_DIR), &name, dir.index_file(&name), &payload)?;
    Ok(Some(payload.len()))
}

/// The layout of (`context`, `layer`) of access method `method`: `Ok(None)` when there is
/// none, `Err(why)` when the file is unusable (bad frame or checksum, does not decode,
/// belongs to another layer).
pub(crate) fn read_layout(
    dir: &EngineDir,
    context: u64,
    layer: usize,
    method: &str,
) -> std::result::Result<Option<IndexLayout>, String> {
    let Some(name) = layout_name(context, layer, method) else { return Ok(None) };
    let index_dir = dir.join(INDEX_DIR);
    let path = index_dir.join(&name);
    let payload = match read_manifest(&index_dir, &name, dir.index_file(&name)) {
        Ok(Some(p)) => p,
        Ok(None) => return Ok(None),
        Err(e) => return Err(super::named(&path, &e)),
    };
    let undecodable = |e: String| format!("{}: does not decode: {e}", path.display());
    let (owner, layout) = match method {
        "pq" => {
            let r: PqRecord = decode(&payload).map_err(undecodable)?;
            ((r.context, r.layer), IndexLayout::Pq(r.snapshot()))
        }
        _ => {
            let r: LayoutRecord = decode(&payload).map_err(undecodable)?;
            ((r.context, r.layer), IndexLayout::Wave(r.layout()))
        }
    };
    if owner != (context, layer as u32) {
        return Err(format!(
            "{}: holds the layout of context {} layer {}, not context {context} layer {layer}",
            path.display(),
            owner.0,
            owner.1
        ));
    }
    Ok(Some(layout))
}

/// Deletes layout and 2-bit home files of (context, layer) pairs not in `live`, and leftover
/// `.tmp` files; returns their paths.
pub(crate) fn remove_stale(dir: &Path, live: &BTreeSet<(u64, usize)>) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir.join(INDEX_DIR)) else { return removed };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        // Layouts, and the 2-bit homes' files (`home.rs`): `….home` and `…-seg-<u>.h2`.
        let parsed = name
            .strip_prefix("ctx-")
            .and_then(|r| r.rsplit_once('.'))
            .and_then(|(r, suffix)| match suffix {
                super::home::SEGMENT_SUFFIX => r.rsplit_once("-seg-").map(|(r, _)| r),
                super::home::HOME_SUFFIX => Some(r),
                _ => SUFFIXES.iter().any(|(_, s)| *s == suffix).then_some(r),
            })
            .and_then(|r| r.split_once("-layer-"))
            .and_then(|(c, l)| Some((c.parse::<u64>().ok()?, l.parse::<usize>().ok()?)));
        let stale = match parsed {
            Some(key) => !live.contains(&key),
            None => name.ends_with(".tmp"),
        };
        if stale && std::fs::remove_file(entry.path()).is_ok() {
            removed.push(entry.path());
        }
    }
    removed
}

/// Keys and values of a layout's tokens (`kv_heads × tokens × head_dim` each) and the number
/// of batches they span.
pub(crate) type Prefix<'a> = (Cow<'a, [f32]>, Cow<'a, [f32]>, usize);

/// The KV of the first `tokens` tokens of `batches` (each `kv_heads × n × head_dim`) as one
/// `kv_heads × tokens × head_dim` pair, and how many batches that is; `None` when `tokens`
/// does not end on a batch boundary (a layout is taken between batches, so that layout does
/// not belong to this data). A single batch (a prefill, the usual case) is lent, not copied.
pub(crate) fn split_at(batches: &[super::StoredBatch], tokens: u64, kv_heads: usize) -> Option<Prefix<'_>> {
    let mut covered = 0u64;
    let mut cut = None;
    for (i, b) in batches.iter().enumerate() {
        if covered == tokens {
            cut = Some(i);
            break;
        }
        covered += b.tokens as u64;
    }
    if cut.is_none() && covered == tokens {
        cut = Some(batches.len());
    }
    let cut = cut?;
    let batches = &batches[..cut];
    if let [one] = batches {
        return Some((Cow::Borrowed(&one.keys[..]), Cow::Borrowed(&one.values[..]), 1));
    }
    let head = |pick: &dyn Fn(&super::StoredBatch) -> &[f32]| -> Vec<f32> {
        let mut out = Vec::with_capacity(batches.iter().map(|b| pick(b).len()).sum());
        for h in 0..kv_heads {
            for b in batches {
                let per_head = pick(b).len() / kv_heads.max(1);
                out.extend_from_slice(&pick(b)[h * per_head..(h + 1) * per_head]);
            }
        }
        out
    };
    let keys = head(&|b| &b.keys);
    let values = head(&|b| &b.values);
    Some((Cow::Owned(keys), Cow::Owned(values), cut))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::durable::fuzz::tests::{pq_snapshot, wave_layout};
    use attnstore_wal::StdStorage;

    #[test]
    fn a_layout_round_trips_and_a_flipped_bit_or_a_foreign_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(INDEX_DIR)).unwrap();
        let layout = IndexLayout::Wave(wave_layout());
        let pq = IndexLayout::Pq(pq_snapshot());
        write_layout(&StdStorage, &EngineDir::new(dir.path(), 9), 3, 1, &layout).unwrap().unwrap();
        write_layout(&StdStorage, &EngineDir::new(dir.path(), 9), 3, 2, &pq).unwrap().unwrap();
        assert_eq!(read_layout(&EngineDir::new(dir.path(), 9), 3, 1, "wave").unwrap(), Some(layout.clone()));
        assert_eq!(read_layout(&EngineDir::new(dir.path(), 9), 3, 2, "pq").unwrap(), Some(pq.clone()));
        assert_eq!(read_layout(&EngineDir::new(dir.path(), 9), 3, 2, "wave").unwrap(), None);
        assert_eq!(read_layout(&EngineDir::new(dir.path(), 9), 3, 1, "flat").unwrap(), None);
        // Another layer's file under this name is refused.
        let index = dir.path().join(INDEX_DIR);
        let name = |c, l, m| layout_name(c, l, m).unwrap();
        std::fs::copy(index.join(name(3, 1, "wave")), index.join(name(4, 0, "wave"))).unwrap();
        let why = read_layout(&EngineDir::new(dir.path(), 9), 4, 0, "wave").unwrap_err();
        assert!(why.contains("another place"), "{why}");
        std::fs::copy(index.join(name(3, 2, "pq")), index.join(name(4, 0, "pq"))).unwrap();
        let why = read_layout(&EngineDir::new(dir.path(), 9), 4, 0, "pq").unwrap_err();
        assert!(why.contains("another place"), "{why}");
        // Another engine directory's file in its place is refused too.
        assert!(read_layout(&EngineDir::new(dir.path(), 10), 3, 1, "wave")
            .unwrap_err()
            .contains("another engine directory"));
        // A flipped bit is refused.
        for (layer, method) in [(1, "wave"), (2, "pq")] {
            let path = index.join(name(3, layer, method));
            let mut bytes = std::fs::read(&path).unwrap();
            let last = bytes.len() - 3;
            bytes[last] ^= 1;
            std::fs::write(&path, bytes).unwrap();
            assert!(read_layout(&EngineDir::new(dir.path(), 9), 3, layer, method).is_err(), "{method}");
        }
        // Stale files go, of both kinds; files that are not layouts stay.
        std::fs::write(index.join("notes.txt"), b"keep").unwrap();
        let mut removed = remove_stale(dir.path(), &BTreeSet::from([(3, 1), (3, 2)]));
        removed.sort();
        assert_eq!(removed, vec![index.join(name(4, 0, "wave")), index.join(name(4, 0, "pq"))]);
        assert!(index.join("notes.txt").exists());
    }
}
