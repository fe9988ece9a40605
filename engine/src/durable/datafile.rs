//! KV data files: one append-only file per (context, layer), a sequence of chunks, one per
//! prefill or append batch. A chunk is a fixed 48-byte little-endian header (`zerocopy`)
//! followed by the batch's keys then values in the context's storage type, head-major
//! (`kv_heads × tokens × head_dim`), exactly the bytes the access method stores.
//!
//! The header has its own crc32c and the payload's crc32c, so a reader never believes a
//! size it has not checked; it names its owner (engine directory, context, layer) and its
//! checksum covers its offset too, so a chunk read from another file or another place is
//! refused. The WAL record that makes a chunk visible repeats its offset, length and
//! payload crc.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use attnstore_kernels::{DType, Element};
use half::{bf16, f16};
use rayon::prelude::*;
use zerocopy::byteorder::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::error::{Error, Result};
use crate::spec::ContextSpec;

/// Magic of every chunk header.
const CHUNK_MAGIC: [u8; 4] = *b"ATKV";
/// Chunk format version (2: the header names its owner and its checksum covers its offset).
const CHUNK_VERSION: u8 = 2;
const FLAG_PREFILL: u8 = 1;

/// The fixed header of a chunk; `header_crc` covers the chunk's offset in its file, then
/// the 44 bytes before it.
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct ChunkHeader {
    magic: [u8; 4],
    version: u8,
    flags: u8,
    dtype: u8,
    reserved: u8,
    tokens: U32,
    payload_bytes: U64,
    payload_crc: U32,
    context: U64,
    layer: U32,
    dir_id: U64,
    header_crc: U32,
}

impl ChunkHeader {
    fn computed_crc(&self, offset: u64) -> u32 {
        crc32c::crc32c_append(crc32c::crc32c(&offset.to_le_bytes()), &self.as_bytes()[..CHUNK_HEADER_BYTES - 4])
    }
}

/// Whose chunks a data file holds: the engine directory, the context and the layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChunkOwner {
    pub dir_id: u64,
    pub context: u64,
    pub layer: u32,
}

/// Size of a chunk header in bytes.
pub(crate) const CHUNK_HEADER_BYTES: usize = 48;
const _: () = assert!(CHUNK_HEADER_BYTES == size_of::<ChunkHeader>());

/// Bytes one prefill or append batch of `tokens` tokens of a context of `spec` adds to its
/// layer's data file (under [`super::DATA_DIR`]): a 48-byte header, then the keys and values
/// in the spec's storage type (`2 × kv_heads × tokens × head_dim` elements; a `hack2`
/// context's batches too, until a checkpoint moves them to its 2-bit home). For sizing
/// disks: a layer's data file is the sum over its batches. Saturates at `u64::MAX`.
pub fn chunk_bytes(spec: &ContextSpec, tokens: usize) -> u64 {
    let elements = [2, spec.shape.kv_heads, tokens, spec.shape.head_dim, spec.dtype.size_bytes()]
        .into_iter()
        .fold(1u64, |acc, n| acc.saturating_mul(n as u64));
    elements.saturating_add(CHUNK_HEADER_BYTES as u64)
}

fn dtype_code(dtype: DType) -> u8 {
    match dtype {
        DType::F32 => 1,
        DType::F16 => 2,
        DType::Bf16 => 3,
    }
}

/// Name of the data file of one layer, inside the engine's `data/` directory.
pub(crate) fn data_file_name(context: u64, layer: usize) -> String {
    format!("ctx-{context:010}-layer-{layer:04}.kv")
}

/// The context and layer of a data file name, `None` for other names.
pub(crate) fn parse_data_file_name(name: &str) -> Option<(u64, usize)> {
    let rest = name.strip_prefix("ctx-")?.strip_suffix(".kv")?;
    let (context, layer) = rest.split_once("-layer-")?;
    Some((context.parse().ok()?, layer.parse().ok()?))
}

/// An encoded chunk and what its WAL record repeats.
pub(crate) struct EncodedChunk {
    pub bytes: Vec<u8>,
    pub payload_crc: u32,
}

/// Elements converted per rayon job (large batches convert on all cores).
const CONVERT_ELEMENTS: usize = 1 << 16;

fn push_narrow<E: Element>(out: &mut Vec<u8>, src: &[f32], to_le: impl Fn(E) -> [u8; 2] + Sync) {
    let at = out.len();
    out.resize(at + src.len() * 2, 0);
    out[at..].par_chunks_mut(CONVERT_ELEMENTS * 2).zip(src.par_chunks(CONVERT_ELEMENTS)).for_each(|(dst, src)| {
        let mut narrow = vec![E::default(); src.len()];
        E::narrow(src, &mut narrow);
        for (d, x) in dst.chunks_exact_mut(2).zip(narrow) {
            d.copy_from_slice(&to_le(x));
        }
    });
}

fn push_elements(out: &mut Vec<u8>, dtype: DType, src: &[f32]) {
    match dtype {
        DType::F32 => out.extend(src.iter().flat_map(|x| x.to_le_bytes())),
        DType::F16 => push_narrow::<f16>(out, src, |x| x.to_bits().to_le_bytes()),
        DType::Bf16 => push_narrow::<bf16>(out, src, |x| x.to_bits().to_le_bytes()),
    }
}

/// Encodes one batch (`keys`/`values` in f32, converted to `dtype` as the index stores them)
/// as the chunk of `owner` at `offset` of its data file.
pub(crate) fn encode_chunk(
    (owner, offset): (ChunkOwner, u64),
    dtype: DType,
    prefill: bool,
    tokens: usize,
    keys: &[f32],
    values: &[f32],
) -> EncodedChunk {
    let payload_bytes = (keys.len() + values.len()) * dtype.size_bytes();
    let mut bytes = Vec::with_capacity(CHUNK_HEADER_BYTES + payload_bytes);
    bytes.resize(CHUNK_HEADER_BYTES, 0);
    push_elements(&mut bytes, dtype, keys);
    push_elements(&mut bytes, dtype, values);
    let payload_crc = crc32c::crc32c(&bytes[CHUNK_HEADER_BYTES..]);
    let mut header = ChunkHeader {
        magic: CHUNK_MAGIC,
        version: CHUNK_VERSION,
        flags: if prefill { FLAG_PREFILL } else { 0 },
        dtype: dtype_code(dtype),
        reserved: 0,
        tokens: U32::new(u32::try_from(tokens).expect("a batch of more than 4G tokens cannot be in memory")),
        payload_bytes: U64::new(payload_bytes as u64),
        payload_crc: U32::new(payload_crc),
        context: U64::new(owner.context),
        layer: U32::new(owner.layer),
        dir_id: U64::new(owner.dir_id),
        header_crc: U32::ZERO,
    };
    header.header_crc = U32::new(header.computed_crc(offset));
    bytes[..CHUNK_HEADER_BYTES].copy_from_slice(header.as_bytes());
    EncodedChunk { bytes, payload_crc }
}

/// One batch read back from a data file, widened to f32.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredBatch {
    /// Offset of the chunk in its data file.
    pub offset: u64,
    /// Whether it was the layer's prefill (otherwise a decode append).
    pub prefill: bool,
    /// Tokens in the batch.
    pub tokens: usize,
    /// Keys, `kv_heads × tokens × head_dim`, as stored (rounded to the storage type).
    pub keys: Vec<f32>,
    /// Values, same layout.
    pub values: Vec<f32>,
    /// crc32c of the stored payload.
    pub payload_crc: u32,
}

fn widen<E: Element>(bytes: &[u8], from_le: impl Fn([u8; 2]) -> E + Sync) -> Vec<f32> {
    let mut out = vec![0.0; bytes.len() / 2];
    out.par_chunks_mut(CONVERT_ELEMENTS).zip(bytes.par_chunks(CONVERT_ELEMENTS * 2)).for_each(|(dst, src)| {
        let narrow: Vec<E> = src.chunks_exact(2).map(|b| from_le([b[0], b[1]])).collect();
        E::widen(&narrow, dst);
    });
    out
}

fn decode_elements(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        DType::F16 => widen::<f16>(bytes, |b| f16::from_bits(u16::from_le_bytes(b))),
        DType::Bf16 => widen::<bf16>(bytes, |b| bf16::from_bits(u16::from_le_bytes(b))),
    }
}

/// Reads the committed chunks of one data file in order, checking every header and payload
/// checksum, the storage type and the sizes against the layer's row width. Stops at
/// `committed_bytes`; bytes after it (an uncommitted chunk) are not read.
pub(crate) struct ChunkReader {
    path: PathBuf,
    owner: ChunkOwner,
    file: File,
    offset: u64,
    committed_bytes: u64,
    dtype: DType,
    row_elements: usize,
}

impl ChunkReader {
    /// Opens `path`, the data file of `owner`; fails with a typed error if it is missing, not
    /// a regular file, or shorter than `committed_bytes`.
    pub fn open(
        path: &Path,
        owner: ChunkOwner,
        committed_bytes: u64,
        dtype: DType,
        row_elements: usize,
    ) -> Result<Self> {
        let Some((file, len)) = attnstore_wal::open_regular(path, u64::MAX)? else {
            return Err(Error::MissingDataFile { file: path.to_path_buf(), committed_bytes });
        };
        if len < committed_bytes {
            return Err(Error::DataFileShort {
                file: path.to_path_buf(),
                expected_bytes: committed_bytes,
                got_bytes: len,
            });
        }
        Ok(Self { path: path.to_path_buf(), owner, file, offset: 0, committed_bytes, dtype, row_elements })
    }

    /// Starts reading at `offset`, which must be the start of a committed chunk.
    pub fn starting_at(self, offset: u64) -> Self {
        Self { offset, ..self }
    }

    fn corrupt(&self, offset: u64, detail: String) -> Error {
        Error::Corrupt { file: self.path.clone(), offset, detail }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.file.read_exact_at(buf, offset).map_err(|e| attnstore_wal::Error::io("read", &self.path, &e).into())
    }

    /// The next committed chunk, `None` at `committed_bytes`.
    pub fn next_chunk(&mut self) -> Result<Option<StoredBatch>> {
        let offset = self.offset;
        if offset == self.committed_bytes {
            return Ok(None);
        }
        if self.committed_bytes - offset < CHUNK_HEADER_BYTES as u64 {
            let left = self.committed_bytes - offset;
            return Err(self.corrupt(
                offset,
                format!("expected a {CHUNK_HEADER_BYTES}-byte chunk header, got {left} committed bytes"),
            ));
        }
        let mut raw = [0u8; CHUNK_HEADER_BYTES];
        self.read_at(&mut raw, offset)?;
        let header = ChunkHeader::read_from_bytes(&raw).expect("the buffer is exactly one header");
        if header.magic != CHUNK_MAGIC {
            let got = String::from_utf8_lossy(&header.magic).into_owned();
            return Err(self.corrupt(offset, format!("expected chunk magic ATKV, got {got:?}")));
        }
        let crc = header.computed_crc(offset);
        if crc != header.header_crc.get() {
            return Err(self.corrupt(
                offset,
                format!(
                    "chunk header checksum: stored {:#010x}, computed {crc:#010x} (damaged, or a chunk from another offset)",
                    header.header_crc.get()
                ),
            ));
        }
        let owner =
            ChunkOwner { dir_id: header.dir_id.get(), context: header.context.get(), layer: header.layer.get() };
        if owner != self.owner {
            return Err(self.corrupt(
                offset,
                format!(
                    "the chunk belongs to context {} layer {} of engine directory {:#018x}, expected context {} layer {} of {:#018x} (a data file copied from elsewhere?)",
                    owner.context, owner.layer, owner.dir_id, self.owner.context, self.owner.layer, self.owner.dir_id
                ),
            ));
        }
        if header.version != CHUNK_VERSION || header.dtype != dtype_code(self.dtype) {
            return Err(self.corrupt(
                offset,
                format!(
                    "expected chunk version {CHUNK_VERSION} and dtype code {}, got {} and {}",
                    dtype_code(self.dtype),
                    header.version,
                    header.dtype
                ),
            ));
        }
        let tokens = header.tokens.get() as u64;
        let expected_bytes = tokens * 2 * self.row_elements as u64 * self.dtype.size_bytes() as u64;
        let payload_bytes = header.payload_bytes.get();
        if payload_bytes != expected_bytes {
            return Err(self.corrupt(
                offset,
                format!("expected {expected_bytes} payload bytes for {tokens} tokens, header says {payload_bytes}"),
            ));
        }
        let end = offset + CHUNK_HEADER_BYTES as u64 + payload_bytes;
        if end > self.committed_bytes {
            return Err(
                self.corrupt(offset, format!("chunk ends at {end}, past the {} committed bytes", self.committed_bytes))
            );
        }
        // The size is now bounded by the committed length, which the file is known to have.
        let mut payload = vec![0u8; payload_bytes as usize];
        self.read_at(&mut payload, offset + CHUNK_HEADER_BYTES as u64)?;
        let crc = crc32c::crc32c(&payload);
        if crc != header.payload_crc.get() {
            return Err(self.corrupt(
                offset,
                format!("chunk payload checksum: stored {:#010x}, computed {crc:#010x}", header.payload_crc.get()),
            ));
        }
        let half = payload.len() / 2;
        self.offset = end;
        Ok(Some(StoredBatch {
            offset,
            prefill: header.flags & FLAG_PREFILL != 0,
            tokens: tokens as usize,
            keys: decode_elements(self.dtype, &payload[..half]),
            values: decode_elements(self.dtype, &payload[half..]),
            payload_crc: crc,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWNER: ChunkOwner = ChunkOwner { dir_id: 0xd, context: 4, layer: 1 };

    #[test]
    fn a_chunk_of_another_owner_or_offset_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.kv");
        let rows = vec![0.5f32; 8];
        let chunk = encode_chunk((OWNER, 0), DType::F16, true, 1, &rows, &rows);
        std::fs::write(&path, &chunk.bytes).unwrap();
        for other in
            [ChunkOwner { dir_id: 0xe, ..OWNER }, ChunkOwner { context: 5, ..OWNER }, ChunkOwner { layer: 0, ..OWNER }]
        {
            let mut reader = ChunkReader::open(&path, other, chunk.bytes.len() as u64, DType::F16, 8).unwrap();
            let err = reader.next_chunk().unwrap_err();
            assert!(err.to_string().contains("belongs to"), "{err}");
        }
        let moved = [encode_chunk((OWNER, 0), DType::F16, true, 1, &rows, &rows).bytes, chunk.bytes.clone()].concat();
        std::fs::write(&path, &moved).unwrap();
        let mut reader = ChunkReader::open(&path, OWNER, moved.len() as u64, DType::F16, 8).unwrap();
        reader.next_chunk().unwrap();
        assert!(
            matches!(reader.next_chunk(), Err(Error::Corrupt { .. })),
            "a chunk written for offset 0 read at another"
        );
    }

    #[test]
    fn chunk_bytes_is_the_length_of_an_encoded_chunk() {
        use attnstore_kernels::AttnShape;
        let shape = AttnShape::new(4, 2, 8).unwrap();
        for dtype in [DType::F32, DType::F16, DType::Bf16] {
            let spec = ContextSpec::new(shape, 1).with_dtype(dtype);
            for tokens in [1, 3, 100] {
                let rows = vec![0.5f32; shape.kv_len(tokens)];
                let chunk = encode_chunk((OWNER, 0), dtype, false, tokens, &rows, &rows);
                assert_eq!(chunk_bytes(&spec, tokens), chunk.bytes.len() as u64, "{dtype:?}, {tokens} tokens");
            }
        }
        assert_eq!(chunk_bytes(&ContextSpec::new(shape, 1), usize::MAX), u64::MAX);
    }

    #[test]
    fn data_file_names_parse_back() {
        assert_eq!(parse_data_file_name(&data_file_name(12, 3)), Some((12, 3)));
        assert_eq!(parse_data_file_name("MANIFEST"), None);
    }

    #[test]
    fn chunks_round_trip_in_every_dtype_and_any_damage_is_a_typed_error_at_its_offset() {
        let dir = tempfile::tempdir().unwrap();
        let keys: Vec<f32> = (0..2 * 3 * 4).map(|i| i as f32 * 0.37 - 3.0).collect();
        let values: Vec<f32> = keys.iter().map(|x| x * 2.0).collect();
        for dtype in [DType::F32, DType::F16, DType::Bf16] {
            let path = dir.path().join(format!("{dtype}.kv"));
            let first = encode_chunk((OWNER, 0), dtype, true, 3, &keys, &values);
            let second = encode_chunk((OWNER, first.bytes.len() as u64), dtype, false, 3, &values, &keys);
            let file = [first.bytes.clone(), second.bytes.clone()].concat();
            std::fs::write(&path, &file).unwrap();
            let mut reader = ChunkReader::open(&path, OWNER, file.len() as u64, dtype, 8).unwrap();
            let a = reader.next_chunk().unwrap().unwrap();
            let b = reader.next_chunk().unwrap().unwrap();
            assert!(reader.next_chunk().unwrap().is_none());
            assert_eq!((a.prefill, b.prefill, b.offset), (true, false, first.bytes.len() as u64));
            let rounded: Vec<f32> =
                decode_elements(dtype, &first.bytes[CHUNK_HEADER_BYTES..][..keys.len() * dtype.size_bytes()]);
            assert_eq!(a.keys, rounded);
            if dtype == DType::F32 {
                assert_eq!((a.keys.clone(), a.values.clone()), (keys.clone(), values.clone()));
            }
            for at in [0, 5, 12, CHUNK_HEADER_BYTES + 1, file.len() - 1] {
                let mut damaged = file.clone();
                damaged[at] ^= 0x04;
                std::fs::write(&path, &damaged).unwrap();
                let mut reader = ChunkReader::open(&path, OWNER, file.len() as u64, dtype, 8).unwrap();
                let outcome = (|| -> Result<()> {
                    while reader.next_chunk()?.is_some() {}
                    Ok(())
                })();
                let expected_offset = if at < first.bytes.len() { 0 } else { first.bytes.len() as u64 };
                match outcome {
                    Err(Error::Corrupt { offset, .. }) => assert_eq!(offset, expected_offset, "byte {at}"),
                    other => panic!("byte {at}: {other:?}"),
                }
            }
        }
    }
}
