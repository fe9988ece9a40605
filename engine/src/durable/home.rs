//! The on-disk home of `hack2` and `kv43` wave and PQ layers: 2-bit segment files (kv43
//! records: `home_kv43.rs`).
//!
//! A `hack2` or `kv43` wave index encodes each segment once, when it is built, and drops its
//! plain rows; a `hack2` or `kv43` PQ index encodes its base rows once, when its codebook
//! build starts (`docs/codec.md`). Until a checkpoint the data file's f16 chunks are the
//! only durable copy of those tokens. At a checkpoint the layer's **encoded home** is written to
//! `DIR/index/`, each file framed and checksummed like the manifest and replaced atomically:
//!
//! - `ctx-<id>-layer-<l>-seg-<u>.h2`, one per segment, written once (segments never change):
//!   per KV head the cluster sizes, token positions, the clusters' mean keys and values (f16)
//!   and the 2-bit rows (codes, per-partition minima, scales and code sums, value blocks);
//!   with per-channel keys (`hack2c`) the same record is followed by, per KV head, the keys'
//!   f16 minimum and range per value block and channel (per-token files are unchanged);
//! - `ctx-<id>-layer-<l>.home`, replaced at every checkpoint that moved the layer: the data
//!   file bytes, chunks and tokens it covers, the sink and tail rows the index keeps in f16,
//!   and the crc32c of every segment file's payload, so a home never pairs with a segment
//!   file it was not written with.
//!
//! A PQ layer's segments are its base rows past the sink in pieces of 128 value blocks, or
//! of whole kv43 key groups (8192 rows at 128-token groups; the last piece ends in the
//! base's partial key group, in f16), with no clusters (sizes, positions and means empty),
//! its tail rows every token after the base (decode tokens stay f16), and its codebooks and
//! codes are its layout file (`ctx-<id>-layer-<l>.pq`), written in the same checkpoint
//! before the home; a home is not written while that layout is not on disk, and recovery
//! needs both.
//!
//! Once the manifest records the covered bytes, the data file's range before them is
//! punched out (`fallocate(PUNCH_HOLE)`): on disk the layer is its 2-bit segments, its f16
//! steady rows and the f16 chunks appended since. Recovery restores the index from the
//! home with nothing recomputed and replays only the chunks after it. Because the punched
//! bytes are gone, a home the manifest relies on that is missing or damaged is a typed
//! `Corrupt` error, never a silent rebuild.

use std::path::Path;

use attnstore_index::{EncodedHead, EncodedHome, EncodedRows, EncodedSegment, RowCodec, SteadyHead};
use attnstore_kernels::{HackArrays, HackParams, HackRows};
use attnstore_wal::{read_manifest, write_manifest, Storage, MAX_RECORD_BYTES};
use half::f16;
use serde::{Deserialize, Serialize};

use super::home_kv43::{Kv43HeadRecord, Kv43SegmentRecord};
use super::identity::EngineDir;
use super::layout::INDEX_DIR;
use super::records::{decode, encode};
use crate::error::Result;

/// Suffix of a layer's home file.
pub(crate) const HOME_SUFFIX: &str = "home";
/// Suffix of a segment file.
pub(crate) const SEGMENT_SUFFIX: &str = "h2";

/// File name of the home of (`context`, `layer`).
pub(crate) fn home_name(context: u64, layer: usize) -> String {
    format!("ctx-{context}-layer-{layer}.{HOME_SUFFIX}")
}

/// File name of segment `unit` of (`context`, `layer`).
pub(crate) fn segment_name(context: u64, layer: usize, unit: usize) -> String {
    format!("ctx-{context}-layer-{layer}-seg-{unit}.{SEGMENT_SUFFIX}")
}

/// A layer's home on disk: what it covers, its plain rows and its segments' checksums.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct HomeRecord {
    context: u64,
    layer: u32,
    /// Data file bytes (whole chunks from offset 0) whose tokens the home holds.
    data_bytes: u64,
    chunks: u64,
    tokens: u64,
    sink_len: u64,
    tail_start: u64,
    /// crc32c of each segment file's payload, in order.
    segments: Vec<u32>,
    /// Per KV head: sink keys, sink values, tail keys, tail values (f16, little-endian).
    steady: Vec<SteadyRecord>,
}

/// One KV head's plain rows in a home (byte strings: one copy when read, not one call per
/// byte).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct SteadyRecord {
    #[serde(with = "serde_bytes")]
    sink_keys: Vec<u8>,
    #[serde(with = "serde_bytes")]
    sink_values: Vec<u8>,
    #[serde(with = "serde_bytes")]
    tail_keys: Vec<u8>,
    #[serde(with = "serde_bytes")]
    tail_values: Vec<u8>,
}

/// One segment file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct SegmentRecord {
    context: u64,
    layer: u32,
    unit: u32,
    first: u64,
    len: u64,
    head_dim: u32,
    partition: u32,
    heads: Vec<HeadRecord>,
}

/// One KV head of a segment file; arrays little-endian.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct HeadRecord {
    sizes: Vec<u32>,
    /// u32 token positions.
    #[serde(with = "serde_bytes")]
    positions: Vec<u8>,
    /// f16 mean keys and values, `clusters × head_dim`.
    #[serde(with = "serde_bytes")]
    centroids: Vec<u8>,
    #[serde(with = "serde_bytes")]
    value_means: Vec<u8>,
    rows: u64,
    #[serde(with = "serde_bytes")]
    key_codes: Vec<u8>,
    /// f16, f16, u16 per row and key partition.
    #[serde(with = "serde_bytes")]
    key_min: Vec<u8>,
    #[serde(with = "serde_bytes")]
    key_scale: Vec<u8>,
    #[serde(with = "serde_bytes")]
    key_sum: Vec<u8>,
    #[serde(with = "serde_bytes")]
    value_codes: Vec<u8>,
    /// f16 per value block and channel.
    #[serde(with = "serde_bytes")]
    value_min: Vec<u8>,
    #[serde(with = "serde_bytes")]
    value_scale: Vec<u8>,
}

pub(super) fn halves_to_bytes(x: &[f16]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect()
}

pub(super) fn u16s_to_bytes(x: &[u16]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub(super) fn bytes_to_u16s(x: &[u8], what: &str) -> std::result::Result<Vec<u16>, String> {
    if !x.len().is_multiple_of(2) {
        return Err(format!("{what}: {} bytes, expected a whole number of 2-byte values", x.len()));
    }
    Ok(x.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect())
}

pub(super) fn bytes_to_halves(x: &[u8], what: &str) -> std::result::Result<Vec<f16>, String> {
    Ok(bytes_to_u16s(x, what)?.into_iter().map(f16::from_bits).collect())
}

/// Token positions as a segment record keeps them: u32, little-endian.
pub(super) fn positions_to_bytes(x: &[u32]) -> Vec<u8> {
    x.iter().flat_map(|p| p.to_le_bytes()).collect()
}

/// The token positions of a segment record's bytes, or what is wrong with them.
pub(super) fn bytes_to_positions(x: &[u8]) -> std::result::Result<Vec<u32>, String> {
    if !x.len().is_multiple_of(4) {
        return Err(format!("positions: {} bytes, expected 4 per token", x.len()));
    }
    Ok(x.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
}

/// A segment record's row count as a length, or an error when it cannot be one.
pub(super) fn row_count(rows: u64) -> std::result::Result<usize, String> {
    usize::try_from(rows).map_err(|_| format!("{rows} rows do not fit in memory"))
}

impl HeadRecord {
    fn new(h: &EncodedHead, rows: &HackRows) -> Self {
        let a = rows.arrays();
        Self {
            sizes: h.sizes.clone(),
            positions: positions_to_bytes(&h.positions),
            centroids: halves_to_bytes(&h.centroids),
            value_means: halves_to_bytes(&h.value_means),
            rows: rows.rows() as u64,
            key_codes: a.key_codes.to_vec(),
            key_min: halves_to_bytes(a.key_min),
            key_scale: halves_to_bytes(a.key_scale),
            key_sum: u16s_to_bytes(a.key_sum),
            value_codes: a.value_codes.to_vec(),
            value_min: halves_to_bytes(a.value_min),
            value_scale: halves_to_bytes(a.value_scale),
        }
    }

    fn head(
        self,
        d: usize,
        params: HackParams,
        channel: Option<ChannelRecord>,
    ) -> std::result::Result<EncodedHead, String> {
        let positions = bytes_to_positions(&self.positions)?;
        let rows = row_count(self.rows)?;
        let (key_min, key_scale) =
            (bytes_to_halves(&self.key_min, "key minima")?, bytes_to_halves(&self.key_scale, "key scales")?);
        let key_sum = bytes_to_u16s(&self.key_sum, "key code sums")?;
        let (value_min, value_scale) =
            (bytes_to_halves(&self.value_min, "value minima")?, bytes_to_halves(&self.value_scale, "value scales")?);
        let (channel_min, channel_range) = match channel {
            Some(c) => (
                bytes_to_halves(&c.key_channel_min, "key channel minima")?,
                bytes_to_halves(&c.key_channel_range, "key channel ranges")?,
            ),
            None => (vec![], vec![]),
        };
        let arrays = HackArrays {
            key_codes: &self.key_codes,
            key_min: &key_min,
            key_scale: &key_scale,
            key_sum: &key_sum,
            value_codes: &self.value_codes,
            value_min: &value_min,
            value_scale: &value_scale,
            key_channel_min: &channel_min,
            key_channel_range: &channel_range,
        };
        let rows = HackRows::from_arrays(d, params, rows, arrays).map_err(|e| e.to_string())?;
        Ok(EncodedHead {
            sizes: self.sizes,
            positions,
            centroids: bytes_to_halves(&self.centroids, "centroids")?,
            value_means: bytes_to_halves(&self.value_means, "value means")?,
            rows: EncodedRows::Hack(rows),
        })
    }
}

/// A segment file of a per-channel (`hack2c`) layer: the per-token record, then per KV head
/// the keys' channel metadata (bincode concatenates fields, so the first part reads as a
/// [`SegmentRecord`] does).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ChannelSegmentRecord {
    segment: SegmentRecord,
    channels: Vec<ChannelRecord>,
}

/// One KV head's per-channel key metadata: f16 minima and ranges, `blocks × head_dim`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ChannelRecord {
    #[serde(with = "serde_bytes")]
    key_channel_min: Vec<u8>,
    #[serde(with = "serde_bytes")]
    key_channel_range: Vec<u8>,
}

/// What one layer's home on disk holds, as far as the next checkpoint needs to know.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct HomeState {
    /// crc32c of every segment file written, in order.
    pub segment_crcs: Vec<u32>,
    /// Data bytes the home covers.
    pub data_bytes: u64,
    /// Data bytes already punched out of the data file.
    pub punched: u64,
}

/// Deletes the homes and segment files of `layers` layers of `context` (best effort: what
/// is left is stale and goes at the next checkpoint or recovery).
pub(crate) fn remove_files(dir: &Path, context: u64, layers: usize) {
    let index_dir = dir.join(INDEX_DIR);
    for layer in 0..layers {
        let _ = std::fs::remove_file(index_dir.join(home_name(context, layer)));
        // Segment files are numbered from 0 without gaps.
        for unit in 0.. {
            if std::fs::remove_file(index_dir.join(segment_name(context, layer, unit))).is_err() {
                break;
            }
        }
    }
}

/// A home to write at a checkpoint.
pub(crate) struct HomeJob {
    pub context: u64,
    pub layer: usize,
    /// The index's zones, plain rows, and the segments not on disk yet.
    pub home: EncodedHome,
    /// The data file's committed bytes, chunks and tokens the index holds.
    pub data_bytes: u64,
    pub chunks: u64,
    pub tokens: u64,
    pub head_dim: usize,
    /// The index layout end the home depends on (a PQ layer's codebooks): the home is
    /// written only when that layout is on disk.
    pub layout_end: Option<u64>,
}

/// Writes the new segment files of `job` and then its home (each atomically); returns the
/// layer's new state and the bytes written, or `None` when a file would exceed one record
/// (64 MiB): the layer then keeps its f16 data file as its home.
pub(crate) fn write_home(
    storage: &dyn Storage,
    dir: &EngineDir,
    job: &HomeJob,
    known: &HomeState,
) -> Result<Option<(HomeState, usize)>> {
    let index_dir = dir.join(INDEX_DIR);
    let home = &job.home;
    let first = home.segment_count - home.segments.len();
    if first != known.segment_crcs.len() {
        // Not the segments the home on disk lacks: leave the layer as it is on disk.
        return Ok(None);
    }
    let mut crcs = known.segment_crcs.clone();
    let mut written = 0;
    for (i, seg) in home.segments.iter().enumerate() {
        let unit = first + i;
        let payload = match segment_payload(job, unit, seg) {
            Some(p) if p.len() <= MAX_RECORD_BYTES as usize => p,
            _ => return Ok(None),
        };
        let name = segment_name(job.context, job.layer, unit);
        write_manifest(storage, &index_dir, &name, dir.index_file(&name), &payload)?;
        crcs.push(crc32c::crc32c(&payload));
        written += payload.len();
    }
    let record = HomeRecord {
        context: job.context,
        layer: job.layer as u32,
        data_bytes: job.data_bytes,
        chunks: job.chunks,
        tokens: job.tokens,
        sink_len: home.sink_len,
        tail_start: home.tail_start,
        segments: crcs.clone(),
        steady: home
            .steady
            .iter()
            .map(|h| SteadyRecord {
                sink_keys: halves_to_bytes(&h.sink_keys),
                sink_values: halves_to_bytes(&h.sink_values),
                tail_keys: halves_to_bytes(&h.tail_keys),
                tail_values: halves_to_bytes(&h.tail_values),
            })
            .collect(),
    };
    let payload = encode(&record);
    if payload.len() > MAX_RECORD_BYTES as usize {
        return Ok(None);
    }
    let name = home_name(job.context, job.layer);
    write_manifest(storage, &index_dir, &name, dir.index_file(&name), &payload)?;
    written += payload.len();
    let state = HomeState { segment_crcs: crcs, data_bytes: job.data_bytes, punched: known.punched };
    Ok(Some((state, written)))
}

/// The payload of segment file `unit` of `job` holding `seg`: a 2-bit record (with the
/// per-channel keys' metadata for `hack2c`) or a kv43 record, as the rows are; `None` when
/// the heads' rows are not all of one kind.
fn segment_payload(job: &HomeJob, unit: usize, seg: &EncodedSegment) -> Option<Vec<u8>> {
    let (context, layer) = (job.context, job.layer as u32);
    if let Some(EncodedRows::Kv43(first)) = seg.heads.first().map(|h| &h.rows) {
        let params = first.params();
        let heads = seg
            .heads
            .iter()
            .map(|h| match &h.rows {
                EncodedRows::Kv43(rows) => Some(Kv43HeadRecord::new(h, rows)),
                EncodedRows::Hack(_) => None,
            })
            .collect::<Option<Vec<_>>>()?;
        return Some(encode(&Kv43SegmentRecord {
            context,
            layer,
            unit: unit as u32,
            first: seg.first,
            len: seg.len,
            head_dim: job.head_dim as u32,
            key_group: params.key_group as u32,
            value_block: params.value_block as u32,
            heads,
        }));
    }
    let rows: Vec<&HackRows> = seg.heads.iter().map(|h| h.rows.hack()).collect::<Option<_>>()?;
    let params = rows.first().map(|r| r.params());
    let record = SegmentRecord {
        context,
        layer,
        unit: unit as u32,
        first: seg.first,
        len: seg.len,
        head_dim: job.head_dim as u32,
        partition: params.map_or(0, |p| p.partition as u32),
        heads: seg.heads.iter().zip(&rows).map(|(h, r)| HeadRecord::new(h, r)).collect(),
    };
    if !params.is_some_and(|p| p.per_channel()) {
        return Some(encode(&record));
    }
    let channels = rows
        .iter()
        .map(|r| {
            let a = r.arrays();
            ChannelRecord {
                key_channel_min: halves_to_bytes(a.key_channel_min),
                key_channel_range: halves_to_bytes(a.key_channel_range),
            }
        })
        .collect();
    Some(encode(&ChannelSegmentRecord { segment: record, channels }))
}

/// A home read back from disk.
pub(crate) struct LoadedHome {
    pub home: EncodedHome,
    pub data_bytes: u64,
    pub chunks: u64,
    pub tokens: u64,
    pub state: HomeState,
    /// Payload bytes of the home and its segment files.
    pub bytes: u64,
}

/// The home of (`context`, `layer`) for `kv_heads` heads of `head_dim` with codec
/// parameters `params`: `Ok(None)` when there is none, `Err(why)` when it is unusable (a
/// frame or checksum that fails, a segment file missing or not the one the home was written
/// with, arrays that do not fit).
pub(crate) fn read_home(
    dir: &EngineDir,
    context: u64,
    layer: usize,
    (kv_heads, head_dim): (usize, usize),
    codec: RowCodec,
) -> std::result::Result<Option<LoadedHome>, String> {
    let index_dir = dir.join(INDEX_DIR);
    let name = home_name(context, layer);
    let path = index_dir.join(&name);
    let payload = match read_manifest(&index_dir, &name, dir.index_file(&name)) {
        Ok(Some(p)) => p,
        Ok(None) => return Ok(None),
        Err(e) => return Err(super::named(&path, &e)),
    };
    let mut bytes = payload.len() as u64;
    let r: HomeRecord = decode(&payload).map_err(|e| format!("{}: does not decode: {e}", path.display()))?;
    if (r.context, r.layer) != (context, layer as u32) {
        return Err(format!(
            "{}: holds the home of context {} layer {}, not context {context} layer {layer}",
            path.display(),
            r.context,
            r.layer
        ));
    }
    if r.steady.len() != kv_heads {
        return Err(format!("{}: plain rows of {} heads, the context has {kv_heads}", path.display(), r.steady.len()));
    }
    let mut segments = Vec::with_capacity(r.segments.len());
    for (unit, &crc) in r.segments.iter().enumerate() {
        let name = segment_name(context, layer, unit);
        let seg_path = index_dir.join(&name);
        let payload = match read_manifest(&index_dir, &name, dir.index_file(&name)) {
            Ok(Some(p)) => p,
            Ok(None) => {
                return Err(format!("{}: missing (the home lists {} segments)", seg_path.display(), r.segments.len()))
            }
            Err(e) => return Err(super::named(&seg_path, &e)),
        };
        if crc32c::crc32c(&payload) != crc {
            return Err(format!("{}: not the segment file the home was written with", seg_path.display()));
        }
        bytes += payload.len() as u64;
        let undecodable = |e| format!("{}: does not decode: {e}", seg_path.display());
        let params = match codec {
            RowCodec::Hack2(params) => params,
            RowCodec::Kv43(params) => {
                let r: Kv43SegmentRecord = decode(&payload).map_err(undecodable)?;
                let seg = r
                    .segment((context, layer, unit), (kv_heads, head_dim), params)
                    .map_err(|e| format!("{}: {e}", seg_path.display()))?;
                segments.push(seg);
                continue;
            }
            RowCodec::Plain => return Err(format!("{}: a plain layer has no encoded home", seg_path.display())),
        };
        let (s, channels) = if params.per_channel() {
            let c: ChannelSegmentRecord = decode(&payload).map_err(undecodable)?;
            if c.channels.len() != c.segment.heads.len() {
                return Err(format!(
                    "{}: key channel metadata of {} heads for {} heads of rows",
                    seg_path.display(),
                    c.channels.len(),
                    c.segment.heads.len()
                ));
            }
            (c.segment, c.channels.into_iter().map(Some).collect())
        } else {
            let s: SegmentRecord = decode(&payload).map_err(undecodable)?;
            let none = vec![None; s.heads.len()];
            (s, none)
        };
        let fits = (s.context, s.layer, s.unit as usize, s.head_dim as usize, s.partition as usize, s.heads.len())
            == (context, layer as u32, unit, head_dim, params.partition, kv_heads);
        if !fits {
            return Err(format!(
                "{}: segment {} of context {} layer {} ({} heads, d = {}, Π = {}) does not fit",
                seg_path.display(),
                s.unit,
                s.context,
                s.layer,
                s.heads.len(),
                s.head_dim,
                s.partition
            ));
        }
        let heads = s
            .heads
            .into_iter()
            .zip(channels)
            .map(|(h, c)| h.head(head_dim, params, c))
            .collect::<std::result::Result<Vec<_>, String>>()
            .map_err(|e| format!("{}: {e}", seg_path.display()))?;
        segments.push(EncodedSegment { first: s.first, len: s.len, heads });
    }
    let steady = r
        .steady
        .iter()
        .map(|h| {
            Ok(SteadyHead {
                sink_keys: bytes_to_halves(&h.sink_keys, "sink keys")?,
                sink_values: bytes_to_halves(&h.sink_values, "sink values")?,
                tail_keys: bytes_to_halves(&h.tail_keys, "tail keys")?,
                tail_values: bytes_to_halves(&h.tail_values, "tail values")?,
            })
        })
        .collect::<std::result::Result<Vec<_>, String>>()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let home = EncodedHome {
        tokens: r.tokens,
        sink_len: r.sink_len,
        tail_start: r.tail_start,
        segment_count: segments.len(),
        steady,
        segments,
        pq: None,
    };
    let state = HomeState { segment_crcs: r.segments, data_bytes: r.data_bytes, punched: 0 };
    Ok(Some(LoadedHome { home, data_bytes: r.data_bytes, chunks: r.chunks, tokens: r.tokens, state, bytes }))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use attnstore_index::{AccessMethod, Snapshots, WaveIndex, WaveParams};
    use attnstore_kernels::random::SplitMix64;
    use attnstore_wal::StdStorage;

    const HEADS: usize = 2;
    const D: usize = 16;

    /// A small `hack2` wave index: two prefill segments and a decode segment.
    fn index() -> WaveIndex<f16> {
        let params =
            WaveParams { segment_tokens: 64, decode_segment_tokens: 32, local_tokens: 8, ..WaveParams::default() };
        let mut w =
            WaveIndex::<f16>::new(params, HEADS, D).unwrap().with_codec(Some(HackParams::new(16).unwrap())).unwrap();
        let mut rng = SplitMix64::new(3);
        let kv = |n: usize, rng: &mut SplitMix64| rng.normals(HEADS * n * D);
        w.prefill(&kv(150, &mut rng), &kv(150, &mut rng)).unwrap();
        w.append(&kv(40, &mut rng), &kv(40, &mut rng)).unwrap();
        w
    }

    fn job(w: &WaveIndex<f16>, from: usize, data_bytes: u64) -> HomeJob {
        let home = w.encoded_home(from).unwrap().unwrap();
        let tokens = home.tokens;
        HomeJob { context: 7, layer: 1, home, data_bytes, chunks: 2, tokens, head_dim: D, layout_end: None }
    }

    /// A home record's payload (a fuzz seed).
    pub(crate) fn home_payload() -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(INDEX_DIR)).unwrap();
        write_home(&StdStorage, &EngineDir::new(dir.path(), 9), &job(&index(), 0, 4096), &HomeState::default())
            .unwrap()
            .unwrap();
        read_manifest(
            &dir.path().join(INDEX_DIR),
            &home_name(7, 1),
            EngineDir::new(dir.path(), 9).index_file(&home_name(7, 1)),
        )
        .unwrap()
        .unwrap()
    }

    /// A segment record's payload (a fuzz seed).
    pub(crate) fn segment_payload() -> Vec<u8> {
        encode(&SegmentRecord {
            context: 7,
            layer: 1,
            unit: 0,
            first: 4,
            len: 8,
            head_dim: 16,
            partition: 16,
            heads: {
                let home = index().encoded_home(0).unwrap().unwrap();
                let head = &home.segments[0].heads[0];
                vec![HeadRecord::new(head, head.rows.hack().unwrap()); 1]
            },
        })
    }

    #[test]
    fn a_home_written_and_read_back_restores_the_same_index_and_damage_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(INDEX_DIR)).unwrap();
        let w = index();
        let segments = Snapshots::encoded_segments(&w).unwrap();
        assert!(segments >= 3, "{segments} segments");
        let (state, bytes) =
            write_home(&StdStorage, &EngineDir::new(dir.path(), 9), &job(&w, 0, 4096), &HomeState::default())
                .unwrap()
                .unwrap();
        assert_eq!((state.segment_crcs.len(), state.data_bytes), (segments, 4096));
        assert!(bytes > 0);
        let params = HackParams::new(16).unwrap();
        let loaded =
            read_home(&EngineDir::new(dir.path(), 9), 7, 1, (HEADS, D), RowCodec::Hack2(params)).unwrap().unwrap();
        assert_eq!((loaded.data_bytes, loaded.chunks, loaded.tokens), (4096, 2, 190));
        assert_eq!(loaded.state, state);
        let mut again = WaveIndex::<f16>::new(*w.params(), HEADS, D).unwrap().with_codec(Some(params)).unwrap();
        again.restore_encoded(loaded.home).unwrap();
        assert_eq!(again.layout(), w.layout());
        let q = SplitMix64::new(9).normals(2 * D);
        let (a, b) = (
            crate::execute_head(&w, 1, &q, D, &w.plan_exact()).unwrap(),
            crate::execute_head(&again, 1, &q, D, &again.plan_exact()).unwrap(),
        );
        assert_eq!(
            a.iter().map(|p| p.clone().finish()).collect::<Vec<_>>(),
            b.iter().map(|p| p.clone().finish()).collect::<Vec<_>>()
        );
        // A later checkpoint writes only the segments that are new: none here.
        let (later, _) =
            write_home(&StdStorage, &EngineDir::new(dir.path(), 9), &job(&w, segments, 8192), &state).unwrap().unwrap();
        assert_eq!(later.segment_crcs, state.segment_crcs);
        // Not this layer's, a segment file replaced by another, a missing one.
        assert!(read_home(&EngineDir::new(dir.path(), 9), 7, 2, (HEADS, D), RowCodec::Hack2(params))
            .unwrap()
            .is_none());
        let index_dir = dir.path().join(INDEX_DIR);
        std::fs::copy(index_dir.join(segment_name(7, 1, 0)), index_dir.join(segment_name(7, 1, 1))).unwrap();
        let why = read_home(&EngineDir::new(dir.path(), 9), 7, 1, (HEADS, D), RowCodec::Hack2(params)).err().unwrap();
        assert!(why.contains("seg-1.h2") && why.contains("another place"), "{why}");
        std::fs::remove_file(index_dir.join(segment_name(7, 1, 1))).unwrap();
        let why = read_home(&EngineDir::new(dir.path(), 9), 7, 1, (HEADS, D), RowCodec::Hack2(params)).err().unwrap();
        assert!(why.contains("seg-1.h2: missing"), "{why}");
        // Another head count or codec does not fit.
        write_home(&StdStorage, &EngineDir::new(dir.path(), 9), &job(&w, 0, 4096), &HomeState::default())
            .unwrap()
            .unwrap();
        let why =
            read_home(&EngineDir::new(dir.path(), 9), 7, 1, (HEADS, D), RowCodec::Hack2(HackParams::new(32).unwrap()))
                .err()
                .unwrap();
        assert!(why.contains("does not fit"), "{why}");
        let why =
            read_home(&EngineDir::new(dir.path(), 9), 7, 1, (HEADS + 1, D), RowCodec::Hack2(params)).err().unwrap();
        assert!(why.contains("plain rows of 2 heads"), "{why}");
    }
}
