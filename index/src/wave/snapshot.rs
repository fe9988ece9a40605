//! What a checkpoint keeps of a wave index and how recovery restores it: the layout (which
//! tokens form each segment and each cluster, [`WaveLayout`]), the encoded home of a
//! `hack2` index, and the restores from them, which rebuild the same index without k-means.

use super::*;
use crate::codec::EncodedRows;
use crate::encoded::{halves, EncodedHead, EncodedSegment, SteadyHead};

/// The structure of a wave index without its rows: which tokens form each segment and, per
/// KV head, its clusters (sizes, and the token positions in cluster order). With the same KV
/// it rebuilds the index exactly, without k-means ([`WaveIndex::restore`]): the index meta
/// data a checkpoint keeps. Centroids and value means are not stored; they are the means of
/// the rows and are recomputed in one pass.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WaveLayout {
    /// Tokens covered.
    pub tokens: u64,
    /// Tokens in the sink.
    pub sink_len: u64,
    /// First token after the last segment (pending and local tokens follow).
    pub tail_start: u64,
    /// Segments in order.
    pub segments: Vec<SegmentLayout>,
}

/// One segment of a [`WaveLayout`]: tokens `first..first + len`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SegmentLayout {
    /// First token position.
    pub first: u64,
    /// Tokens.
    pub len: u64,
    /// One entry per KV head.
    pub heads: Vec<HeadLayout>,
}

/// The clusters of one KV head in one segment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HeadLayout {
    /// Tokens of each (non-empty) cluster, in storage order.
    pub sizes: Vec<u32>,
    /// Token positions in storage (cluster) order.
    pub positions: Vec<u32>,
}

impl<E: Element> WaveIndex<E> {
    /// The index's structure (see [`WaveLayout`]).
    pub fn layout(&self) -> WaveLayout {
        let units = self.heads.first().map_or(0, |s| s.segments.len());
        let mut segments: Vec<SegmentLayout> = (0..units)
            .map(|u| {
                let seg = &self.heads[0].segments[u];
                let first = seg.positions.iter().copied().min().unwrap_or(0);
                SegmentLayout { first: u64::from(first), len: seg.positions.len() as u64, heads: Vec::new() }
            })
            .collect();
        for store in &self.heads {
            let mut sizes = vec![Vec::new(); units];
            for (span, &size) in store.dir.spans.iter().zip(&store.dir.sizes) {
                sizes[span.unit as usize].push(size);
            }
            for (u, sizes) in sizes.into_iter().enumerate() {
                segments[u].heads.push(HeadLayout { sizes, positions: store.segments[u].positions.clone() });
            }
        }
        WaveLayout {
            tokens: self.tokens as u64,
            sink_len: self.sink_len as u64,
            tail_start: self.tail_start as u64,
            segments,
        }
    }

    /// Rebuilds this empty index from `layout` and the KV it covers (`kv_heads × tokens ×
    /// head_dim`, the tokens the layout was taken over): the same segments, clusters, rows
    /// and 2-bit codes as the index the layout came from, without k-means. A layout that
    /// does not fit (wrong sizes, positions that are not a permutation of their segment,
    /// segments that do not tile the indexed range) is a typed error and changes nothing.
    pub fn restore(&mut self, layout: &WaveLayout, keys: &[f32], values: &[f32]) -> Result<()> {
        let bad = |message: String| Error::InvalidParameter { what: "wave layout", message };
        let (h, d) = (self.kv_heads, self.head_dim);
        let n = batch_tokens(h, d, keys, values)?;
        if n as u64 != layout.tokens {
            return Err(bad(format!("the layout covers {} tokens, the KV given has {n}", layout.tokens)));
        }
        self.check_layout(layout)?;
        let (sink_len, tail_start) = (layout.sink_len as usize, layout.tail_start as usize);
        let jobs: Vec<(usize, usize)> =
            (0..h).flat_map(|hh| (0..layout.segments.len()).map(move |u| (hh, u))).collect();
        let built = jobs
            .par_iter()
            .map(|&(hh, u)| {
                let seg = &layout.segments[u];
                let hl = &seg.heads[hh];
                let rows = (hh * n + seg.first as usize) * d..(hh * n + (seg.first + seg.len) as usize) * d;
                let (mut k, mut v) = (Vec::new(), Vec::new());
                push_narrow(&mut k, &keys[rows.clone()]);
                push_narrow(&mut v, &values[rows]);
                let mut wide = vec![0.0f32; k.len()];
                E::widen(&k, &mut wide);
                let order: Vec<u32> = hl.positions.iter().map(|&p| p - seg.first as u32).collect();
                let (mut built, metas) = assemble_segment(&k, &v, &wide, seg.first as u32, d, &order, &hl.sizes);
                built.encode(self.codec, d, self.segment_seed(u, hh) ^ 0x4841_434b)?;
                Ok((built, metas))
            })
            .collect::<Result<Vec<_>>>()?;
        self.push_segments(&jobs, 0, built)?;
        self.push_steady(keys, values, n, sink_len, tail_start);
        (self.tokens, self.sink_len, self.tail_start) = (n, sink_len, tail_start);
        Ok(())
    }

    /// The index in the form a checkpoint keeps for a `hack2` context: its zones, the rows
    /// it keeps plain, and segments `from_segment..` in 2-bit form with their clusters'
    /// mean keys and values (read back from the buffer manager where they are homed there,
    /// which can fail). `None` when its segments are not 2-bit (plain rows: their data files
    /// are their home).
    pub fn encoded_home(&self, from_segment: usize) -> Option<Result<EncodedHome>> {
        if !self.codec.is_encoded() || E::DTYPE != attnstore_kernels::DType::F16 {
            return None; // an encoded context's plain type is f16 (ContextSpec checks it)
        }
        let d = self.head_dim;
        let steady = self
            .heads
            .iter()
            .map(|s| SteadyHead::of(&s.sink_keys, &s.sink_values, &s.tail_keys, &s.tail_values))
            .collect();
        let segment_count = self.heads.first().map_or(0, |s| s.segments.len());
        let layout = self.layout();
        let mut segments = Vec::new();
        for (u, seg) in layout.segments.into_iter().enumerate().skip(from_segment) {
            let mut heads = Vec::with_capacity(self.kv_heads);
            for (h, (store, hl)) in self.heads.iter().zip(seg.heads).enumerate() {
                // The directory lists each head's clusters segment by segment.
                let ids: Vec<usize> = (0..store.dir.len()).filter(|&i| store.dir.spans[i].unit as usize == u).collect();
                let clusters = ids.first().map_or(0..0, |&a| a..a + ids.len());
                let rows = match store.segments[u].home_rows(self.home.as_deref().map(|b| (b, h))) {
                    Ok(Some(rows)) => rows,
                    Ok(None) => return None,
                    Err(e) => return Some(Err(e)),
                };
                heads.push(EncodedHead {
                    sizes: hl.sizes,
                    positions: hl.positions,
                    centroids: halves(&store.dir.centroids[clusters.start * d..clusters.end * d]),
                    value_means: halves(&store.dir.value_means[clusters.start * d..clusters.end * d]),
                    rows,
                });
            }
            segments.push(EncodedSegment { first: seg.first, len: seg.len, heads });
        }
        Some(Ok(EncodedHome {
            tokens: self.tokens as u64,
            sink_len: self.sink_len as u64,
            tail_start: self.tail_start as u64,
            segment_count,
            steady,
            segments,
            pq: None,
        }))
    }

    /// Rebuilds this empty `hack2` index from a checkpointed [`EncodedHome`] holding every
    /// segment: the same segments, clusters, 2-bit rows, cluster means and plain rows as the
    /// index it was taken from, with nothing recomputed. Anything that does not fit (zones,
    /// cluster sizes and positions, array lengths, codec parameters, non-finite plain rows)
    /// is a typed error and changes nothing.
    pub fn restore_encoded(&mut self, home: EncodedHome) -> Result<()> {
        let bad = |message: String| Error::InvalidParameter { what: "encoded wave index", message };
        if !self.codec.is_encoded() {
            return Err(bad("the index does not store encoded segments".into()));
        }
        if E::DTYPE != attnstore_kernels::DType::F16 {
            return Err(bad(format!("encoded segments go with f16 plain rows, this index keeps {:?}", E::DTYPE)));
        }
        if home.segments.len() != home.segment_count {
            return Err(bad(format!(
                "it carries {} of its {} segments: a restore needs all of them",
                home.segments.len(),
                home.segment_count
            )));
        }
        let layout = WaveLayout {
            tokens: home.tokens,
            sink_len: home.sink_len,
            tail_start: home.tail_start,
            segments: home
                .segments
                .iter()
                .map(|s| SegmentLayout {
                    first: s.first,
                    len: s.len,
                    heads: s
                        .heads
                        .iter()
                        .map(|h| HeadLayout { sizes: h.sizes.clone(), positions: h.positions.clone() })
                        .collect(),
                })
                .collect(),
        };
        self.check_layout(&layout)?;
        let (h, d) = (self.kv_heads, self.head_dim);
        let sink = home.sink_len as usize;
        home.check_steady(h, d).map_err(bad)?;
        let mut jobs = Vec::new();
        let mut built = Vec::new();
        for (u, seg) in home.segments.into_iter().enumerate() {
            for (head, eh) in seg.heads.into_iter().enumerate() {
                let clusters = eh.sizes.len();
                if eh.centroids.len() != clusters * d || eh.value_means.len() != clusters * d {
                    return Err(bad(format!(
                        "segment {u} head {head}: {} centroid and {} value-mean values for {clusters} clusters of {d}",
                        eh.centroids.len(),
                        eh.value_means.len()
                    )));
                }
                if eh.centroids.iter().chain(&eh.value_means).any(|x| !x.is_finite()) {
                    return Err(bad(format!("segment {u} head {head}: a cluster mean holds NaN or Inf")));
                }
                let fits = eh.rows.rows() as u64 == seg.len
                    && match &eh.rows {
                        EncodedRows::Hack(r) => Some(r.params()) == self.codec.hack(),
                        EncodedRows::Kv43(r) => Some(r.params()) == self.codec.kv43() && r.head_dim() == d,
                    };
                if !fits {
                    return Err(bad(format!(
                        "segment {u} head {head}: {} rows of {:?}, expected {} rows of {:?} (d = {d})",
                        eh.rows.rows(),
                        eh.rows,
                        seg.len,
                        self.codec
                    )));
                }
                let mut metas = Vec::with_capacity(clusters);
                let mut start = 0u32;
                for (c, &size) in eh.sizes.iter().enumerate() {
                    let wide = |x: &[f16]| x[c * d..(c + 1) * d].iter().map(|v| v.to_f32()).collect();
                    metas.push(ClusterMeta {
                        start,
                        end: start + size,
                        centroid: wide(&eh.centroids),
                        value_mean: wide(&eh.value_means),
                    });
                    start += size;
                }
                let rows = match eh.rows {
                    EncodedRows::Hack(r) => SegmentRows::Encoded(Box::new(r)),
                    EncodedRows::Kv43(r) => SegmentRows::Kv43(Box::new(r)),
                };
                let segment = HeadSegment { positions: eh.positions, rows };
                jobs.push((head, u));
                built.push((segment, metas));
            }
        }
        // Segment-major order keeps each head's segments in order, as `push_segments` needs.
        self.push_segments(&jobs, 0, built)?;
        for (store, st) in self.heads.iter_mut().zip(&home.steady) {
            [store.sink_keys, store.sink_values, store.tail_keys, store.tail_values] = st.plain();
        }
        (self.tokens, self.sink_len, self.tail_start) = (home.tokens as usize, sink, home.tail_start as usize);
        Ok(())
    }

    /// Checks that `layout` fits this empty index: its sink, segments that tile the indexed
    /// range in order, and per head cluster sizes and positions that cover each segment's
    /// tokens once.
    fn check_layout(&self, layout: &WaveLayout) -> Result<()> {
        let bad = |message: String| Error::InvalidParameter { what: "wave layout", message };
        if self.tokens > 0 {
            return Err(bad("only an empty index can be restored".into()));
        }
        let (h, n) = (self.kv_heads, layout.tokens as usize);
        let sink = self.params.sink_tokens.min(n);
        if layout.sink_len != sink as u64 || layout.tail_start < layout.sink_len || layout.tail_start > layout.tokens {
            return Err(bad(format!(
                "sink {} and tail start {} do not fit {n} tokens with a sink of {sink}",
                layout.sink_len, layout.tail_start
            )));
        }
        let mut next = layout.sink_len;
        for (u, seg) in layout.segments.iter().enumerate() {
            if seg.first != next || seg.len == 0 || seg.heads.len() != h {
                return Err(bad(format!(
                    "segment {u} (tokens {}+{}, {} heads) does not follow token {next} with {h} heads",
                    seg.first,
                    seg.len,
                    seg.heads.len()
                )));
            }
            for (head, hl) in seg.heads.iter().enumerate() {
                let mut seen = vec![false; seg.len as usize];
                let fits = hl.positions.len() as u64 == seg.len
                    && hl.sizes.iter().all(|&s| s > 0)
                    && hl.sizes.iter().map(|&s| u64::from(s)).sum::<u64>() == seg.len
                    && hl.positions.iter().all(|&p| {
                        let r = u64::from(p).wrapping_sub(seg.first);
                        r < seg.len && !std::mem::replace(&mut seen[r as usize], true)
                    });
                if !fits {
                    return Err(bad(format!(
                        "segment {u} head {head}: cluster sizes or positions do not cover its tokens once"
                    )));
                }
            }
            next += seg.len;
        }
        if next != layout.tail_start {
            return Err(bad(format!(
                "segments end at token {next}, the layout's tail starts at {}",
                layout.tail_start
            )));
        }
        Ok(())
    }
}

impl<E: Element> Snapshots for WaveIndex<E> {
    fn layout(&self) -> Option<IndexLayout> {
        Some(IndexLayout::Wave(WaveIndex::layout(self)))
    }

    fn layout_end(&self) -> Option<u64> {
        Some(self.tail_start as u64)
    }

    fn restore(&mut self, layout: &IndexLayout, keys: &[f32], values: &[f32]) -> Result<bool> {
        let IndexLayout::Wave(layout) = layout else { return Err(layout.wrong_method("wave")) };
        WaveIndex::restore(self, layout, keys, values)?;
        Ok(true)
    }

    fn encoded_segments(&self) -> Option<usize> {
        self.codec.is_encoded().then(|| self.heads.first().map_or(0, |s| s.segments.len()))
    }

    fn encoded_home(&self, from_segment: usize) -> Option<Result<EncodedHome>> {
        WaveIndex::encoded_home(self, from_segment)
    }

    fn restore_encoded(&mut self, home: EncodedHome) -> Result<bool> {
        WaveIndex::restore_encoded(self, home)?;
        Ok(true)
    }
}
