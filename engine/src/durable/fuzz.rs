//! Body of the `manifest_decode` fuzz target, kept in the crate so the checked-in corpus
//! replays on stable (`tests/fuzz_manifest_replay.rs`) and libFuzzer runs it on nightly.
//!
//! Arbitrary bytes go through the manifest framing and then through the catalog, record and
//! index-layout decoders: they must never panic, never allocate beyond the input's size (bincode's read
//! limit is the payload length), and anything accepted must survive a round trip: encoding
//! it and decoding again gives the same value. (Byte equality is too strict: the varint
//! decoder accepts non-minimal integers, e.g. 0 written in three bytes, which our writer
//! never produces; the frames' crc32c, not canonical bytes, guards the data.)

use std::path::Path;

use super::home::{HomeRecord, SegmentRecord};
use super::layout::{LayoutRecord, PqRecord};
use super::records::{
    decode, decode_catalog, encode, AppendRecord, CheckpointRecord, CreateContextRecord, DropContextRecord,
};

/// Decodes `data` as a whole manifest file and, unframed, as a catalog and as each record
/// payload; panics if an accepted value does not come back unchanged from a round trip.
pub fn fuzz_decode_catalog(data: &[u8]) {
    attnstore_wal::fuzz_decode(data);
    if let Ok(header) = attnstore_wal::FileHeader::decode(data) {
        if let Ok(payload) = attnstore_wal::decode_manifest(Path::new("fuzz-input"), data, header.identity()) {
            check_catalog(payload);
        }
    }
    check_catalog(data);
    round_trips::<CreateContextRecord>(data);
    round_trips::<AppendRecord>(data);
    round_trips::<DropContextRecord>(data);
    round_trips::<CheckpointRecord>(data);
    round_trips::<LayoutRecord>(data);
    round_trips::<HomeRecord>(data);
    round_trips::<SegmentRecord>(data);
    // Codebooks are floats: NaN is never equal to itself, so a PQ layout must instead
    // re-encode to the very bytes it was encoded to.
    if let Ok(record) = decode::<PqRecord>(data) {
        let once = encode(&record);
        let again = decode::<PqRecord>(&once).expect("a re-encoded pq layout decodes");
        assert!(encode(&again) == once, "an accepted pq layout survives a round trip");
    }
}

fn check_catalog(payload: &[u8]) {
    if let Ok(manifest) = decode_catalog(payload) {
        let again = decode_catalog(&encode(&manifest)).expect("a re-encoded catalog decodes");
        assert!(again == manifest, "an accepted catalog survives a round trip");
        for context in &manifest.contexts {
            // Validation may refuse a spec, but must not panic on any values.
            let _ = context.spec.to_spec();
        }
    }
}

fn round_trips<T: serde::Serialize + serde::de::DeserializeOwned + PartialEq>(payload: &[u8]) {
    if let Ok(record) = decode::<T>(payload) {
        let again = decode::<T>(&encode(&record)).expect("a re-encoded record decodes");
        assert!(again == record, "an accepted record survives a round trip");
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::durable::records::{Manifest, ManifestContext, ManifestHome, ManifestLayer, SpecRecord};
    use crate::{AttnShape, ContextSpec, Method, PqParams};
    use attnstore_kernels::random::SplitMix64;

    /// The seed corpus of `fuzz/corpus/manifest_decode`.
    pub(crate) fn seed_corpus() -> Vec<(&'static str, Vec<u8>)> {
        let shape = AttnShape::new(8, 2, 32).unwrap();
        let manifest = Manifest {
            generation: 3,
            wal_start_lsn: 120,
            next_context_id: 4,
            contexts: vec![
                ManifestContext {
                    context: 1,
                    spec: SpecRecord::from_spec(&ContextSpec::new(shape, 2)),
                    layers: vec![ManifestLayer { committed_bytes: 4096, tokens: 100, chunks: 3 }; 2],
                },
                ManifestContext {
                    context: 3,
                    spec: SpecRecord::from_spec(
                        &ContextSpec::new(shape, 1).with_method(Method::Pq(PqParams::default())),
                    ),
                    layers: vec![ManifestLayer { committed_bytes: 0, tokens: 0, chunks: 0 }],
                },
            ],
            homes: vec![ManifestHome { context: 1, layer: 1, data_bytes: 2048 }],
        };
        let catalog = encode(&manifest);
        let identity = attnstore_wal::FileIdentity::named(1, "MANIFEST");
        let file = attnstore_wal::encode_manifest(identity, &catalog).unwrap();
        let append = AppendRecord {
            context: 1,
            layer: 0,
            prefill: false,
            offset: 4096,
            chunk_bytes: 1052,
            tokens: 4,
            payload_crc: 0xdead_beef,
        };
        vec![
            ("manifest_file", file.clone()),
            ("catalog_payload", catalog.clone()),
            ("catalog_truncated", catalog[..catalog.len() / 2].to_vec()),
            ("append_record", encode(&append)),
            ("create_record", encode(&CreateContextRecord { context: 9, spec: manifest.contexts[1].spec.clone() })),
            ("wave_layout", encode(&LayoutRecord::new(1, 0, &wave_layout()))),
            ("pq_layout", encode(&PqRecord::new(3, 0, &pq_snapshot()))),
            ("home_record", crate::durable::home::tests::home_payload()),
            ("segment_record", crate::durable::home::tests::segment_payload()),
        ]
    }

    /// A small wave layout (one segment of one head), shared with the layout-file tests.
    pub(crate) fn wave_layout() -> attnstore_index::WaveLayout {
        attnstore_index::WaveLayout {
            tokens: 30,
            sink_len: 4,
            tail_start: 10,
            segments: vec![attnstore_index::SegmentLayout {
                first: 4,
                len: 6,
                heads: vec![attnstore_index::HeadLayout { sizes: vec![2, 4], positions: vec![5, 9, 4, 6, 7, 8] }],
            }],
        }
    }

    /// A small PQ snapshot (one head, m = 2, b = 4), shared with the layout-file tests.
    pub(crate) fn pq_snapshot() -> attnstore_index::PqSnapshot {
        attnstore_index::PqSnapshot {
            tokens: 40,
            subspaces: 2,
            bits: 4,
            codes: 3,
            start: 4,
            end: 30,
            train_rows: 26,
            iters_limit: 25,
            iters_run: 4,
            converged_jobs: 4,
            codebooks: vec![vec![0.5; 2 * 3 * 4]],
            packed: vec![vec![0x21; 26]],
        }
    }

    #[test]
    fn seed_inputs_and_random_mutations_of_them_decode_without_panicking() {
        let mut rng = SplitMix64::new(5);
        for (name, bytes) in seed_corpus() {
            fuzz_decode_catalog(&bytes);
            for _ in 0..300 {
                let mut mutated = bytes.clone();
                for _ in 0..1 + rng.below(4) {
                    let at = rng.below(mutated.len());
                    mutated[at] = rng.next_u64() as u8;
                }
                mutated.truncate(mutated.len() - rng.below(mutated.len() / 3 + 1));
                fuzz_decode_catalog(&mutated);
            }
            let _ = name;
        }
    }

    #[test]
    #[ignore = "rewrites fuzz/corpus/manifest_decode; run by hand after a format change"]
    fn regenerate_seed_corpus() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/manifest_decode");
        std::fs::create_dir_all(&dir).unwrap();
        for (name, bytes) in seed_corpus() {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
    }
}
