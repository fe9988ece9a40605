//! Checkpointed index layouts: at a checkpoint, the structure of every wave layer (which
//! tokens form each segment, each cluster's size and its token positions; `WaveLayout`) is
//! written to `DIR/index/ctx-<id>-layer-<l>.layout` (framed and checksummed like the
//! manifest, replaced atomically). Recovery then restores those layers from the KV it reads
//! back without running k-means, and clusters only the tokens the layout does not cover.
//! A layout file is an optimization: one that is missing, corrupt or does not fit the data
//! is reported and the layer is rebuilt from its KV, never served wrong.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use attnstore_index::{HeadLayout, SegmentLayout, WaveLayout};
use attnstore_wal::{read_manifest, write_manifest, Storage};
use serde::{Deserialize, Serialize};

use super::records::{decode, encode};
use crate::error::Result;

/// Sub-directory of the layout files.
pub const INDEX_DIR: &str = "index";

/// File name of the layout of (`context`, `layer`).
pub(crate) fn layout_name(context: u64, layer: usize) -> String {
    format!("ctx-{context}-layer-{layer}.layout")
}

/// A [`WaveLayout`] on disk, with the (context, layer) it belongs to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct LayoutRecord {
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
    fn new(context: u64, layer: usize, l: &WaveLayout) -> Self {
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

    fn layout(self) -> WaveLayout {
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

/// Writes the layout of (`context`, `layer`) atomically (write new, fsync, rename, fsync
/// dir); returns its payload size.
pub(crate) fn write_layout(
    storage: &dyn Storage,
    dir: &Path,
    context: u64,
    layer: usize,
    layout: &WaveLayout,
) -> Result<usize> {
    let payload = encode(&LayoutRecord::new(context, layer, layout));
    write_manifest(storage, &dir.join(INDEX_DIR), &layout_name(context, layer), &payload)?;
    Ok(payload.len())
}

/// The layout of (`context`, `layer`): `Ok(None)` when there is none, `Err(why)` when the
/// file is unusable (bad frame or checksum, does not decode, belongs to another layer).
pub(crate) fn read_layout(dir: &Path, context: u64, layer: usize) -> std::result::Result<Option<WaveLayout>, String> {
    let index_dir = dir.join(INDEX_DIR);
    let name = layout_name(context, layer);
    let path = index_dir.join(&name);
    let payload = match read_manifest(&index_dir, &name) {
        Ok(Some(p)) => p,
        Ok(None) => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let record: LayoutRecord = decode(&payload).map_err(|e| format!("{}: does not decode: {e}", path.display()))?;
    if record.context != context || record.layer as usize != layer {
        return Err(format!(
            "{}: holds the layout of context {} layer {}, not context {context} layer {layer}",
            path.display(),
            record.context,
            record.layer
        ));
    }
    Ok(Some(record.layout()))
}

/// Deletes layout files of (context, layer) pairs not in `live`; returns their paths.
pub(crate) fn remove_stale(dir: &Path, live: &BTreeSet<(u64, usize)>) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir.join(INDEX_DIR)) else { return removed };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let parsed = name
            .strip_prefix("ctx-")
            .and_then(|r| r.strip_suffix(".layout"))
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

/// The KV of the first `tokens` tokens of `batches` (each `kv_heads × n × head_dim`) as one
/// `kv_heads × tokens × head_dim` pair, and how many batches that is; `None` when `tokens`
/// does not end on a batch boundary (a layout is taken between batches, so that layout does
/// not belong to this data).
pub(crate) fn split_at(
    batches: &[super::StoredBatch],
    tokens: u64,
    kv_heads: usize,
) -> Option<(Vec<f32>, Vec<f32>, usize)> {
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
    Some((keys, values, cut))
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnstore_wal::StdStorage;

    #[test]
    fn a_layout_round_trips_and_a_flipped_bit_or_a_foreign_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(INDEX_DIR)).unwrap();
        let layout = WaveLayout {
            tokens: 30,
            sink_len: 4,
            tail_start: 10,
            segments: vec![SegmentLayout {
                first: 4,
                len: 6,
                heads: vec![HeadLayout { sizes: vec![2, 4], positions: vec![5, 9, 4, 6, 7, 8] }],
            }],
        };
        write_layout(&StdStorage, dir.path(), 3, 1, &layout).unwrap();
        assert_eq!(read_layout(dir.path(), 3, 1).unwrap(), Some(layout.clone()));
        assert_eq!(read_layout(dir.path(), 3, 2).unwrap(), None);
        // Another layer's file under this name is refused.
        let index = dir.path().join(INDEX_DIR);
        std::fs::copy(index.join(layout_name(3, 1)), index.join(layout_name(4, 0))).unwrap();
        assert!(read_layout(dir.path(), 4, 0).unwrap_err().contains("not context 4"));
        // A flipped bit is refused.
        let path = index.join(layout_name(3, 1));
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 3;
        bytes[last] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        assert!(read_layout(dir.path(), 3, 1).is_err());
        // Stale files go.
        let removed = remove_stale(dir.path(), &BTreeSet::from([(3, 1)]));
        assert_eq!(removed, vec![index.join(layout_name(4, 0))]);
    }
}
