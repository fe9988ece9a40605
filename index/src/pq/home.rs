//! The encoded home of a `hack2` or `kv43` PQ index ([`EncodedHome`]): what a checkpoint
//! writes so that its base rows live on disk in encoded form only, and how recovery puts
//! the index back together from it with nothing re-encoded or retrained.
//!
//! The base rows past the sink are one encoded run per KV head, quantized once when the
//! codebook build started. A home cuts that run into segments: [`HOME_SEGMENT_BLOCKS`]
//! value blocks of 2-bit rows (8192 rows at Π = 64: 5.4 MB for 8 KV heads of d = 128), or
//! whole kv43 key groups of about [`KV43_HOME_SEGMENT_ROWS`] rows (8192 at 128-token groups:
//! 8.4 MB for 8 KV heads of d = 128; the last segment ends in the base's partial key group,
//! in f16), so no segment file approaches the 64 MiB record limit at any context length,
//! and a later checkpoint writes none of them again (the base never changes). The sink rows
//! and every token after the base (decode tokens stay in the plain type) are the home's
//! steady rows. The codebooks and codes are the index's [`crate::PqSnapshot`]: a checkpoint
//! keeps them as the layer's index layout, and a restore takes them in [`EncodedHome::pq`].

use super::build::BuildSlot;
use super::codes::PackedCodes;
use super::PqIndex;
use crate::codec::{EncodedRows, RowCodec};
use crate::encoded::{EncodedHead, EncodedHome, EncodedSegment, SteadyHead};
use crate::error::{Error, Result};
use crate::kv43_pieces::kv43_piece;
use attnstore_kernels::{DType, Element, HackRows, HackView, Kv43Head};
use std::sync::Arc;
use std::time::Instant;

/// Value blocks per segment of a `hack2` PQ index's encoded home.
pub(crate) const HOME_SEGMENT_BLOCKS: usize = 128;

/// Rows per segment of a `kv43` PQ index's encoded home, rounded down to whole key groups
/// (at least one).
pub(crate) const KV43_HOME_SEGMENT_ROWS: usize = 8192;

impl<E: Element> PqIndex<E> {
    /// Rows per home segment (`None` for plain rows).
    fn home_segment_rows(&self) -> Option<usize> {
        match self.codec {
            RowCodec::Hack2(p) => Some(p.partition * HOME_SEGMENT_BLOCKS),
            RowCodec::Kv43(p) => Some(p.key_group * (KV43_HOME_SEGMENT_ROWS / p.key_group).max(1)),
            RowCodec::Plain => None,
        }
    }

    /// Segments of the encoded home a checkpoint would write: `None` unless the index
    /// stores its base rows encoded (`hack2` or `kv43` with f16 plain rows) and its
    /// codebooks are trained (until then the data file stays the layer's home).
    pub fn encoded_segments(&self) -> Option<usize> {
        let per = self.home_segment_rows()?;
        if E::DTYPE != DType::F16 || self.built().is_none() {
            return None;
        }
        let rows = self.heads.first()?.coded.as_ref()?.rows();
        Some(rows.div_ceil(per))
    }

    /// The index in the form a checkpoint keeps for an encoded context: the sink and every
    /// token after the base as plain rows, and home segments `from_segment..` of the base
    /// rows in encoded form (2-bit value blocks, or kv43 key groups with the base's partial
    /// group in the last). The codebooks are not in it ([`EncodedHome::pq`] is `None`):
    /// they are the index's layout. `None` where [`PqIndex::encoded_segments`] is.
    pub fn encoded_home(&self, from_segment: usize) -> Option<Result<EncodedHome>> {
        let count = self.encoded_segments()?;
        let per = self.home_segment_rows()?;
        let steady = self
            .heads
            .iter()
            .map(|kv| SteadyHead::of(&kv.base_keys, &kv.base_values, &kv.tail_keys, &kv.tail_values))
            .collect();
        let base = self.heads[0].coded.as_ref().map_or(0, EncodedRows::rows);
        let mut segments = Vec::with_capacity(count.saturating_sub(from_segment));
        for u in from_segment..count {
            let rows = u * per..((u + 1) * per).min(base);
            let mut heads = Vec::with_capacity(self.kv_heads);
            for kv in &self.heads {
                let piece = match kv.coded.as_ref()? {
                    EncodedRows::Hack(coded) => {
                        coded.view_rows(rows.clone()).map(|v| EncodedRows::Hack(v.to_rows())).map_err(Error::from)
                    }
                    EncodedRows::Kv43(coded) => kv43_piece(coded, rows.clone()).map(EncodedRows::Kv43),
                };
                let rows = match piece {
                    Ok(rows) => rows,
                    Err(e) => return Some(Err(e)),
                };
                heads.push(EncodedHead {
                    sizes: Vec::new(),
                    positions: Vec::new(),
                    centroids: Vec::new(),
                    value_means: Vec::new(),
                    rows,
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

    /// Rebuilds this empty `hack2` or `kv43` index from a checkpointed [`EncodedHome`]
    /// holding every segment and its codebooks ([`EncodedHome::pq`]): the same encoded rows,
    /// plain rows, codebooks, codes and answers as the index it was taken from. Decode
    /// tokens that had left the local window are encoded again with the restored codebooks
    /// (nearest centroids of the keys the codes stand for: the same codes). Anything that
    /// does not fit (zones, segments that do not tile the base rows in whole value blocks or
    /// key groups, row counts, codec parameters, the snapshot's own checks, non-finite plain
    /// rows) is a typed error and changes nothing.
    pub fn restore_encoded(&mut self, home: EncodedHome) -> Result<()> {
        let started = Instant::now();
        let bad = |message: String| Error::InvalidParameter { what: "encoded pq index", message };
        if !self.codec.is_encoded() {
            return Err(bad("the index does not store encoded rows".into()));
        }
        if E::DTYPE != DType::F16 {
            return Err(bad(format!("encoded rows go with f16 plain rows, this index keeps {:?}", E::DTYPE)));
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
                self.check_piece(&eh.rows, eh.sizes.len(), seg.len, last)
                    .map_err(|why| bad(format!("segment {u} head {head}: {why}")))?;
            }
            next += seg.len;
        }
        if next != base {
            return Err(bad(format!("its segments cover tokens {start}..{next}, the base region ends at {base}")));
        }
        home.check_steady(h, d).map_err(bad)?;
        let coded = (0..h)
            .map(|head| -> Result<EncodedRows> {
                // Every head's rows are of the index's codec (checked above).
                let pieces = home.segments.iter().map(|s| &s.heads[head].rows);
                match self.codec {
                    RowCodec::Kv43(p) => {
                        let pieces: Vec<&Kv43Head> = pieces.filter_map(EncodedRows::kv43).collect();
                        Ok(EncodedRows::Kv43(Kv43Head::join(d, p, &pieces)?))
                    }
                    _ => {
                        let views: Vec<HackView<'_>> =
                            pieces.filter_map(EncodedRows::hack).map(HackRows::view).collect();
                        let hack = self.codec.hack().unwrap_or_default();
                        Ok(EncodedRows::Hack(HackRows::from_groups(d, hack, &views)?))
                    }
                }
            })
            .collect::<Result<Vec<_>>>()?;
        // Everything is checked: install.
        for ((kv, st), rows) in self.heads.iter_mut().zip(&home.steady).zip(coded) {
            let [sink_keys, sink_values, tail_keys, tail_values] = st.plain();
            (kv.base_keys, kv.base_values, kv.tail_keys, kv.tail_values) =
                (Arc::new(sink_keys), sink_values, tail_keys, tail_values);
            kv.coded = Some(rows);
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

    /// Why rows `rows` (with `clusters` clusters) cannot be piece `len` rows long of this
    /// index's home (`last`: the base's last piece, where a kv43 partial group may be).
    fn check_piece(
        &self,
        rows: &EncodedRows,
        clusters: usize,
        len: u64,
        last: bool,
    ) -> std::result::Result<(), String> {
        let d = self.head_dim;
        if clusters != 0 {
            return Err(format!("{clusters} clusters, expected none"));
        }
        match (rows, self.codec) {
            (EncodedRows::Hack(r), RowCodec::Hack2(p)) if r.rows() as u64 != len || r.params() != p => Err(format!(
                "{} rows with Π = {}, expected {len} rows with Π = {}",
                r.rows(),
                r.params().partition,
                p.partition
            )),
            (EncodedRows::Kv43(r), RowCodec::Kv43(p))
                if r.rows() as u64 != len || r.params() != p || r.head_dim() != d =>
            {
                Err(format!(
                    "{} kv43 rows of d = {} with {:?}, expected {len} rows of d = {d} with {p:?}",
                    r.rows(),
                    r.head_dim(),
                    r.params()
                ))
            }
            (EncodedRows::Kv43(r), RowCodec::Kv43(_)) if !last && r.encoded_rows() != r.rows() => {
                Err(format!("{} rows end in a partial key group, which only the last segment may", r.rows()))
            }
            (EncodedRows::Hack(_), RowCodec::Hack2(_)) | (EncodedRows::Kv43(_), RowCodec::Kv43(_)) => Ok(()),
            (EncodedRows::Hack(_), _) => Err("2-bit rows, expected kv43 rows".into()),
            (EncodedRows::Kv43(_), _) => Err("kv43 rows, expected 2-bit rows".into()),
        }
    }
}
