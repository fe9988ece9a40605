//! What the durable engine writes inside checksummed frames: the payloads of WAL records and
//! the manifest's catalog, encoded with `bincode` (DESIGN.md, Durability).
//!
//! The engine's own types (`ContextSpec`, `WaveParams`, ...) stay free of serde; this module
//! mirrors them in plain records and converts both ways, so the on-disk format changes only
//! when these records do. Decoding is bounded by the payload's length: a corrupt length
//! prefix cannot make it allocate more than the bytes it was given.

use std::time::Duration;

use attnstore_index::{PqParams, WaveParams};
use attnstore_kernels::{AttnShape, Codec, CodecOverrides, HackParams};
use bincode::Options;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::spec::{ContextSpec, LayerKind, Method};

/// A context was created (WAL `CreateContext`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct CreateContextRecord {
    pub context: u64,
    pub spec: SpecRecord,
}

/// A batch of KV rows was stored in a data file (WAL `AppendKv`): the chunk at `offset`
/// of the layer's data file, `chunk_bytes` long with payload checksum `payload_crc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct AppendRecord {
    pub context: u64,
    pub layer: u32,
    pub prefill: bool,
    pub offset: u64,
    pub chunk_bytes: u64,
    pub tokens: u64,
    pub payload_crc: u32,
}

/// A context was dropped (WAL `DropContext`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DropContextRecord {
    pub context: u64,
}

/// A checkpoint was taken (WAL `Checkpoint`, first record of the log after it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct CheckpointRecord {
    pub generation: u64,
}

/// The catalog as of a checkpoint: everything needed to find the data again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Manifest {
    /// Bumped by every checkpoint.
    pub generation: u64,
    /// Replay starts at this LSN; older log files may be deleted.
    pub wal_start_lsn: u64,
    /// The id the next created context gets (ids are never reused).
    pub next_context_id: u64,
    pub contexts: Vec<ManifestContext>,
    /// `hack2` wave layers homed in 2-bit segment files (`durable/home.rs`): their data
    /// files' bytes before `data_bytes` may be punched out. Added last: a manifest written
    /// before it decodes as [`ManifestV1`] with no homes.
    pub homes: Vec<ManifestHome>,
}

/// A layer whose first `data_bytes` of data file live in its 2-bit home.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ManifestHome {
    pub context: u64,
    pub layer: u32,
    pub data_bytes: u64,
}

/// The catalog as manifests before 2-bit homes wrote it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ManifestV1 {
    generation: u64,
    wal_start_lsn: u64,
    next_context_id: u64,
    contexts: Vec<ManifestContext>,
}

/// Decodes a manifest's catalog, current or from before homes (whose bytes are a prefix of
/// the current layout: one can never be mistaken for the other, as every byte must be used).
pub(crate) fn decode_catalog(payload: &[u8]) -> Result<Manifest, String> {
    decode::<Manifest>(payload).or_else(|current| match decode::<ManifestV1>(payload) {
        Ok(m) => Ok(Manifest {
            generation: m.generation,
            wal_start_lsn: m.wal_start_lsn,
            next_context_id: m.next_context_id,
            contexts: m.contexts,
            homes: Vec::new(),
        }),
        Err(_) => Err(current),
    })
}

/// One context in the manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ManifestContext {
    pub context: u64,
    pub spec: SpecRecord,
    pub layers: Vec<ManifestLayer>,
}

/// One layer in the manifest: how much of its data file is committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ManifestLayer {
    pub committed_bytes: u64,
    pub tokens: u64,
    pub chunks: u64,
}

/// [`ContextSpec`] on disk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct SpecRecord {
    pub q_heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub layers: Vec<LayerKindRecord>,
    pub dtype: DTypeRecord,
    pub method: MethodRecord,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum LayerKindRecord {
    Global,
    SlidingWindow(u64),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum DTypeRecord {
    F32,
    F16,
    Bf16,
    /// The hack2 codec: f16 rows in the data files (the 2-bit form is derived, seeded,
    /// when segments are built), partition Π. Appended last so older files still decode.
    Hack2F16 {
        partition: u64,
    },
    /// The hack2c codec (per-channel keys), partition Π; appended after `Hack2F16`.
    Hack2cF16 {
        partition: u64,
    },
    /// The kv43 codec: f16 rows in the data files (the 4+3-bit form is derived, rounded to
    /// nearest, when segments are built), key group and value block; appended last.
    Kv43F16 {
        key_group: u64,
        value_block: u64,
    },
    /// kv43 with its key and value bits (written unless they are 4 and 3, which keep
    /// `Kv43F16`); appended last.
    Kv43BitsF16 {
        key_bits: u8,
        value_bits: u8,
        key_group: u64,
        value_block: u64,
    },
    /// A codec per range of layers: the context's codec and its overrides (first and last
    /// layer, inclusive); appended last.
    Layers {
        default: Box<DTypeRecord>,
        overrides: Vec<(u64, u64, DTypeRecord)>,
    },
}

impl DTypeRecord {
    /// The record of one codec (never `Layers`).
    fn of(codec: Codec) -> Self {
        match codec {
            Codec::Kv43(p) if (p.key_bits, p.value_bits) == (4, 3) => {
                DTypeRecord::Kv43F16 { key_group: wide(p.key_group), value_block: wide(p.value_block) }
            }
            Codec::Kv43(p) => DTypeRecord::Kv43BitsF16 {
                key_bits: p.key_bits,
                value_bits: p.value_bits,
                key_group: wide(p.key_group),
                value_block: wide(p.value_block),
            },
            Codec::Hack2(p) if p.per_channel() => DTypeRecord::Hack2cF16 { partition: wide(p.partition) },
            Codec::Hack2(p) => DTypeRecord::Hack2F16 { partition: wide(p.partition) },
            Codec::F32 => DTypeRecord::F32,
            Codec::F16 => DTypeRecord::F16,
            Codec::Bf16 => DTypeRecord::Bf16,
        }
    }

    /// The codec a record of one codec stands for (`Layers` is an error here).
    fn codec(&self) -> Result<Codec, String> {
        Ok(match *self {
            DTypeRecord::F32 => Codec::F32,
            DTypeRecord::F16 => Codec::F16,
            DTypeRecord::Bf16 => Codec::Bf16,
            DTypeRecord::Hack2F16 { partition } => {
                Codec::Hack2(HackParams::new(narrow(partition, "partition")?).map_err(|e| e.to_string())?)
            }
            DTypeRecord::Hack2cF16 { partition } => Codec::Hack2(
                HackParams::new(narrow(partition, "partition")?)
                    .map_err(|e| e.to_string())?
                    .with_keys(attnstore_kernels::KeyLayout::PerChannel),
            ),
            // The groups are checked with the head dimension by `validate`.
            DTypeRecord::Kv43F16 { key_group, value_block } => Codec::Kv43(attnstore_kernels::Kv43Params {
                key_bits: 4,
                value_bits: 3,
                key_group: narrow(key_group, "key group")?,
                value_block: narrow(value_block, "value block")?,
            }),
            DTypeRecord::Kv43BitsF16 { key_bits, value_bits, key_group, value_block } => {
                Codec::Kv43(attnstore_kernels::Kv43Params {
                    key_bits,
                    value_bits,
                    key_group: narrow(key_group, "key group")?,
                    value_block: narrow(value_block, "value block")?,
                })
            }
            DTypeRecord::Layers { .. } => return Err("a layer's codec record holds codecs per layer".into()),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum MethodRecord {
    Wave {
        sink_tokens: u64,
        local_tokens: u64,
        segment_tokens: u64,
        decode_segment_tokens: u64,
        tokens_per_cluster: u64,
        max_iters: u64,
        seed: u64,
    },
    Flat,
    Pq {
        subspaces: Option<u64>,
        bits: Option<u64>,
        sink_tokens: u64,
        local_tokens: u64,
        max_iters: u64,
        build_budget_ns: Option<u64>,
        train_rows_per_centroid: u64,
        min_build_tokens: u64,
        background: bool,
        seed: u64,
    },
}

fn wide(x: usize) -> u64 {
    x as u64
}

/// A stored count back to `usize`; a value that does not fit is reported, not truncated.
fn narrow(x: u64, what: &str) -> Result<usize, String> {
    usize::try_from(x).map_err(|_| format!("{what} {x} does not fit in usize"))
}

impl SpecRecord {
    pub fn from_spec(spec: &ContextSpec) -> Self {
        let layers = spec
            .layers
            .iter()
            .map(|kind| match *kind {
                LayerKind::Global => LayerKindRecord::Global,
                LayerKind::SlidingWindow(w) => LayerKindRecord::SlidingWindow(wide(w)),
            })
            .collect();
        let dtype = match spec.codec_overrides.is_empty() {
            true => DTypeRecord::of(spec.codec),
            false => DTypeRecord::Layers {
                default: Box::new(DTypeRecord::of(spec.codec)),
                overrides: spec
                    .codec_overrides
                    .iter()
                    .map(|(layers, c)| (wide(*layers.start()), wide(*layers.end()), DTypeRecord::of(c)))
                    .collect(),
            },
        };
        let method = match spec.method {
            Method::Wave(p) => MethodRecord::Wave {
                sink_tokens: wide(p.sink_tokens),
                local_tokens: wide(p.local_tokens),
                segment_tokens: wide(p.segment_tokens),
                decode_segment_tokens: wide(p.decode_segment_tokens),
                tokens_per_cluster: wide(p.tokens_per_cluster),
                max_iters: wide(p.max_iters),
                seed: p.seed,
            },
            Method::Flat => MethodRecord::Flat,
            Method::Pq(p) => MethodRecord::Pq {
                subspaces: p.subspaces.map(wide),
                bits: p.bits.map(wide),
                sink_tokens: wide(p.sink_tokens),
                local_tokens: wide(p.local_tokens),
                max_iters: wide(p.max_iters),
                build_budget_ns: p.build_budget.map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
                train_rows_per_centroid: wide(p.train_rows_per_centroid),
                min_build_tokens: wide(p.min_build_tokens),
                background: p.background,
                seed: p.seed,
            },
        };
        Self {
            q_heads: spec.shape.q_heads as u32,
            kv_heads: spec.shape.kv_heads as u32,
            head_dim: spec.shape.head_dim as u32,
            layers,
            dtype,
            method,
        }
    }

    /// The spec, validated as `create_context` would.
    pub fn to_spec(&self) -> Result<ContextSpec, String> {
        let shape = AttnShape::new(self.q_heads as usize, self.kv_heads as usize, self.head_dim as usize)
            .map_err(|e| e.to_string())?;
        let layers = self
            .layers
            .iter()
            .map(|kind| {
                Ok(match *kind {
                    LayerKindRecord::Global => LayerKind::Global,
                    LayerKindRecord::SlidingWindow(w) => LayerKind::SlidingWindow(narrow(w, "window")?),
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        let (codec, codec_overrides) = match &self.dtype {
            DTypeRecord::Layers { default, overrides } => {
                let mut table = CodecOverrides::default();
                for (first, last, c) in overrides {
                    table = table.with(narrow(*first, "layer")?..=narrow(*last, "layer")?, c.codec()?)?;
                }
                (default.codec()?, table)
            }
            one => (one.codec()?, CodecOverrides::default()),
        };
        let method = match self.method {
            MethodRecord::Wave {
                sink_tokens,
                local_tokens,
                segment_tokens,
                decode_segment_tokens,
                tokens_per_cluster,
                max_iters,
                seed,
            } => Method::Wave(WaveParams {
                sink_tokens: narrow(sink_tokens, "sink_tokens")?,
                local_tokens: narrow(local_tokens, "local_tokens")?,
                segment_tokens: narrow(segment_tokens, "segment_tokens")?,
                decode_segment_tokens: narrow(decode_segment_tokens, "decode_segment_tokens")?,
                tokens_per_cluster: narrow(tokens_per_cluster, "tokens_per_cluster")?,
                max_iters: narrow(max_iters, "max_iters")?,
                seed,
            }),
            MethodRecord::Flat => Method::Flat,
            MethodRecord::Pq {
                subspaces,
                bits,
                sink_tokens,
                local_tokens,
                max_iters,
                build_budget_ns,
                train_rows_per_centroid,
                min_build_tokens,
                background,
                seed,
            } => Method::Pq(PqParams {
                subspaces: subspaces.map(|m| narrow(m, "subspaces")).transpose()?,
                bits: bits.map(|b| narrow(b, "bits")).transpose()?,
                sink_tokens: narrow(sink_tokens, "sink_tokens")?,
                local_tokens: narrow(local_tokens, "local_tokens")?,
                max_iters: narrow(max_iters, "max_iters")?,
                build_budget: build_budget_ns.map(Duration::from_nanos),
                train_rows_per_centroid: narrow(train_rows_per_centroid, "train_rows_per_centroid")?,
                min_build_tokens: narrow(min_build_tokens, "min_build_tokens")?,
                background,
                seed,
            }),
        };
        let spec = ContextSpec { shape, layers, dtype: codec.plain_dtype(), codec, codec_overrides, method };
        spec.validate().map_err(|e| e.to_string())?;
        Ok(spec)
    }
}

/// bincode settings of every durable payload: varint integers, no trailing bytes, and a
/// read limit of the payload's own length.
fn options(limit: usize) -> impl Options {
    bincode::DefaultOptions::new().with_limit(limit as u64).reject_trailing_bytes()
}

/// Encodes a record payload.
pub(crate) fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Serializing these plain records into a Vec cannot fail: no maps with non-string keys,
    // no sizes beyond the (unbounded for writing) limit.
    bincode::DefaultOptions::new().serialize(value).expect("durable records always serialize")
}

/// Decodes a record payload; every byte must be used.
pub(crate) fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, String> {
    options(payload.len()).deserialize(payload).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnstore_kernels::DType;

    #[test]
    fn every_kind_of_spec_round_trips_through_its_record() {
        let shape = AttnShape::new(8, 2, 32).unwrap();
        let pq = PqParams { build_budget: Some(Duration::from_millis(7)), subspaces: Some(4), ..PqParams::default() };
        for spec in [
            ContextSpec::new(shape, 2),
            ContextSpec::new(shape, 1).with_dtype(DType::F32).with_method(Method::Flat),
            ContextSpec::new(shape, 1).with_dtype(DType::Bf16).with_method(Method::Pq(pq)),
            ContextSpec::new(shape, 1).with_codec(Codec::Hack2(HackParams::new(32).unwrap())),
            ContextSpec::new(AttnShape::new(8, 2, 64).unwrap(), 1)
                .with_codec(Codec::Kv43(attnstore_kernels::Kv43Params::with_key_group(256).unwrap())),
            ContextSpec::new(shape, 3).with_layers(vec![
                LayerKind::Global,
                LayerKind::SlidingWindow(512),
                LayerKind::Global,
            ]),
            // 5-bit keys, and a codec per range of layers.
            ContextSpec::new(AttnShape::new(8, 2, 64).unwrap(), 1).with_codec("kv43:k5:v4:b128".parse().unwrap()),
            ContextSpec::new(AttnShape::new(8, 2, 64).unwrap(), 6)
                .with_layer_codecs("kv43:b128,2-3=kv43:k5,4=kv43:v4,5=f16".parse().unwrap()),
        ] {
            let record = SpecRecord::from_spec(&spec);
            let back: SpecRecord = decode(&encode(&record)).unwrap();
            assert_eq!(back.to_spec().unwrap(), spec);
        }
        // A kv43 record whose groups do not fit is refused, not trusted.
        let mut bad = SpecRecord::from_spec(
            &ContextSpec::new(AttnShape::new(8, 2, 64).unwrap(), 1)
                .with_codec(Codec::Kv43(attnstore_kernels::Kv43Params::default())),
        );
        bad.dtype = DTypeRecord::Kv43F16 { key_group: 100, value_block: 64 };
        assert!(bad.to_spec().unwrap_err().contains("kv43"));
        // So is one with 6-bit keys, overlapping layer ranges or nested tables.
        bad.dtype = DTypeRecord::Kv43BitsF16 { key_bits: 6, value_bits: 3, key_group: 128, value_block: 64 };
        assert!(bad.to_spec().unwrap_err().contains("4 or 5 bits"));
        let k5 = DTypeRecord::Kv43BitsF16 { key_bits: 5, value_bits: 3, key_group: 128, value_block: 64 };
        let f16 = Box::new(DTypeRecord::F16);
        bad.dtype =
            DTypeRecord::Layers { default: f16.clone(), overrides: vec![(0, 0, k5.clone()), (0, 0, k5.clone())] };
        assert!(bad.to_spec().unwrap_err().contains("overlap"));
        let nested = DTypeRecord::Layers { default: f16.clone(), overrides: vec![] };
        bad.dtype = DTypeRecord::Layers { default: f16, overrides: vec![(0, 0, nested)] };
        assert!(bad.to_spec().unwrap_err().contains("codecs per layer"));
    }

    #[test]
    fn trailing_bytes_and_huge_length_prefixes_are_refused_without_allocating() {
        let mut bytes = encode(&DropContextRecord { context: 3 });
        bytes.push(0);
        assert!(decode::<DropContextRecord>(&bytes).is_err());
        // A manifest whose context list claims 2^60 entries: refused by the length limit.
        let mut huge =
            encode(&Manifest { generation: 1, wal_start_lsn: 1, next_context_id: 1, contexts: vec![], homes: vec![] });
        huge.pop();
        huge.pop();
        huge.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0x10, 0]);
        assert!(decode_catalog(&huge).is_err());
    }

    #[test]
    fn a_manifest_from_before_homes_still_decodes_and_the_current_one_round_trips() {
        let shape = AttnShape::new(8, 2, 32).unwrap();
        let contexts = vec![ManifestContext {
            context: 4,
            spec: SpecRecord::from_spec(&ContextSpec::new(shape, 1)),
            layers: vec![ManifestLayer { committed_bytes: 100, tokens: 3, chunks: 1 }],
        }];
        let old =
            encode(&ManifestV1 { generation: 2, wal_start_lsn: 9, next_context_id: 5, contexts: contexts.clone() });
        let back = decode_catalog(&old).unwrap();
        assert_eq!((back.generation, back.wal_start_lsn, back.contexts.clone(), back.homes.len()), (2, 9, contexts, 0));
        let homes = vec![ManifestHome { context: 4, layer: 0, data_bytes: 64 }];
        let current = Manifest { homes, ..back };
        assert_eq!(decode_catalog(&encode(&current)).unwrap(), current);
        // Cut short by one byte, neither layout accepts it.
        let bytes = encode(&current);
        assert!(decode_catalog(&bytes[..bytes.len() - 1]).is_err());
    }
}
