//! Seeded test inputs: a tiny RNG and valid logs built with it, so tests need no `rand`
//! and every failure replays from its seed.

use crate::{encode_record_in, FileHeader, FileIdentity, RecordKind};

/// The identity of the sample logs.
pub(crate) const SAMPLE_ID: FileIdentity = FileIdentity { dir_id: 0xa77e, file_id: 1 };

/// SplitMix64 (Steele, Lea, Flood 2014): one add and three xor-shift-multiplies per draw.
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A draw in `0..bound`; the modulo bias is irrelevant for test data.
    pub(crate) fn below(&mut self, bound: usize) -> usize {
        (self.next_u64() % bound.max(1) as u64) as usize
    }
}

/// Records as written: kind and payload.
pub(crate) type Written = Vec<(RecordKind, Vec<u8>)>;

/// A valid log file of `records` frames with random kinds and payloads of up to
/// `max_payload_bytes`, and the records as written.
pub(crate) fn sample_log(seed: u64, records: usize, max_payload_bytes: usize) -> (Vec<u8>, Written) {
    let mut rng = SplitMix64::new(seed);
    let mut log = FileHeader::new(SAMPLE_ID, 0).encode().to_vec();
    let written: Written = (0..records as u64)
        .map(|ordinal| {
            let kind = RecordKind::ALL[rng.below(RecordKind::ALL.len())];
            let payload: Vec<u8> = (0..rng.below(max_payload_bytes + 1)).map(|_| rng.next_u64() as u8).collect();
            encode_record_in(SAMPLE_ID, ordinal, kind, &payload, &mut log).expect("sample payloads are small");
            (kind, payload)
        })
        .collect();
    (log, written)
}
