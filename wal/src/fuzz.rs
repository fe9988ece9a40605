//! The body of the `wal_decode` fuzz target, kept in the crate so the checked-in corpus
//! replays on stable (`tests/fuzz_corpus_replay.rs`) and libFuzzer runs it on nightly.
//!
//! It decodes arbitrary bytes as a log and as a manifest, and panics when a decoder
//! contradicts itself.

use crate::{
    decode_manifest, encode_manifest, encode_record, encode_record_in, FileHeader, FileIdentity, RecordReader, Tail,
};

/// Body of the `wal_decode` fuzz target: decodes `data` as a log file (header, then
/// frames bound to the header's identity) and as bare frames, and panics if the decoder
/// contradicts itself: records not contiguous, an error anywhere but at the frame after the
/// last record, a clean end with anything but zeros after it, a torn tail at the buffer's
/// end, or records that do not re-encode to exactly the bytes they were read from. It also
/// decodes `data` as a manifest of the identity its header names: an accepted manifest must
/// re-encode to `data`.
pub fn fuzz_decode(data: &[u8]) {
    if let Ok(header) = FileHeader::decode(data) {
        let identity = header.identity();
        if let Ok(payload) = decode_manifest(std::path::Path::new("fuzz-input"), data, identity) {
            let manifest = encode_manifest(identity, payload).expect("a decoded payload is re-encodable");
            assert!(manifest == data, "an accepted manifest is exactly header + one checkpoint record");
        }
        assert_eq!(header.encode()[..], data[..FileHeader::SIZE], "a decoded header re-encodes to its bytes");
        let reader = RecordReader::open_log(data).expect("open_log accepts what FileHeader::decode accepts");
        check_reader(data, FileHeader::SIZE, Some(identity), reader);
    }
    check_reader(data, 0, None, RecordReader::new(data));
    // A small limit reaches the record-too-large path with small inputs.
    check_reader(data, 0, None, RecordReader::new(data).with_max_record_bytes(32));
}

fn check_reader(data: &[u8], start: usize, identity: Option<FileIdentity>, mut reader: RecordReader<'_>) {
    let mut reencoded = Vec::new();
    let mut position = start;
    let mut ordinal = 0;
    let valid_up_to = loop {
        match reader.next() {
            Some(Ok(record)) => {
                assert_eq!(record.offset, position, "records are contiguous");
                match identity {
                    Some(identity) => encode_record_in(identity, ordinal, record.kind, record.payload, &mut reencoded),
                    None => encode_record(record.kind, record.payload, &mut reencoded),
                }
                .expect("a decoded payload is re-encodable");
                ordinal += 1;
                position = record.end();
                assert_eq!(reader.position(), position, "the reader moves to the end of the record");
            }
            Some(Err(error)) => {
                assert_eq!(error.offset(), Some(position), "damage is reported at the frame after the last record");
                assert!(reader.next().is_none() && reader.tail().is_none(), "the reader stops at damage");
                break position;
            }
            None => {
                let tail = reader.tail().expect("a reader that ran out has a tail");
                assert_eq!(tail.valid_up_to(), position, "the tail is at the end of the last record");
                match tail {
                    Tail::Clean { valid_up_to } => {
                        assert!(data[valid_up_to..].iter().all(|&b| b == 0), "a clean end has only zeros after it")
                    }
                    Tail::Torn { valid_up_to } => assert!(valid_up_to < data.len(), "a torn tail leaves bytes behind"),
                }
                assert!(reader.next().is_none(), "the reader stays ended");
                break position;
            }
        }
    };
    assert!(reencoded == data[start..valid_up_to], "re-encoding the records reproduces the valid prefix");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample_log::{sample_log, SplitMix64, SAMPLE_ID};
    use crate::{RecordKind, FORMAT_VERSION, SECTOR_BYTES};

    /// The seed corpus of `fuzz/corpus/wal_decode`: one file per case of the torn-tail vs
    /// damage rule, each well under 4 KiB.
    fn seed_corpus() -> Vec<(&'static str, Vec<u8>)> {
        let id = SAMPLE_ID;
        let header = FileHeader::new(id, 0).encode().to_vec();
        let (small, _) = sample_log(1, 12, 24);
        let mut every_kind = header.clone();
        for (i, kind) in RecordKind::ALL.into_iter().enumerate() {
            encode_record_in(id, i as u64, kind, format!("{kind:?} payload").as_bytes(), &mut every_kind).unwrap();
        }
        let mut empty_payloads = header.clone();
        for (i, kind) in RecordKind::ALL.into_iter().enumerate() {
            encode_record_in(id, i as u64, kind, &[], &mut empty_payloads).unwrap();
        }
        let with = |bytes: &[u8], edit: &dyn Fn(&mut Vec<u8>)| {
            let mut bytes = bytes.to_vec();
            edit(&mut bytes);
            bytes
        };
        let manifest = encode_manifest(id, b"catalog").unwrap();
        let mut unknown_kind = header.clone();
        crate::record::encode_raw(id, 0, 0x2a, b"kv", &mut unknown_kind);
        // A long last record whose second sector never landed: a torn write.
        let mut long = every_kind.clone();
        encode_record_in(id, 5, RecordKind::AppendKv, &[0x5a; 700], &mut long).unwrap();
        vec![
            ("header_only", header.clone()),
            ("valid_every_kind", every_kind.clone()),
            ("valid_empty_payloads", empty_payloads),
            ("valid_small_records", small.clone()),
            ("valid_manifest", manifest.clone()),
            ("valid_zero_filled_tail", with(&small, &|log| log.resize(log.len() + 64, 0))),
            ("corrupt_manifest_cut", manifest[..manifest.len() - 1].to_vec()),
            ("bare_frames_without_header", every_kind[FileHeader::SIZE..].to_vec()),
            ("corrupt_inside_frame_header", small[..FileHeader::SIZE + 5].to_vec()),
            ("corrupt_inside_payload", every_kind[..every_kind.len() - 3].to_vec()),
            ("corrupt_last_bit_flip", with(&every_kind, &|log| *log.last_mut().unwrap() ^= 1)),
            ("torn_unwritten_sector", with(&long, &|log| log[SECTOR_BYTES..].fill(0))),
            ("torn_cut_at_sector", long[..SECTOR_BYTES].to_vec()),
            ("corrupt_checksum_mid_log", with(&every_kind, &|log| log[FileHeader::SIZE + 10] ^= 0x80)),
            ("corrupt_length_over_max", with(&every_kind, &|log| log[FileHeader::SIZE + 3] = 0xff)),
            ("corrupt_length_past_end", with(&every_kind, &|log| log[FileHeader::SIZE + 1] = 0x10)),
            ("corrupt_unknown_kind", unknown_kind),
            (
                "corrupt_other_place",
                with(&every_kind, &|log| {
                    let moved = FileHeader::new(FileIdentity { file_id: 2, ..id }, 0).encode();
                    log[..FileHeader::SIZE].copy_from_slice(&moved);
                }),
            ),
            ("bad_magic", with(&every_kind, &|log| log[0] = b'X')),
            ("bad_header_checksum", with(&every_kind, &|log| log[12] ^= 0x01)),
            (
                "unknown_version",
                [&FileHeader::with_version(FORMAT_VERSION + 1, id, 0).encode()[..], &every_kind[FileHeader::SIZE..]]
                    .concat(),
            ),
            ("truncated_header", header[..10].to_vec()),
        ]
    }

    /// What reading `bytes` as a log file ends in, in the words the corpus names use.
    fn outcome(bytes: &[u8]) -> &'static str {
        let Ok(mut reader) = RecordReader::open_log(bytes) else { return "bad header" };
        if reader.by_ref().any(|item| item.is_err()) {
            return "corrupt";
        }
        match reader.tail() {
            Some(Tail::Clean { .. }) => "clean",
            _ => "torn",
        }
    }

    #[test]
    fn each_seed_corpus_file_ends_as_its_name_says_and_stays_small() {
        for (name, bytes) in seed_corpus() {
            assert!(bytes.len() < 4096, "{name} is {} bytes", bytes.len());
            let expected = match name.split('_').next().unwrap() {
                "header" | "valid" => "clean",
                "torn" => "torn",
                "corrupt" => "corrupt",
                _ => "bad header",
            };
            assert_eq!(outcome(&bytes), expected, "{name}");
            fuzz_decode(&bytes);
        }
    }

    #[test]
    fn mutated_logs_decode_consistently() {
        let mut rng = SplitMix64::new(2);
        for seed in 0..400 {
            let (mut log, _) = sample_log(seed, 6, 40);
            for _ in 0..rng.below(4) {
                let at = rng.below(log.len());
                log[at] = rng.next_u64() as u8;
            }
            log.truncate(log.len() - rng.below(log.len() / 4));
            fuzz_decode(&log);
        }
    }

    #[test]
    #[ignore = "rewrites fuzz/corpus/wal_decode; run by hand after a format change"]
    fn regenerate_seed_corpus() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/wal_decode");
        std::fs::create_dir_all(&dir).unwrap();
        for (name, bytes) in seed_corpus() {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
    }
}
