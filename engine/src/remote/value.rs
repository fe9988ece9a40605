//! The values the remote tier stores, each self-describing and checksummed: a 64-byte
//! header, a payload, and a crc32c of everything before it. Decoding checks the length, the
//! checksum, the format, and that the value is the one its key names (chain hash, layer,
//! shape), so a value that was truncated, flipped, evicted half-way or written by another
//! format is refused and never served.
//!
//! ```text
//! 0   magic "ASRV"        4   kind (1 rows, 2 layout, 3 layout list)   5  element type
//! 8   chain hash (32 B)   40  layer   44 first row in the chunk   48 rows (tokens covered
//!                                                                   for a layout)
//! 52  kv_heads            56  head_dim   60 reserved (0)   64 payload ... crc32c (4 B)
//! ```
//!
//! Rows are `kv_heads × rows × head_dim` keys, then values, little-endian in the layer's
//! element type; a layout is the checkpoint's bincode record of it (`durable/layout.rs`);
//! a layout list is the layers' numbers as u32.

use crate::durable::layout::{LayoutRecord, PqRecord};
use crate::durable::records::{decode, encode};
use attnstore_index::IndexLayout;
use attnstore_kernels::{DType, Element};
use half::{bf16, f16};

const MAGIC: &[u8; 4] = b"ASRV";
const HEADER: usize = 64;
const KIND_ROWS: u8 = 1;
const KIND_LAYOUT: u8 = 2;
const KIND_LIST: u8 = 3;

/// Why a fetched value was not used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// The key held nothing (never published, deleted, evicted, or the server restarted).
    Missing,
    /// The value failed its checks: shorter or longer than its header says, a checksum
    /// mismatch, an unknown format, or another chunk's, layer's or shape's value.
    Corrupt,
}

impl Fault {
    /// Name in metrics and reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::Corrupt => "corrupt",
        }
    }
}

/// What a rows value holds: rows `first..first + rows` of a chunk of one layer, kept as
/// the checked value itself (widened to f32 only when copied out, so a fetch makes no copy).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Rows {
    /// First row's offset in the chunk.
    pub first: usize,
    /// Rows held.
    pub rows: usize,
    value: Vec<u8>,
    dtype: DType,
    kv_heads: usize,
    head_dim: usize,
}

impl Rows {
    /// Widens rows `from..to` (of this value's rows) of `head` — keys, or values with
    /// `values` — onto the end of `out`.
    pub fn widen_into(&self, values: bool, head: usize, from: usize, to: usize, out: &mut Vec<f32>) {
        let d = self.head_dim;
        let part = if values { self.kv_heads * self.rows * d } else { 0 };
        let elems = part + (head * self.rows + from) * d..part + (head * self.rows + to) * d;
        let size = self.dtype.size_bytes();
        let bytes = &self.value[HEADER + elems.start * size..HEADER + elems.end * size];
        let at = out.len();
        out.resize(at + elems.len(), 0.0);
        match self.dtype {
            DType::F32 => widen_bytes::<f32>(bytes, &mut out[at..]),
            DType::F16 => widen_bytes::<f16>(bytes, &mut out[at..]),
            DType::Bf16 => widen_bytes::<bf16>(bytes, &mut out[at..]),
        }
    }

    /// All keys and all values, widened (`kv_heads × rows × head_dim` each).
    #[cfg(test)]
    pub fn widened(&self) -> (Vec<f32>, Vec<f32>) {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for h in 0..self.kv_heads {
            self.widen_into(false, h, 0, self.rows, &mut k);
            self.widen_into(true, h, 0, self.rows, &mut v);
        }
        (k, v)
    }
}

/// What a value is expected to be (from its key), checked when it is decoded.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Expect<'a> {
    pub hash: &'a [u8; 32],
    pub layer: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub dtype: DType,
}

fn dtype_code(dtype: DType) -> u8 {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Bf16 => 2,
    }
}

#[allow(clippy::too_many_arguments)]
fn header(kind: u8, dtype: u8, e: &Expect<'_>, first: usize, rows: usize, payload: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + payload + 4);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[kind, dtype, 0, 0]);
    out.extend_from_slice(e.hash);
    for x in [e.layer, first, rows, e.kv_heads, e.head_dim, 0] {
        out.extend_from_slice(&(x as u32).to_le_bytes());
    }
    debug_assert_eq!(out.len(), HEADER);
    out
}

// Rows are stored little-endian by casting the element slices: the machines attnstore runs
// on are all little-endian, and a big-endian build is refused rather than served wrong.
const _: () = assert!(cfg!(target_endian = "little"), "remote values are little-endian element slices");

/// Appends `x` narrowed to `E`, as bytes.
fn put<E: Element>(out: &mut Vec<u8>, x: &[f32]) {
    let at = out.len();
    out.resize(at + std::mem::size_of_val(x) / 4 * std::mem::size_of::<E>(), 0);
    match bytemuck::try_cast_slice_mut::<u8, E>(&mut out[at..]) {
        Ok(dst) => E::narrow(x, dst),
        Err(_) => {
            let mut narrow = vec![E::default(); x.len()];
            E::narrow(x, &mut narrow);
            out[at..].copy_from_slice(bytemuck::cast_slice(&narrow));
        }
    }
}

/// `bytes` (a whole number of `E`s, at any alignment) widened into `out`.
fn widen_bytes<E: Element>(bytes: &[u8], out: &mut [f32]) {
    match bytemuck::try_cast_slice::<u8, E>(bytes) {
        Ok(aligned) => E::widen(aligned, out),
        Err(_) => {
            let mut narrow = vec![E::default(); out.len()];
            bytemuck::cast_slice_mut::<E, u8>(&mut narrow).copy_from_slice(bytes);
            E::widen(&narrow, out);
        }
    }
}

/// Whether every element of `bytes` (little-endian `dtype`) is finite: its exponent bits
/// are not all ones. Read as whole words and folded without early exit, so it vectorizes.
fn all_finite(bytes: &[u8], dtype: DType) -> bool {
    fn none_all_ones<W: bytemuck::Pod + Copy + std::ops::BitAnd<Output = W> + PartialEq>(
        bytes: &[u8],
        mask: W,
    ) -> bool {
        let bad = |acc: bool, w: W| acc | (w & mask == mask);
        match bytemuck::try_cast_slice::<u8, W>(bytes) {
            Ok(words) => !words.iter().fold(false, |acc, &w| bad(acc, w)),
            Err(_) => !bytes
                .chunks_exact(std::mem::size_of::<W>())
                .fold(false, |acc, b| bad(acc, bytemuck::pod_read_unaligned(b))),
        }
    }
    match dtype {
        DType::F32 => none_all_ones::<u32>(bytes, 0x7f80_0000),
        DType::F16 => none_all_ones::<u16>(bytes, 0x7c00),
        DType::Bf16 => none_all_ones::<u16>(bytes, 0x7f80),
    }
}

fn seal(mut out: Vec<u8>) -> Vec<u8> {
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Encodes rows `first..first + rows` of a chunk: `keys`/`values` are `kv_heads × rows ×
/// head_dim` f32, stored in `e.dtype`.
#[cfg(test)]
pub(crate) fn encode_rows(e: &Expect<'_>, first: usize, rows: usize, keys: &[f32], values: &[f32]) -> Vec<u8> {
    encode_row_parts(e, first, rows, &[keys], &[values])
}

/// [`encode_rows`] with the keys and the values each given in pieces (one per head, say),
/// narrowed straight into the value.
pub(crate) fn encode_row_parts(
    e: &Expect<'_>,
    first: usize,
    rows: usize,
    keys: &[&[f32]],
    values: &[&[f32]],
) -> Vec<u8> {
    let n: usize = keys.iter().chain(values).map(|x| x.len()).sum();
    let mut out = header(KIND_ROWS, dtype_code(e.dtype), e, first, rows, n * e.dtype.size_bytes());
    for x in keys.iter().chain(values) {
        match e.dtype {
            DType::F32 => put::<f32>(&mut out, x),
            DType::F16 => put::<f16>(&mut out, x),
            DType::Bf16 => put::<bf16>(&mut out, x),
        }
    }
    seal(out)
}

/// The header fields and payload of a sealed value of `kind`, checked against `e` (the
/// element type only for rows).
fn open<'v>(value: &'v [u8], kind: u8, e: &Expect<'_>) -> Result<([usize; 3], &'v [u8]), Fault> {
    if value.len() < HEADER + 4 {
        return Err(Fault::Corrupt);
    }
    let (body, crc) = value.split_at(value.len() - 4);
    if crc32c::crc32c(body).to_le_bytes() != crc {
        return Err(Fault::Corrupt);
    }
    let word = |at: usize| u32::from_le_bytes(body[at..at + 4].try_into().expect("4 bytes")) as usize;
    let dtype_ok = kind != KIND_ROWS || body[5] == dtype_code(e.dtype);
    if &body[..4] != MAGIC
        || body[4] != kind
        || !dtype_ok
        || &body[8..40] != e.hash
        || word(40) != e.layer
        || word(52) != e.kv_heads
        || word(56) != e.head_dim
    {
        return Err(Fault::Corrupt);
    }
    Ok(([word(44), word(48), 0], &body[HEADER..]))
}

/// Decodes a rows value of the chunk and layer `e` names; `chunk_tokens` bounds its rows.
pub(crate) fn decode_rows(value: Vec<u8>, e: &Expect<'_>, chunk_tokens: usize) -> Result<Rows, Fault> {
    let ([first, rows, _], payload) = open(&value, KIND_ROWS, e)?;
    let n = e.kv_heads * rows * e.head_dim;
    if rows == 0 || first + rows > chunk_tokens || payload.len() != 2 * n * e.dtype.size_bytes() {
        return Err(Fault::Corrupt);
    }
    if !all_finite(payload, e.dtype) {
        return Err(Fault::Corrupt);
    }
    Ok(Rows { first, rows, value, dtype: e.dtype, kv_heads: e.kv_heads, head_dim: e.head_dim })
}

/// Encodes a layout covering `tokens` tokens.
pub(crate) fn encode_layout(e: &Expect<'_>, tokens: usize, layout: &IndexLayout) -> Vec<u8> {
    let payload = match layout {
        IndexLayout::Wave(l) => encode(&LayoutRecord::new(0, e.layer, l)),
        IndexLayout::Pq(s) => encode(&PqRecord::new(0, e.layer, s)),
    };
    let mut out = header(KIND_LAYOUT, u8::MAX, e, 0, tokens, payload.len());
    out.extend_from_slice(&payload);
    seal(out)
}

/// Decodes a layout of access method `method` covering `tokens` tokens.
pub(crate) fn decode_layout(value: &[u8], e: &Expect<'_>, tokens: usize, method: &str) -> Result<IndexLayout, Fault> {
    let ([_, covered, _], payload) = open(value, KIND_LAYOUT, e)?;
    if covered != tokens {
        return Err(Fault::Corrupt);
    }
    let layout = match method {
        "wave" => IndexLayout::Wave(decode::<LayoutRecord>(payload).map_err(|_| Fault::Corrupt)?.layout()),
        "pq" => IndexLayout::Pq(decode::<PqRecord>(payload).map_err(|_| Fault::Corrupt)?.snapshot()),
        _ => return Err(Fault::Corrupt),
    };
    if layout.tokens() != tokens as u64 && method == "wave" {
        return Err(Fault::Corrupt);
    }
    Ok(layout)
}

/// Encodes the list of layers with a layout at a chunk (`e.layer` unused: 0).
pub(crate) fn encode_list(e: &Expect<'_>, layers: &[usize]) -> Vec<u8> {
    let mut out = header(KIND_LIST, u8::MAX, e, 0, layers.len(), 4 * layers.len());
    for &l in layers {
        out.extend_from_slice(&(l as u32).to_le_bytes());
    }
    seal(out)
}

/// Decodes a layout list.
pub(crate) fn decode_list(value: &[u8], e: &Expect<'_>) -> Result<Vec<usize>, Fault> {
    let ([_, count, _], payload) = open(value, KIND_LIST, e)?;
    if payload.len() != 4 * count {
        return Err(Fault::Corrupt);
    }
    Ok(payload.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expect(hash: &[u8; 32]) -> Expect<'_> {
        Expect { hash, layer: 3, kv_heads: 2, head_dim: 4, dtype: DType::F16 }
    }

    #[test]
    fn rows_round_trip_and_every_damage_is_refused() {
        let hash = [7u8; 32];
        let e = expect(&hash);
        let keys: Vec<f32> = (0..2 * 5 * 4).map(|i| i as f32 * 0.25 - 3.0).collect();
        let values: Vec<f32> = keys.iter().map(|x| -x).collect();
        let v = encode_rows(&e, 3, 5, &keys, &values);
        let rows = decode_rows(v.clone(), &e, 8).unwrap();
        assert_eq!((rows.first, rows.rows), (3, 5));
        assert_eq!(rows.widened(), (keys, values), "these values are exact in f16");
        for at in [0, 4, 5, 9, 41, 45, 70, v.len() - 1] {
            let mut bad = v.clone();
            bad[at] ^= 0x10;
            assert_eq!(decode_rows(bad, &e, 8), Err(Fault::Corrupt), "flipped byte {at}");
        }
        assert_eq!(decode_rows(v[..v.len() - 9].to_vec(), &e, 8), Err(Fault::Corrupt), "truncated");
        assert_eq!(decode_rows(Vec::new(), &e, 8), Err(Fault::Corrupt), "empty");
        assert_eq!(decode_rows(v.clone(), &e, 7), Err(Fault::Corrupt), "more rows than a chunk");
        let other = [8u8; 32];
        assert_eq!(decode_rows(v.clone(), &expect(&other), 8), Err(Fault::Corrupt), "another chunk's value");
        assert_eq!(decode_rows(v.clone(), &Expect { layer: 2, ..e }, 8), Err(Fault::Corrupt), "another layer's");
        assert_eq!(decode_rows(v.clone(), &Expect { dtype: DType::Bf16, ..e }, 8), Err(Fault::Corrupt), "another type");
    }

    #[test]
    fn non_finite_rows_are_refused_in_every_type() {
        let hash = [2u8; 32];
        for dtype in [DType::F32, DType::F16, DType::Bf16] {
            let e = Expect { dtype, ..expect(&hash) };
            for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
                let mut keys = vec![0.5f32; 2 * 4 * 4];
                keys[17] = bad;
                let v = encode_rows(&e, 0, 4, &keys, &vec![0.25; keys.len()]);
                assert_eq!(decode_rows(v, &e, 8), Err(Fault::Corrupt), "{dtype:?} {bad}");
            }
            let ok = encode_rows(&e, 0, 4, &[65504.0; 32], &[-1e-7; 32]);
            assert!(decode_rows(ok, &e, 8).is_ok(), "{dtype:?}: large and tiny finite values pass");
        }
    }

    #[test]
    fn lists_round_trip() {
        let hash = [1u8; 32];
        let e = Expect { layer: 0, ..expect(&hash) };
        assert_eq!(decode_list(&encode_list(&e, &[0, 5, 29]), &e), Ok(vec![0, 5, 29]));
    }
}
