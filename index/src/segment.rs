//! Building one segment of one head: spherical k-means on the centred keys, then the
//! tokens laid out cluster-contiguous with each cluster's mean key and mean value.

use crate::blocks::{attend_clusters, missing, BlockStore, ClusterBlocks, ClusterRows};
use crate::error::{Error, Result};
use attnstore_kernels::cpu::attention::{attend_spans, Scratch};
use attnstore_kernels::cpu::kmeans::{center_and_normalize, cluster_order, spherical_kmeans, KMeansParams};
use attnstore_kernels::random::SplitMix64;
use attnstore_kernels::{Element, HackParams, HackRows, HackView, Partial};
use std::ops::Range;

/// The KV rows of one head's segment, in cluster order: plain rows, (with the `hack2`
/// codec) 2-bit rows, or rows homed in the buffer manager; in the last two cases `keys` and
/// `values` are empty.
#[derive(Debug, Clone, Default)]
pub(crate) struct HeadSegment<E> {
    pub keys: Vec<E>,
    pub values: Vec<E>,
    /// The rows in HACK 2-bit form, when the context's codec is `hack2`.
    pub hack: Option<HackRows>,
    /// Where the rows are when they live in the buffer manager.
    pub blocks: Option<SegmentBlocks>,
    /// Where the 2-bit rows are when they live in the buffer manager.
    pub groups: Option<HackGroups>,
    /// Original token position of every row.
    pub positions: Vec<u32>,
}

/// Where a segment's block-homed rows are: the buffer manager, the KV head, and whether
/// the read is a scan (an exact plan: its pins log no accesses, so it neither admits nor
/// evicts what sparse plans re-read).
#[derive(Clone, Copy)]
pub(crate) struct Homed<'a> {
    pub store: &'a BlockStore,
    pub head: usize,
    pub scan: bool,
}

/// The 2-bit rows of a segment homed in the buffer manager: value block `i` (Π rows in
/// storage order, [`HackRows::group_bytes`]) is cluster `first + i` of the head. Value
/// blocks span clusters, so the unit homed is the block, not the cluster.
#[derive(Debug, Clone)]
pub(crate) struct HackGroups {
    pub first: u32,
    pub count: u32,
    pub rows: usize,
    pub d: usize,
    pub params: HackParams,
}

impl HackGroups {
    /// Rows of value block `b` (Π, or fewer for the last).
    pub fn rows_in(&self, b: usize) -> usize {
        let p = self.params.partition;
        (self.rows - b * p).min(p)
    }

    /// Bytes of value block `b` in the group layout.
    fn len_of(&self, b: usize) -> usize {
        HackView::group_len(self.d, self.params, self.rows_in(b))
    }

    /// Views of value blocks `blocks` over their copies `buffers` (from [`read_groups`]).
    fn views<'a>(&self, blocks: &[usize], buffers: &'a [Vec<u16>]) -> Result<Vec<HackView<'a>>> {
        blocks
            .iter()
            .zip(buffers)
            .map(|(&b, buf)| Ok(HackView::from_group(self.d, self.params, self.rows_in(b), bytemuck::cast_slice(buf))?))
            .collect()
    }
}

/// The clusters of a segment whose rows live in the buffer manager.
#[derive(Debug, Clone)]
pub(crate) struct SegmentBlocks {
    /// Directory id of the segment's first cluster (its clusters have consecutive ids).
    pub first_cluster: u32,
    /// First row of every cluster, then the segment's row count.
    pub starts: Vec<u32>,
    /// Bytes of one K (or V) row.
    pub row_bytes: usize,
}

impl<E> HeadSegment<E> {
    /// Cluster ids of `head` this segment's rows occupy in the buffer manager, if homed there.
    pub fn homed_ids(&self) -> Option<Range<u32>> {
        match (&self.blocks, &self.groups) {
            (Some(b), _) => Some(b.first_cluster..b.first_cluster + b.starts.len() as u32 - 1),
            (_, Some(g)) => Some(g.first..g.first + g.count),
            _ => None,
        }
    }
}

impl<E: Element> HeadSegment<E> {
    /// Encodes the rows in 2-bit form (each value quantized once, seeded) and drops the
    /// plain copy.
    pub fn encode(&mut self, d: usize, params: HackParams, seed: u64) -> Result<()> {
        let mut rows = HackRows::new(d, params)?;
        rows.push_rows(&self.keys, &self.values, &mut SplitMix64::new(seed))?;
        self.hack = Some(rows);
        self.keys = Vec::new();
        self.values = Vec::new();
        Ok(())
    }

    /// Bytes of the stored rows, encoded, plain, or in the buffer manager's blocks (the
    /// rows' bytes, without the padding of the blocks' tails).
    pub fn kv_bytes(&self) -> usize {
        let groups = self.groups.as_ref().map_or(0, |g| (0..g.count as usize).map(|b| g.len_of(b)).sum());
        groups
            + self.hack.as_ref().map_or(0, HackRows::bytes)
            + self.blocks.as_ref().map_or(0, |b| 2 * self.positions.len() * b.row_bytes)
            + (self.keys.len() + self.values.len()) * E::DTYPE.size_bytes()
    }

    /// Moves the 2-bit rows into the buffer manager (`store`, KV head `head`), one cluster
    /// per value block from `first`, and drops them here. All or nothing.
    pub fn move_hack_to(&mut self, store: &BlockStore, head: usize, first: u32, d: usize) -> Result<()> {
        let Some(rows) = &self.hack else { return Ok(()) };
        let count = rows.groups() as u32;
        for g in 0..count {
            if let Err(e) = store.store_bytes(head, first + g, &rows.group_bytes(g as usize)) {
                store.free(head, first..first + g);
                return Err(e);
            }
        }
        self.groups = Some(HackGroups { first, count, rows: rows.rows(), d, params: rows.params() });
        self.hack = None;
        Ok(())
    }

    /// The 2-bit rows, from here or read back from the buffer manager (`store`, KV head
    /// `head`); `None` for plain rows.
    pub fn hack_rows(&self, store: Option<(&BlockStore, usize)>) -> Result<Option<HackRows>> {
        if let Some(rows) = &self.hack {
            return Ok(Some(rows.clone()));
        }
        let Some(g) = &self.groups else { return Ok(None) };
        let (store, head) = store
            .ok_or_else(|| Error::MissingRows("2-bit rows homed in a buffer manager the index no longer has".into()))?;
        let blocks: Vec<usize> = (0..g.count as usize).collect();
        let buffers = read_groups(&store.buffers().scan_reader(), store, head, g, &blocks)?;
        Ok(Some(HackRows::from_groups(g.d, g.params, &g.views(&blocks, &buffers)?)?))
    }

    /// Moves the rows into the buffer manager (`store`, KV head `head`) as clusters
    /// `first_cluster..` with the bounds of `metas`, and drops the plain copy. All or nothing:
    /// on failure the clusters stored so far are freed and the rows stay here.
    pub fn move_to(
        &mut self,
        store: &BlockStore,
        head: usize,
        first_cluster: u32,
        metas: &[ClusterMeta],
        d: usize,
    ) -> Result<()> {
        for (i, m) in metas.iter().enumerate() {
            let rows = m.start as usize * d..m.end as usize * d;
            if let Err(e) = store.store(head, first_cluster + i as u32, &self.keys[rows.clone()], &self.values[rows], d)
            {
                store.free(head, first_cluster..first_cluster + i as u32);
                return Err(e);
            }
        }
        let mut starts: Vec<u32> = metas.iter().map(|m| m.start).collect();
        starts.push(self.positions.len() as u32);
        self.blocks = Some(SegmentBlocks { first_cluster, starts, row_bytes: d * E::DTYPE.size_bytes() });
        self.keys = Vec::new();
        self.values = Vec::new();
        Ok(())
    }

    /// Quantizes the query heads `q` (`g × d`) into `scratch` for this segment's 2-bit rows
    /// (nothing for plain rows): clones of the scratch attend any segment of the same codec
    /// without quantizing the queries again.
    pub fn prime(&self, q: &[f32], g: usize, d: usize, scratch: &mut Scratch) -> Result<()> {
        let params = match (&self.hack, &self.groups) {
            (Some(rows), _) => rows.params(),
            (_, Some(groups)) => groups.params,
            _ => return Ok(()),
        };
        Ok(scratch.hack.quantize(q, g, d, params)?)
    }

    /// Folds the rows of `ranges` into the partials of query heads `q` (`parts.len() × d`).
    /// `store` says where block-homed rows are ([`Homed`]); pinning them can fail (a corrupt
    /// or lost block, an I/O error), which is reported, never served.
    pub fn attend(
        &self,
        homed: Option<Homed<'_>>,
        q: &[f32],
        scale: f32,
        ranges: &[Range<usize>],
        parts: &mut [Partial],
        scratch: &mut Scratch,
    ) -> Result<()> {
        let d = q.len() / parts.len().max(1);
        let store = homed.map(|h| (h.store, h.head));
        if let Some(g) = &self.groups {
            let homed = homed.ok_or_else(|| {
                Error::MissingRows("2-bit rows homed in a buffer manager the plan does not name".into())
            })?;
            let (store, head) = (homed.store, homed.head);
            // Each value block the ranges touch, its rows local to the block.
            let p = g.params.partition;
            let mut wanted: Vec<(usize, Vec<Range<usize>>)> = Vec::new();
            let mut sorted: Vec<Range<usize>> = ranges.iter().filter(|r| !r.is_empty()).cloned().collect();
            sorted.sort_unstable_by_key(|r| r.start);
            for r in sorted {
                for block in r.start / p..r.end.div_ceil(p) {
                    let local = r.start.max(block * p) - block * p..r.end.min((block + 1) * p) - block * p;
                    match wanted.last_mut() {
                        Some((b, runs)) if *b == block => runs.push(local),
                        _ => wanted.push((block, vec![local])),
                    }
                }
            }
            if wanted.is_empty() {
                return Ok(());
            }
            // A scan (an exact plan) must not flush what sparse plans keep re-reading.
            let reader = if homed.scan { store.buffers().scan_reader() } else { store.buffers().reader() };
            let blocks: Vec<usize> = wanted.iter().map(|(b, _)| *b).collect();
            let buffers = read_groups(&reader, store, head, g, &blocks)?;
            let views = g.views(&blocks, &buffers)?;
            // The step's queries are quantized once for every block.
            views[0].quantize_queries(q, parts.len(), &mut scratch.hack);
            for (view, (_, runs)) in views.iter().zip(&wanted) {
                view.attend_quantized(scale, runs, parts, &mut scratch.hack);
            }
            return Ok(());
        }
        if let (Some(b), Some((store, head))) = (&self.blocks, store) {
            let mut keys = Vec::new();
            let mut rows = Vec::new();
            for r in ranges.iter().filter(|r| !r.is_empty()) {
                let mut c = b.starts.partition_point(|&s| s as usize <= r.start).saturating_sub(1);
                while c + 1 < b.starts.len() && (b.starts[c] as usize) < r.end {
                    let (cs, ce) = (b.starts[c] as usize, b.starts[c + 1] as usize);
                    keys.push(store.key(head, b.first_cluster + c as u32));
                    rows.push(r.start.max(cs) - cs..r.end.min(ce) - cs);
                    c += 1;
                }
            }
            // Exact plans read every block once through here: a scan, which must not flush
            // the Gpu tier (sparse plans pin their recorded blocks with a tracking reader).
            let reader = store.buffers().scan_reader();
            let mut found = Vec::with_capacity(keys.len());
            reader.clusters(&keys, &mut found);
            let clusters = found
                .into_iter()
                .zip(&keys)
                .zip(rows)
                .map(|((f, k), rows)| {
                    Ok(ClusterRows { locations: ClusterBlocks::Live(f.ok_or_else(|| missing(k))?), rows })
                })
                .collect::<Result<Vec<_>>>()?;
            let per_block = store.rows_per_block(d * E::DTYPE.size_bytes())?;
            return attend_clusters::<E>(&reader, per_block, q, scale, &clusters, parts, scratch);
        }
        match &self.hack {
            Some(rows) => rows.attend(q, scale, ranges, parts, &mut scratch.hack),
            None => {
                let spans =
                    ranges.iter().map(|r| (&self.keys[r.start * d..r.end * d], &self.values[r.start * d..r.end * d]));
                attend_spans(q, scale, spans, parts, scratch);
            }
        }
        Ok(())
    }
}

/// Value blocks `blocks` of `g`, each copied out of its pinned buffer-manager blocks into a
/// 2-byte aligned buffer (a block of Π rows spans several 2 KiB blocks, which need not be
/// adjacent).
fn read_groups(
    reader: &attnstore_buffer::Reader<'_>,
    store: &BlockStore,
    head: usize,
    g: &HackGroups,
    blocks: &[usize],
) -> Result<Vec<Vec<u16>>> {
    let keys: Vec<_> = blocks.iter().map(|&b| store.key(head, g.first + b as u32)).collect();
    let (locations, counts) = store.lookup_counted(&keys)?;
    let mut pins = reader.pin_all(&locations).into_iter();
    let mut out = Vec::with_capacity(blocks.len());
    for (&b, &n) in blocks.iter().zip(&counts) {
        let len = g.len_of(b);
        let mut buf = vec![0u16; len.div_ceil(2)];
        let bytes = &mut bytemuck::cast_slice_mut::<u16, u8>(&mut buf)[..len];
        let mut at = 0;
        for _ in 0..n {
            let pin = pins.next().expect("one pin per location")?;
            let take = (len - at).min(pin.len());
            bytes[at..at + take].copy_from_slice(&pin[..take]);
            at += take;
        }
        if at < len {
            return Err(Error::MissingRows(format!(
                "value block {b} of head {head}: {at} of its {len} bytes are in the buffer manager"
            )));
        }
        out.push(buf);
    }
    Ok(out)
}

/// One non-empty cluster of a built segment: rows `start..end`, mean key and mean value.
#[derive(Debug, Clone)]
pub(crate) struct ClusterMeta {
    pub start: u32,
    pub end: u32,
    pub centroid: Vec<f32>,
    pub value_mean: Vec<f32>,
}

/// Clustering knobs of one segment build.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BuildParams {
    pub tokens_per_cluster: usize,
    pub max_iters: usize,
    pub seed: u64,
}

/// Clusters `n` rows (`keys`/`values`: `n × d`, positions `first_position..`) and returns the
/// cluster-contiguous segment with its non-empty clusters in order.
pub(crate) fn build_head_segment<E: Element>(
    keys: &[E],
    values: &[E],
    first_position: u32,
    d: usize,
    params: BuildParams,
) -> Result<(HeadSegment<E>, Vec<ClusterMeta>)> {
    let n = keys.len() / d;
    let mut wide_keys = vec![0.0f32; keys.len()];
    E::widen(keys, &mut wide_keys);
    let mut unit = wide_keys.clone();
    center_and_normalize(&mut unit, d);
    let clusters = n.div_ceil(params.tokens_per_cluster).max(1);
    let km = spherical_kmeans(&unit, d, KMeansParams { clusters, max_iters: params.max_iters, seed: params.seed })?;
    let (order, offsets) = cluster_order(&km.assignment, km.clusters, 0);
    let sizes: Vec<u32> = offsets.windows(2).map(|w| w[1] - w[0]).filter(|&n| n > 0).collect();
    Ok(assemble_segment(keys, values, &wide_keys, first_position, d, &order, &sizes))
}

/// The segment whose rows are `order` (row numbers within `keys`/`values`, cluster after
/// cluster) with non-empty clusters of `sizes` rows, and each cluster's mean key and value.
/// `wide_keys` are `keys` widened to f32. Used by a build (after k-means) and by a restore
/// from a checkpointed layout (no k-means).
pub(crate) fn assemble_segment<E: Element>(
    keys: &[E],
    values: &[E],
    wide_keys: &[f32],
    first_position: u32,
    d: usize,
    order: &[u32],
    sizes: &[u32],
) -> (HeadSegment<E>, Vec<ClusterMeta>) {
    let n = order.len();
    let mut seg = HeadSegment {
        hack: None,
        blocks: None,
        groups: None,
        keys: Vec::with_capacity(n * d),
        values: Vec::with_capacity(n * d),
        positions: Vec::with_capacity(n),
    };
    let mut wide_value = vec![0.0f32; d];
    let mut metas = Vec::with_capacity(sizes.len());
    let mut start = 0u32;
    for &size in sizes {
        let end = start + size;
        let out_start = seg.positions.len() as u32;
        let mut centroid = vec![0.0f32; d];
        let mut value_mean = vec![0.0f32; d];
        for &row in &order[start as usize..end as usize] {
            let r = row as usize;
            seg.keys.extend_from_slice(&keys[r * d..(r + 1) * d]);
            seg.values.extend_from_slice(&values[r * d..(r + 1) * d]);
            seg.positions.push(first_position + row);
            for (c, k) in centroid.iter_mut().zip(&wide_keys[r * d..(r + 1) * d]) {
                *c += k;
            }
            E::widen(&values[r * d..(r + 1) * d], &mut wide_value);
            for (m, v) in value_mean.iter_mut().zip(&wide_value) {
                *m += v;
            }
        }
        let inv = 1.0 / size as f32;
        centroid.iter_mut().for_each(|x| *x *= inv);
        value_mean.iter_mut().for_each(|x| *x *= inv);
        metas.push(ClusterMeta { start: out_start, end: out_start + size, centroid, value_mean });
        start = end;
    }
    (seg, metas)
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnstore_kernels::random::SplitMix64;

    #[test]
    fn segment_is_a_permutation_with_contiguous_clusters_and_true_means() {
        let (d, n) = (8, 200);
        let mut g = SplitMix64::new(5);
        let keys: Vec<f32> = (0..n * d).map(|_| g.normal()).collect();
        let values: Vec<f32> = (0..n * d).map(|_| g.normal()).collect();
        let params = BuildParams { tokens_per_cluster: 16, max_iters: 10, seed: 1 };
        let (seg, metas) = build_head_segment(&keys, &values, 1000, d, params).unwrap();
        let mut pos = seg.positions.clone();
        pos.sort_unstable();
        assert_eq!(pos, (1000..1000 + n as u32).collect::<Vec<_>>());
        assert_eq!(metas.first().unwrap().start, 0);
        assert_eq!(metas.last().unwrap().end as usize, n);
        for w in metas.windows(2) {
            assert_eq!(w[0].end, w[1].start);
        }
        for m in &metas {
            for j in 0..d {
                let mean: f32 = (m.start..m.end)
                    .map(|r| {
                        let orig = (seg.positions[r as usize] - 1000) as usize;
                        assert_eq!(seg.keys[r as usize * d + j], keys[orig * d + j]);
                        keys[orig * d + j]
                    })
                    .sum::<f32>()
                    / (m.end - m.start) as f32;
                assert!((mean - m.centroid[j]).abs() < 1e-5);
            }
        }
    }
}
