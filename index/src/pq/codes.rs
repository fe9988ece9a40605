//! PQ codes packed tightly: `m` codes of `b` bits per token in one little-endian bit
//! stream (code `i = token·m + j` at bits `i·b..(i+1)·b`), unpacked a tile at a time into
//! bytes for the scoring loop.

use crate::error::{Error, Result};
use crate::pq::params::PqLayout;

/// The codes of a run of tokens of one KV head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedCodes {
    layout: PqLayout,
    tokens: usize,
    bytes: Vec<u8>,
}

impl PackedCodes {
    /// An empty run.
    pub fn new(layout: PqLayout) -> Self {
        Self { layout, tokens: 0, bytes: Vec::new() }
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.tokens
    }

    /// True when no token is held.
    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// Bytes of the packed stream.
    pub fn bytes(&self) -> usize {
        self.bytes.len()
    }

    /// Appends the codes of `codes.len() / m` tokens (token-major); every code must fit in
    /// `b` bits.
    pub fn push(&mut self, codes: &[u8]) -> Result<()> {
        let (m, b) = (self.layout.subspaces, self.layout.bits);
        if !codes.len().is_multiple_of(m) {
            return Err(Error::ShapeMismatch {
                what: "codes (tokens × m)",
                expected: codes.len() / m * m,
                got: codes.len(),
            });
        }
        if let Some(c) = codes.iter().find(|&&c| (c as usize) >> b != 0) {
            return Err(Error::InvalidParameter { what: "code", message: format!("{c} does not fit in {b} bits") });
        }
        let mut bit = self.tokens * m * b;
        self.bytes.resize((bit + codes.len() * b).div_ceil(8), 0);
        if b == 8 {
            self.bytes[bit / 8..].copy_from_slice(codes);
        } else {
            for &c in codes {
                // b ≤ 8 and the offset ≤ 7, so a code spans at most two bytes.
                let v = (c as u16) << (bit % 8);
                self.bytes[bit / 8] |= v as u8;
                if bit % 8 + b > 8 {
                    self.bytes[bit / 8 + 1] |= (v >> 8) as u8;
                }
                bit += b;
            }
        }
        self.tokens += codes.len() / m;
        Ok(())
    }

    /// The packed stream itself (what a checkpoint stores).
    pub fn packed_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Codes of `tokens` tokens from a packed stream (`bytes`, as [`PackedCodes::packed_bytes`]
    /// gave it), checked: the length must be `⌈tokens·m·b/8⌉`, the bits past the last code
    /// zero, and every code below `codes` (the centroids a codebook has). A stream that does
    /// not fit is a typed error, never an index that reads past its codebook.
    pub fn from_packed(layout: PqLayout, tokens: usize, bytes: Vec<u8>, codes: usize) -> Result<Self> {
        let (m, b) = (layout.subspaces, layout.bits);
        let bits = tokens * m * b;
        if bytes.len() != bits.div_ceil(8) {
            return Err(Error::ShapeMismatch {
                what: "packed codes (bytes)",
                expected: bits.div_ceil(8),
                got: bytes.len(),
            });
        }
        if !bits.is_multiple_of(8) && bytes.last().is_some_and(|&last| last >> (bits % 8) != 0) {
            return Err(Error::InvalidParameter {
                what: "packed codes",
                message: "bits set past the last code".into(),
            });
        }
        let packed = Self { layout, tokens, bytes };
        const TILE: usize = 4096;
        let mut tile = Vec::with_capacity(TILE * m);
        for s in (0..tokens).step_by(TILE) {
            tile.clear();
            packed.unpack(s, TILE.min(tokens - s), &mut tile);
            if let Some(&c) = tile.iter().find(|&&c| c as usize >= codes) {
                return Err(Error::InvalidParameter {
                    what: "packed codes",
                    message: format!("code {c} names no centroid: the codebook has {codes}"),
                });
            }
        }
        Ok(packed)
    }

    /// The codes as token-major bytes without unpacking, when `b = 8` (one byte per code).
    pub fn as_bytes(&self) -> Option<&[u8]> {
        (self.layout.bits == 8).then_some(&self.bytes[..])
    }

    /// Appends to `out` the codes of every `stride`-th token (`0, stride, 2·stride, …`).
    pub fn sample(&self, stride: usize, out: &mut Vec<u8>) {
        let m = self.layout.subspaces;
        match self.as_bytes() {
            Some(b) => b.chunks_exact(m).step_by(stride.max(1)).for_each(|c| out.extend_from_slice(c)),
            None => (0..self.tokens).step_by(stride.max(1)).for_each(|t| self.unpack(t, 1, out)),
        }
    }

    /// Appends to `out` the codes of tokens `start..start + n` (token-major bytes). Panics if
    /// the range is not held (the caller's invariant).
    pub fn unpack(&self, start: usize, n: usize, out: &mut Vec<u8>) {
        assert!(start + n <= self.tokens, "unpack {start}+{n} beyond {} tokens", self.tokens);
        let (m, b) = (self.layout.subspaces, self.layout.bits);
        if b == 8 {
            out.extend_from_slice(&self.bytes[start * m..(start + n) * m]);
            return;
        }
        let mask = (1u16 << b) - 1;
        let mut bit = start * m * b;
        out.extend((0..n * m).map(|_| {
            let i = bit / 8;
            let lo = self.bytes[i] as u16;
            let hi = self.bytes.get(i + 1).copied().unwrap_or(0) as u16;
            let c = ((lo | hi << 8) >> (bit % 8)) & mask;
            bit += b;
            c as u8
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pq::params::{BITS, SUBSPACES};
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn packing_round_trips_for_every_layout(
            mi in 0usize..4, b in BITS, seeds in proptest::collection::vec(any::<u32>(), 1..200), split in 0usize..200,
        ) {
            let layout = PqLayout { subspaces: SUBSPACES[mi], bits: b };
            let m = layout.subspaces;
            let tokens = seeds.len();
            let codes: Vec<u8> = (0..tokens * m).map(|i| (seeds[i / m].rotate_left(i as u32 * 5) as usize % layout.codes()) as u8).collect();
            // Pushed in two batches, so batches that end mid-byte are covered too.
            let cut = split.min(tokens) * m;
            let mut p = PackedCodes::new(layout);
            p.push(&codes[..cut]).unwrap();
            p.push(&codes[cut..]).unwrap();
            prop_assert_eq!(p.len(), tokens);
            prop_assert_eq!(p.bytes(), (tokens * m * b).div_ceil(8));
            let mut all = Vec::new();
            p.unpack(0, tokens, &mut all);
            prop_assert_eq!(&all, &codes);
            let mut sampled = Vec::new();
            p.sample(3, &mut sampled);
            let want: Vec<u8> = codes.chunks_exact(m).step_by(3).flatten().copied().collect();
            prop_assert_eq!(sampled, want);
            let (s, n) = (tokens / 3, tokens - tokens / 3);
            let mut part = Vec::new();
            p.unpack(s, n, &mut part);
            prop_assert_eq!(&part[..], &codes[s * m..]);
        }
    }

    #[test]
    fn a_packed_stream_round_trips_and_a_bad_one_is_refused() {
        let layout = PqLayout { subspaces: 2, bits: 6 };
        let codes: Vec<u8> = (0..2 * 9).map(|i| (i * 7 % 40) as u8).collect();
        let mut p = PackedCodes::new(layout);
        p.push(&codes).unwrap();
        let back = PackedCodes::from_packed(layout, 9, p.packed_bytes().to_vec(), 40).unwrap();
        assert_eq!(back, p);
        // Wrong length, a code beyond the codebook, bits past the end.
        assert!(PackedCodes::from_packed(layout, 10, p.packed_bytes().to_vec(), 40).is_err());
        let err = PackedCodes::from_packed(layout, 9, p.packed_bytes().to_vec(), 30).unwrap_err();
        assert!(err.to_string().contains("names no centroid"), "{err}");
        let mut bytes = p.packed_bytes().to_vec();
        *bytes.last_mut().unwrap() |= 0x80;
        assert!(PackedCodes::from_packed(layout, 9, bytes, 40).is_err());
    }

    #[test]
    fn codes_that_do_not_fit_are_rejected() {
        let mut p = PackedCodes::new(PqLayout { subspaces: 2, bits: 4 });
        assert!(p.push(&[3, 16]).is_err());
        assert!(p.push(&[3]).is_err());
        assert!(p.is_empty());
    }
}
