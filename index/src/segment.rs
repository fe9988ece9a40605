//! Building one segment of one head: spherical k-means on the centred keys, then the
//! tokens laid out cluster-contiguous with each cluster's mean key and mean value.

use crate::codec::{EncodedRows, RowCodec};
use crate::error::{Error, Result};
use crate::home::RowHome;
use crate::rows::{HomedClusters, HomedGroups, PlainRows, Run};
use attnstore_kernels::cpu::kmeans::{center_and_normalize, cluster_order, spherical_kmeans, KMeansParams};
use attnstore_kernels::{Element, HackRows, HackView, Kv43Head};
use std::ops::Range;

/// The KV rows of one head's segment, in cluster order, and where they are.
#[derive(Debug, Clone)]
pub(crate) enum SegmentRows<E> {
    /// Plain rows in the index's memory, `rows × d` each.
    Plain { keys: Vec<E>, values: Vec<E> },
    /// 2-bit rows in the index's memory (the `hack2` codec).
    Encoded(Box<HackRows>),
    /// Plain rows in the row home, one home cluster per directory cluster.
    Homed(SegmentBlocks),
    /// 2-bit rows in the row home, one home cluster per value block.
    HomedEncoded(HomedGroups),
    /// kv43 rows in the index's memory (whole key groups encoded, the last partial group
    /// in f16).
    Kv43(Box<Kv43Head>),
}

/// One head's segment: its rows and the original token position of every row.
#[derive(Debug, Clone)]
pub(crate) struct HeadSegment<E> {
    pub rows: SegmentRows<E>,
    pub positions: Vec<u32>,
}

/// The clusters of a segment whose rows live in the row home.
#[derive(Debug, Clone)]
pub(crate) struct SegmentBlocks {
    /// Home cluster id of the segment's first cluster (its clusters have consecutive ids).
    pub first_cluster: u32,
    /// First row of every cluster, then the segment's row count.
    pub starts: Vec<u32>,
    /// Bytes of one K (or V) row.
    pub row_bytes: usize,
}

impl<E> HeadSegment<E> {
    /// Cluster ids of `head` this segment's rows occupy in the row home, if homed there.
    pub fn homed_ids(&self) -> Option<Range<u32>> {
        match &self.rows {
            SegmentRows::Homed(b) => Some(b.first_cluster..b.first_cluster + b.starts.len() as u32 - 1),
            SegmentRows::HomedEncoded(g) => Some(g.ids()),
            _ => None,
        }
    }
}

impl<E: Element> HeadSegment<E> {
    /// Encodes plain rows with `codec` (each value quantized once, seeded) and drops the
    /// plain copy; plain rows stay as they are under the plain codec.
    pub fn encode(&mut self, codec: RowCodec, d: usize, seed: u64) -> Result<()> {
        if let SegmentRows::Plain { keys, values } = &self.rows {
            match codec.encode(keys, values, d, seed)? {
                Some(EncodedRows::Hack(rows)) => self.rows = SegmentRows::Encoded(Box::new(rows)),
                Some(EncodedRows::Kv43(rows)) => self.rows = SegmentRows::Kv43(Box::new(rows)),
                None => {}
            }
        }
        Ok(())
    }

    /// The encoded rows a checkpoint writes: 2-bit rows from here or read back from the row
    /// home (KV head `head`), or kv43 rows; `None` for plain rows.
    pub fn home_rows(&self, home: Option<(&dyn RowHome, usize)>) -> Result<Option<EncodedRows>> {
        if let SegmentRows::Kv43(rows) = &self.rows {
            return Ok(Some(EncodedRows::Kv43(rows.as_ref().clone())));
        }
        Ok(self.hack_rows(home)?.map(EncodedRows::Hack))
    }

    /// The kv43 rows, when the segment holds them.
    pub fn kv43_rows(&self) -> Option<&Kv43Head> {
        match &self.rows {
            SegmentRows::Kv43(rows) => Some(rows),
            _ => None,
        }
    }

    /// Bytes of the stored rows, encoded, plain, or in the row home's blocks (the rows'
    /// bytes, without the padding of the blocks' tails).
    pub fn kv_bytes(&self) -> usize {
        match &self.rows {
            SegmentRows::Plain { keys, values } => (keys.len() + values.len()) * E::DTYPE.size_bytes(),
            SegmentRows::Encoded(rows) => rows.bytes(),
            SegmentRows::Homed(b) => 2 * self.positions.len() * b.row_bytes,
            SegmentRows::HomedEncoded(g) => g.bytes(),
            SegmentRows::Kv43(rows) => rows.bytes(),
        }
    }

    /// Moves 2-bit rows into the row home (KV head `head`), one cluster per value block
    /// from `first`, and drops them here. All or nothing; other rows stay.
    pub fn move_hack_to(&mut self, home: &dyn RowHome, head: usize, first: u32, d: usize) -> Result<()> {
        let SegmentRows::Encoded(rows) = &self.rows else { return Ok(()) };
        let count = rows.groups() as u32;
        for g in 0..count {
            if let Err(e) = home.store_bytes(head, first + g, &rows.group_bytes(g as usize)) {
                home.free(head, first..first + g);
                return Err(e);
            }
        }
        let groups = HomedGroups { first, count, rows: rows.rows(), head_dim: d, params: rows.params() };
        self.rows = SegmentRows::HomedEncoded(groups);
        Ok(())
    }

    /// The 2-bit rows, from here or read back from the row home (KV head `head`); `None` for
    /// plain rows.
    pub fn hack_rows(&self, home: Option<(&dyn RowHome, usize)>) -> Result<Option<HackRows>> {
        let g = match &self.rows {
            SegmentRows::Encoded(rows) => return Ok(Some(rows.as_ref().clone())),
            SegmentRows::HomedEncoded(g) => g,
            _ => return Ok(None),
        };
        let (home, head) =
            home.ok_or_else(|| Error::MissingRows("2-bit rows homed in a row home the index no longer has".into()))?;
        let ids: Vec<u32> = g.ids().collect();
        let bytes = home.read(head, &ids)?;
        let mut buffers = Vec::with_capacity(bytes.len());
        for (b, got) in bytes.iter().enumerate() {
            let len = g.len_of(b);
            if got.len() < len {
                return Err(Error::MissingRows(format!(
                    "value block {b} of head {head}: {} of its {len} bytes are in the row home",
                    got.len()
                )));
            }
            // A 2-byte aligned copy: the views read u16 arrays.
            let mut buf = vec![0u16; len.div_ceil(2)];
            bytemuck::cast_slice_mut::<u16, u8>(&mut buf)[..len].copy_from_slice(&got[..len]);
            buffers.push(buf);
        }
        let views = buffers
            .iter()
            .enumerate()
            .map(|(b, buf)| Ok(HackView::from_group(g.head_dim, g.params, g.rows_in(b), bytemuck::cast_slice(buf))?))
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(HackRows::from_groups(g.head_dim, g.params, &views)?))
    }

    /// Moves plain rows into the row home (KV head `head`) as clusters `first_cluster..`
    /// with the bounds of `metas`, and drops the plain copy. All or nothing: on failure the
    /// clusters stored so far are freed and the rows stay here.
    pub fn move_to(
        &mut self,
        home: &dyn RowHome,
        head: usize,
        first_cluster: u32,
        metas: &[ClusterMeta],
        d: usize,
    ) -> Result<()> {
        let SegmentRows::Plain { keys, values } = &self.rows else { return Ok(()) };
        let row_bytes = d * E::DTYPE.size_bytes();
        for (i, m) in metas.iter().enumerate() {
            let rows = m.start as usize * d..m.end as usize * d;
            let (k, v) = (&keys[rows.clone()], &values[rows]);
            if let Err(e) = home.store_rows(
                head,
                first_cluster + i as u32,
                bytemuck::cast_slice(k),
                bytemuck::cast_slice(v),
                row_bytes,
            ) {
                home.free(head, first_cluster..first_cluster + i as u32);
                return Err(e);
            }
        }
        let mut starts: Vec<u32> = metas.iter().map(|m| m.start).collect();
        starts.push(self.positions.len() as u32);
        self.rows = SegmentRows::Homed(SegmentBlocks { first_cluster, starts, row_bytes });
        Ok(())
    }

    /// The run that reads this segment's rows `ranges`, wherever they are.
    pub fn run(&self, ranges: Vec<Range<usize>>) -> Run<'_> {
        match &self.rows {
            SegmentRows::HomedEncoded(groups) => Run::HomedGroups { groups: *groups, ranges },
            SegmentRows::Homed(b) => Run::Homed {
                clusters: HomedClusters { first: b.first_cluster, starts: &b.starts, dtype: E::DTYPE },
                ranges,
            },
            SegmentRows::Encoded(rows) => Run::Encoded { rows, ranges },
            SegmentRows::Kv43(rows) => Run::Kv43 { rows, ranges },
            SegmentRows::Plain { keys, values } => {
                let d = if self.positions.is_empty() { 0 } else { keys.len() / self.positions.len() };
                Run::Plain(
                    ranges
                        .iter()
                        .map(|r| PlainRows::of(&keys[r.start * d..r.end * d], &values[r.start * d..r.end * d]))
                        .collect(),
                )
            }
        }
    }
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
    let (mut seg_keys, mut seg_values) = (Vec::with_capacity(n * d), Vec::with_capacity(n * d));
    let mut positions = Vec::with_capacity(n);
    let mut wide_value = vec![0.0f32; d];
    let mut metas = Vec::with_capacity(sizes.len());
    let mut start = 0u32;
    for &size in sizes {
        let end = start + size;
        let out_start = positions.len() as u32;
        let mut centroid = vec![0.0f32; d];
        let mut value_mean = vec![0.0f32; d];
        for &row in &order[start as usize..end as usize] {
            let r = row as usize;
            seg_keys.extend_from_slice(&keys[r * d..(r + 1) * d]);
            seg_values.extend_from_slice(&values[r * d..(r + 1) * d]);
            positions.push(first_position + row);
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
    (HeadSegment { rows: SegmentRows::Plain { keys: seg_keys, values: seg_values }, positions }, metas)
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
        let SegmentRows::Plain { keys: seg_keys, .. } = &seg.rows else { panic!("a built segment is plain") };
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
                        assert_eq!(seg_keys[r as usize * d + j], keys[orig * d + j]);
                        keys[orig * d + j]
                    })
                    .sum::<f32>()
                    / (m.end - m.start) as f32;
                assert!((mean - m.centroid[j]).abs() < 1e-5);
            }
        }
    }
}
