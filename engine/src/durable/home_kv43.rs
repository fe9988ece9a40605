//! kv43 segment files: a `kv43` wave or PQ layer's encoded home (`home.rs`). Per KV head
//! the segment's clusters (sizes, token positions, f16 mean keys and values; none for a PQ
//! layer's pieces of its base) and its rows as [`Kv43Head`] keeps them — 4-bit key codes
//! (and fifth bits with 5-bit keys), 3- or 4-bit value planes, their per-channel minima and
//! scales and key code sums, and the segment's last partial key group in f16 — checked back
//! by [`Kv43Head::from_arrays`] when read. Same file names, frames and checksums as
//! the 2-bit segment files; the context's codec says which record a file holds.

use attnstore_index::{EncodedHead, EncodedRows, EncodedSegment};
use attnstore_kernels::{Kv43Arrays, Kv43Head, Kv43Params};
use serde::{Deserialize, Serialize};

use super::home::{
    bytes_to_halves, bytes_to_positions, bytes_to_u16s, halves_to_bytes, positions_to_bytes, row_count, u16s_to_bytes,
};

/// One kv43 segment file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Kv43SegmentRecord {
    pub context: u64,
    pub layer: u32,
    pub unit: u32,
    pub first: u64,
    pub len: u64,
    pub head_dim: u32,
    pub key_group: u32,
    pub value_block: u32,
    pub heads: Vec<Kv43HeadRecord>,
}

/// One KV head of a kv43 segment file; arrays little-endian.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Kv43HeadRecord {
    sizes: Vec<u32>,
    /// u32 token positions.
    #[serde(with = "serde_bytes")]
    positions: Vec<u8>,
    /// f16 mean keys and values, `clusters × head_dim`.
    #[serde(with = "serde_bytes")]
    centroids: Vec<u8>,
    #[serde(with = "serde_bytes")]
    value_means: Vec<u8>,
    /// Encoded rows (whole key groups).
    rows: u64,
    /// The codes' low four bits (`rows × d / 2` bytes), then with 5-bit keys their fifth
    /// bits (`rows × d / 8`); the context's codec says which.
    #[serde(with = "serde_bytes")]
    key_codes: Vec<u8>,
    /// f16 per key group and channel.
    #[serde(with = "serde_bytes")]
    key_min: Vec<u8>,
    #[serde(with = "serde_bytes")]
    key_scale: Vec<u8>,
    /// u16 per row and 64-channel partition.
    #[serde(with = "serde_bytes")]
    key_sums: Vec<u8>,
    #[serde(with = "serde_bytes")]
    value_planes: Vec<u8>,
    /// f16 per value block and channel.
    #[serde(with = "serde_bytes")]
    value_min: Vec<u8>,
    #[serde(with = "serde_bytes")]
    value_scale: Vec<u8>,
    /// f16 rows of the partial key group after the encoded rows.
    #[serde(with = "serde_bytes")]
    tail_keys: Vec<u8>,
    #[serde(with = "serde_bytes")]
    tail_values: Vec<u8>,
}

impl Kv43HeadRecord {
    /// The record of one head whose rows are `rows`.
    pub fn new(h: &EncodedHead, rows: &Kv43Head) -> Self {
        let a = rows.arrays();
        Self {
            sizes: h.sizes.clone(),
            positions: positions_to_bytes(&h.positions),
            centroids: halves_to_bytes(&h.centroids),
            value_means: halves_to_bytes(&h.value_means),
            rows: a.rows as u64,
            key_codes: [a.key_codes, a.key_high].concat(),
            key_min: halves_to_bytes(a.key_min),
            key_scale: halves_to_bytes(a.key_scale),
            key_sums: u16s_to_bytes(a.key_sums),
            value_planes: a.value_planes.to_vec(),
            value_min: halves_to_bytes(a.value_min),
            value_scale: halves_to_bytes(a.value_scale),
            tail_keys: halves_to_bytes(a.tail_keys),
            tail_values: halves_to_bytes(a.tail_values),
        }
    }

    /// The head it records, checked ([`Kv43Head::from_arrays`]); the error says what did not fit.
    fn head(self, d: usize, params: Kv43Params) -> std::result::Result<EncodedHead, String> {
        let positions = bytes_to_positions(&self.positions)?;
        let rows = row_count(self.rows)?;
        let halves = |x: &[u8], what| bytes_to_halves(x, what);
        let (key_min, key_scale) = (halves(&self.key_min, "key minima")?, halves(&self.key_scale, "key scales")?);
        let key_sums = bytes_to_u16s(&self.key_sums, "key code sums")?;
        let (value_min, value_scale) =
            (halves(&self.value_min, "value minima")?, halves(&self.value_scale, "value scales")?);
        let (tail_keys, tail_values) =
            (halves(&self.tail_keys, "partial group keys")?, halves(&self.tail_values, "partial group values")?);
        // The nibbles, then any fifth bits; a length that fits neither is reported by the check.
        let nibbles = (rows.saturating_mul(d) / 2).min(self.key_codes.len());
        let (key_codes, key_high) = self.key_codes.split_at(nibbles);
        let arrays = Kv43Arrays {
            rows,
            key_codes,
            key_high,
            key_min: &key_min,
            key_scale: &key_scale,
            key_sums: &key_sums,
            value_planes: &self.value_planes,
            value_min: &value_min,
            value_scale: &value_scale,
            tail_keys: &tail_keys,
            tail_values: &tail_values,
        };
        let rows = Kv43Head::from_arrays(d, params, arrays).map_err(|e| e.to_string())?;
        Ok(EncodedHead {
            sizes: self.sizes,
            positions,
            centroids: halves(&self.centroids, "centroids")?,
            value_means: halves(&self.value_means, "value means")?,
            rows: EncodedRows::Kv43(rows),
        })
    }
}

impl Kv43SegmentRecord {
    /// The file's segment, for segment `unit` of (`context`, `layer`) with `kv_heads` heads of
    /// `head_dim` and parameters `params`: anything else is an error saying what it holds.
    pub fn segment(
        self,
        (context, layer, unit): (u64, usize, usize),
        (kv_heads, head_dim): (usize, usize),
        params: Kv43Params,
    ) -> std::result::Result<EncodedSegment, String> {
        let fits = (self.context, self.layer, self.unit as usize, self.head_dim as usize, self.heads.len())
            == (context, layer as u32, unit, head_dim, kv_heads)
            && (self.key_group as usize, self.value_block as usize) == (params.key_group, params.value_block);
        if !fits {
            return Err(format!(
                "kv43 segment {} of context {} layer {} ({} heads, d = {}, key groups of {}, value blocks of {}) does not fit",
                self.unit,
                self.context,
                self.layer,
                self.heads.len(),
                self.head_dim,
                self.key_group,
                self.value_block
            ));
        }
        let heads = self.heads.into_iter().map(|h| h.head(head_dim, params)).collect::<Result<Vec<_>, String>>()?;
        Ok(EncodedSegment { first: self.first, len: self.len, heads })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnstore_index::{AccessMethod, RowCodec, WaveIndex, WaveParams};
    use attnstore_kernels::random::SplitMix64;
    use half::f16;

    /// A kv43 wave index's first segment as a file's record, and the index's shape.
    fn record() -> (Kv43SegmentRecord, Kv43Params) {
        let (heads, d) = (2, 64);
        let params = Kv43Params::default();
        let wave =
            WaveParams { segment_tokens: 300, decode_segment_tokens: 100, local_tokens: 8, ..WaveParams::default() };
        let mut w = WaveIndex::<f16>::new(wave, heads, d).unwrap().with_codec(RowCodec::Kv43(params)).unwrap();
        let mut rng = SplitMix64::new(5);
        w.prefill(&rng.normals(heads * 320 * d), &rng.normals(heads * 320 * d)).unwrap();
        let home = w.encoded_home(0).unwrap().unwrap();
        let seg = &home.segments[0];
        let heads = seg
            .heads
            .iter()
            .map(|h| match &h.rows {
                EncodedRows::Kv43(r) => Kv43HeadRecord::new(h, r),
                EncodedRows::Hack(_) => panic!("kv43 rows"),
            })
            .collect();
        let r = Kv43SegmentRecord {
            context: 3,
            layer: 0,
            unit: 0,
            first: seg.first,
            len: seg.len,
            head_dim: d as u32,
            key_group: params.key_group as u32,
            value_block: params.value_block as u32,
            heads,
        };
        (r, params)
    }

    #[test]
    fn a_kv43_segment_record_reads_back_and_one_that_does_not_fit_says_why() {
        let (r, params) = record();
        let seg = r.clone().segment((3, 0, 0), (2, 64), params).unwrap();
        assert_eq!(seg.heads.len(), 2);
        assert!(
            matches!(&seg.heads[0].rows, EncodedRows::Kv43(h) if h.rows() as u64 == seg.len && h.encoded_rows() > 0)
        );
        let why = r.clone().segment((3, 0, 1), (2, 64), params).unwrap_err();
        assert!(why.contains("does not fit"), "{why}");
        let why = r.clone().segment((3, 0, 0), (2, 64), Kv43Params::with_key_group(256).unwrap()).unwrap_err();
        assert!(why.contains("key groups of 128"), "{why}");
        let mut bad = r.clone();
        bad.heads[1].key_codes[5] ^= 0x01;
        let why = bad.segment((3, 0, 0), (2, 64), params).unwrap_err();
        assert!(why.contains("stored key code sum"), "{why}");
        let mut bad = r;
        bad.heads[0].tail_keys.pop();
        let why = bad.segment((3, 0, 0), (2, 64), params).unwrap_err();
        assert!(why.contains("2-byte values"), "{why}");
    }
}
