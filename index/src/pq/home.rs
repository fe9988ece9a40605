//! The encoded home of a `hack2` PQ index ([`EncodedHome`]): what a checkpoint writes so
//! that its base rows live on disk in 2-bit form only, and how recovery puts the index back
//! together from it with nothing re-encoded or retrained.
//!
//! The base rows past the sink are one 2-bit run per KV head, quantized once when the
//! codebook build started. A home cuts that run into segments of [`HOME_SEGMENT_BLOCKS`]
//! value blocks (8192 rows at Π = 64: 5.4 MB for 8 KV heads of d = 128), so no segment file
//! approaches the 64 MiB record limit at any context length, and a later checkpoint writes
//! none of them again (the base never changes). The sink rows and every token after the
//! base (decode tokens stay in the plain type) are the home's steady rows. The codebooks
//! and codes are the index's [`crate::PqSnapshot`]: a checkpoint keeps them as the layer's
//! index layout, and a restore takes them in [`EncodedHome::pq`].

use super::build::BuildSlot;
use super::codes::PackedCodes;
use super::PqIndex;
use crate::codec::EncodedRows;
use crate::encoded::{EncodedHead, EncodedHome, EncodedSegment, SteadyHead};
use crate::error::{Error, Result};
use attnstore_kernels::{DType, Element, HackRows, HackView};
use std::sync::Arc;
use std::time::Instant;

/// Value blocks per segment of a PQ index's encoded home.
pub(crate) const HOME_SEGMENT_BLOCKS: usize = 128;

impl<E: Element> PqIndex<E> {
    /// Rows per home segment (`None` without the `hack2` codec).
    fn home_segment_rows(&self) -> Option<usize> {
        self.codec.hack().map(|p| p.partition * HOME_SEGMENT_BLOCKS)
    }

    /// Segments of the encoded home a checkpoint would write: `None` unless the index
    /// stores its base rows in 2-bit form (`hack2` with f16 plain rows) and its codebooks
    /// are trained (until then the data file stays the layer's home).
    pub fn encoded_segments(&self) -> Option<usize> {
        let per = self.home_segment_rows()?;
        if E::DTYPE != DType::F16 || self.built().is_none() {
            return None;
        }
        let rows = self.heads.first()?.hack.as_ref()?.rows();
        Some(rows.div_ceil(per))
    }

    /// The index in the form a checkpoint keeps for a `hack2` context: the sink and every
    /// token after the base as plain rows, and home segments `from_segment..` of the base
    /// rows in 2-bit form. The codebooks are not in it ([`EncodedHome::pq`] is `None`): they
    /// are the index's layout. `None` where [`PqIndex::encoded_segments`] is.
    pub fn encoded_home(&self, from_segment: usize) -> Option<Result<EncodedHome>> {
        let count = self.encoded_segments()?;
        let per = self.home_segment_rows()?;
        let steady = self
            .heads
            .iter()
            .map(|kv| SteadyHead::of(&kv.base_keys, &kv.base_values, &kv.tail_keys, &kv.tail_values))
            .collect();
        let base = self.heads[0].hack.as_ref().map_or(0, HackRows::rows);
        let mut segments = Vec::with_capacity(count.saturating_sub(from_segment));
        for u in from_segment..count {
            let rows = u * per..((u + 1) * per).min(base);
            let mut heads = Vec::with_capacity(self.kv_heads);
            for kv in &self.heads {
                let Some(coded) = &kv.hack else { return None };
                let view = match coded.view_rows(rows.clone()) {
                    Ok(v) => v,
                    Err(e) => return Some(Err(e.into())),
                };
                heads.push(EncodedHead {
                    sizes: Vec::new(),
                    positions: Vec::new(),
                    centroids: Vec::new(),
                    value_means: Vec::new(),
                    rows: EncodedRows::Hack(view.to_rows()),
                });
            }
            let first = (self.base_sink + rows.start) as u64;
            segments.push(EncodedSegment { first, len: rows.len() as u64, heads });
        }
        Some(Ok(EncodedHome {
            tokens: self.tokens as u64,
            sink_len: self.base_sink as u64,
            tail_start: self.base_len as u64,
            segment_count: count,
            steady,
            segments,
            pq: None,
        }))
    }

    /// Rebuilds this empty `hack2` index from a checkpointed [`EncodedHome`] holding every
    /// segment and its codebooks ([`EncodedHome::pq`]): the same 2-bit rows, plain rows,
    /// codebooks, codes and answers as the index it was taken from. Decode tokens that had
    /// left the local window are encoded again with the restored codebooks (nearest
    /// centroids: the same codes). Anything that does not fit (zones, segments that do not
    /// tile the base rows in whole value blocks, row counts, codec parameters, the snapshot's
    /// own checks, non-finite plain rows) is a typed error and changes nothing.
    pub fn restore_encoded(&mut self, home: EncodedHome) -> Result<()> {
        let started = Instant::now();
        let bad = |message: String| Error::InvalidParameter { what: "encoded pq index", message };
        let Some(hack) = self.codec.hack() else { return Err(bad("the index does not store 2-bit rows".into())) };
        if E::DTYPE != DType::F16 {
            return Err(bad(format!("2-bit rows go with f16 plain rows, this index keeps {:?}", E::DTYPE)));
        }
        if self.tokens > 0 {
            return Err(bad("only an empty index can be restored".into()));
        }
        let Some(snapshot) = &home.pq else {
            return Err(bad("it carries no codebooks (the layer's pq layout is needed with its rows)".into()));
        };
        if home.segments.len() != home.segment_count {
            return Err(bad(format!(
                "it carries {} of its {} segments: a restore needs all of them",
                home.segments.len(),
                home.segment_count
            )));
        }
        let (h, d) = (self.kv_heads, self.head_dim);
        let (sink, base, tokens) = (home.sink_len, home.tail_start, home.tokens);
        if snapshot.tokens != base || snapshot.start != sink || tokens < base {
            return Err(bad(format!(
                "zones sink ..{sink}, base ..{base}, tokens {tokens} do not fit its codebooks' base region {}..{} of {} tokens",
                snapshot.start, snapshot.end, snapshot.tokens
            )));
        }
        let (start, built) = self.checked_built(snapshot, started)?;
        let per = self.home_segment_rows().unwrap_or(0);
        let mut next = start as u64;
        for (u, seg) in home.segments.iter().enumerate() {
            let last = u + 1 == home.segments.len();
            let fits = seg.first == next
                && seg.heads.len() == h
                && seg.len > 0
                && (seg.len == per as u64 || (last && seg.len < per as u64));
            if !fits {
                return Err(bad(format!(
                    "segment {u} (tokens {}+{}, {} heads) does not follow token {next} with {h} heads in pieces of {per} rows",
                    seg.first,
                    seg.len,
                    seg.heads.len()
                )));
            }
            for (head, eh) in seg.heads.iter().enumerate() {
                let Some(rows) = eh.rows.hack() else {
                    return Err(bad(format!("segment {u} head {head}: kv43 rows, expected 2-bit rows")));
                };
                if rows.rows() as u64 != seg.len || rows.params() != hack || !eh.sizes.is_empty() {
                    return Err(bad(format!(
                        "segment {u} head {head}: {} rows with Π = {} and {} clusters, expected {} rows with Π = {} and none",
                        rows.rows(),
                        rows.params().partition,
                        eh.sizes.len(),
                        seg.len,
                        hack.partition
                    )));
                }
            }
            next += seg.len;
        }
        if next != base {
            return Err(bad(format!("its segments cover tokens {start}..{next}, the base region ends at {base}")));
        }
        home.check_steady(h, d).map_err(bad)?;
        let coded = (0..h)
            .map(|head| {
                // Every head's rows are 2-bit (checked above).
                let views: Vec<HackView<'_>> =
                    home.segments.iter().filter_map(|s| s.heads[head].rows.hack()).map(HackRows::view).collect();
                HackRows::from_groups(d, hack, &views)
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        // Everything is checked: install.
        for ((kv, st), rows) in self.heads.iter_mut().zip(&home.steady).zip(coded) {
            let [sink_keys, sink_values, tail_keys, tail_values] = st.plain();
            (kv.base_keys, kv.base_values, kv.tail_keys, kv.tail_values) =
                (Arc::new(sink_keys), sink_values, tail_keys, tail_values);
            kv.hack = Some(rows);
        }
        let layout = built.layout;
        self.tokens = tokens as usize;
        self.base_sink = start;
        self.base_len = base as usize;
        self.extra = vec![PackedCodes::new(layout); h];
        self.build = Some(BuildSlot::ready(built));
        if let Err(e) = self.encode_pending() {
            self.emptied()?;
            return Err(e);
        }
        Ok(())
    }
}
