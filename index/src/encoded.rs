//! An index whose rows are stored encoded (the `hack2` codec's 2-bit rows, or `kv43`'s
//! 4-bit keys and 3-bit values), taken apart for a checkpoint and put back together on
//! recovery.
//!
//! A `hack2` wave segment drops its plain rows once they are encoded, so the 2-bit rows,
//! the clusters' mean keys and values, and the rows the index keeps plain (sink, local
//! window, pending tokens) are everything there is of it: a durable engine writes exactly
//! this to disk and frees the plain copy its data files held
//! ([`crate::WaveIndex::encoded_home`], [`crate::WaveIndex::restore_encoded`]).
//!
//! A `hack2` PQ index has the same shape with no clusters: its base rows past the sink, in
//! 2-bit form, cut into pieces ("segments") of whole value blocks so that no file grows past
//! one record; its sink rows and its decode tokens (which stay plain) as the steady rows; and
//! its codebooks and codes in its [`crate::PqSnapshot`], which a checkpoint keeps as the
//! layer's index layout ([`crate::PqIndex::encoded_home`], [`crate::PqIndex::restore_encoded`]).

use crate::codec::EncodedRows;
use attnstore_kernels::Element;
use half::f16;

/// One KV head of one segment in encoded form (a PQ index's segments have no clusters: their
/// sizes, positions and means are empty, their rows in position order).
#[derive(Debug, Clone)]
pub struct EncodedHead {
    /// Tokens of each (non-empty) cluster, in storage order.
    pub sizes: Vec<u32>,
    /// Token positions in storage (cluster) order.
    pub positions: Vec<u32>,
    /// Mean key of every cluster (`clusters × head_dim`), as the directory holds it.
    pub centroids: Vec<f16>,
    /// Mean value of every cluster (`clusters × head_dim`).
    pub value_means: Vec<f16>,
    /// The segment's rows, in storage order.
    pub rows: EncodedRows,
}

/// One segment (tokens `first..first + len`) in encoded form, every KV head.
#[derive(Debug, Clone)]
pub struct EncodedSegment {
    /// First token position.
    pub first: u64,
    /// Tokens.
    pub len: u64,
    /// One entry per KV head.
    pub heads: Vec<EncodedHead>,
}

/// The rows one KV head keeps plain: the sink, then pending and local tokens.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SteadyHead {
    /// Sink keys, `sink_len × head_dim`.
    pub sink_keys: Vec<f16>,
    /// Sink values.
    pub sink_values: Vec<f16>,
    /// Keys of tokens `tail_start..tokens`.
    pub tail_keys: Vec<f16>,
    /// Values of tokens `tail_start..tokens`.
    pub tail_values: Vec<f16>,
}

impl SteadyHead {
    /// One head's plain rows as the index holds them (`E` is f16: a `hack2` context keeps
    /// f16 plain rows, taken bit for bit).
    pub(crate) fn of<E: Element>(sink_keys: &[E], sink_values: &[E], tail_keys: &[E], tail_values: &[E]) -> Self {
        Self {
            sink_keys: halves(sink_keys),
            sink_values: halves(sink_values),
            tail_keys: halves(tail_keys),
            tail_values: halves(tail_values),
        }
    }

    /// The rows in the index's plain type: sink keys, sink values, tail keys, tail values.
    pub(crate) fn plain<E: Element>(&self) -> [Vec<E>; 4] {
        let plain = |x: &[f16]| x.iter().map(|v| E::from_f32(v.to_f32())).collect();
        [plain(&self.sink_keys), plain(&self.sink_values), plain(&self.tail_keys), plain(&self.tail_values)]
    }
}

/// Rows of an f16 index (`E` is f16) as f16 values, bit for bit.
pub(crate) fn halves<E: Element>(x: &[E]) -> Vec<f16> {
    debug_assert_eq!(E::DTYPE, attnstore_kernels::DType::F16);
    bytemuck::cast_slice::<E, u16>(x).iter().map(|&b| f16::from_bits(b)).collect()
}

/// An encoded (`hack2` or `kv43`) index as a checkpoint keeps it: where its zones lie, its
/// plain rows and (from some segment on) its segments in encoded form.
#[derive(Debug, Clone, Default)]
pub struct EncodedHome {
    /// Tokens covered.
    pub tokens: u64,
    /// Tokens in the sink.
    pub sink_len: u64,
    /// First token after the last segment.
    pub tail_start: u64,
    /// Segments the index holds in all.
    pub segment_count: usize,
    /// Plain rows, one entry per KV head.
    pub steady: Vec<SteadyHead>,
    /// Segments `segment_count - segments.len()..`, in order.
    pub segments: Vec<EncodedSegment>,
    /// A PQ index's codebooks and codes, which a restore needs with its rows. A checkpoint
    /// writes them as the layer's index layout (not in the home), so
    /// [`crate::PqIndex::encoded_home`] leaves this `None` and recovery fills it in.
    pub pq: Option<crate::PqSnapshot>,
}

impl EncodedHome {
    /// Checks the plain rows against `heads` KV heads of `d` values: per head the sink
    /// (`sink_len` rows) and the tail (`tokens - tail_start` rows), every value finite; the
    /// error says what did not fit.
    pub(crate) fn check_steady(&self, heads: usize, d: usize) -> std::result::Result<(), String> {
        let (sink, tail) = (self.sink_len as usize, self.tokens.saturating_sub(self.tail_start) as usize);
        if self.steady.len() != heads {
            return Err(format!("plain rows of {} heads, the index has {heads}", self.steady.len()));
        }
        for (head, st) in self.steady.iter().enumerate() {
            let lens = [st.sink_keys.len(), st.sink_values.len(), st.tail_keys.len(), st.tail_values.len()];
            if lens != [sink * d, sink * d, tail * d, tail * d] {
                return Err(format!(
                    "head {head}: plain rows of {lens:?} values, expected sink {sink} and tail {tail} rows of {d}"
                ));
            }
            let rows = [&st.sink_keys, &st.sink_values, &st.tail_keys, &st.tail_values];
            if rows.iter().any(|r| r.iter().any(|x| !x.is_finite())) {
                return Err(format!("head {head}: a plain row holds NaN or Inf"));
            }
        }
        Ok(())
    }

    /// Bytes of the encoded rows and cluster means it carries, and of its plain rows.
    pub fn bytes(&self) -> (usize, usize) {
        let encoded = self
            .segments
            .iter()
            .flat_map(|s| &s.heads)
            .map(|h| h.rows.bytes() + 2 * (h.centroids.len() + h.value_means.len()) + 4 * h.positions.len())
            .sum();
        let steady = self
            .steady
            .iter()
            .map(|h| 2 * (h.sink_keys.len() + h.sink_values.len() + h.tail_keys.len() + h.tail_values.len()))
            .sum();
        (encoded, steady)
    }
}
