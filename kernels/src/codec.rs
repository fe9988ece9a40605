//! How a context's stored KV rows are encoded: plain f32 / f16 / bf16, or HACK's 2-bit
//! homomorphic form (`hack2`), chosen per context.
//!
//! With `hack2`, rows are encoded when they become part of an indexed unit (a wave
//! segment, a PQ block of Π tokens): the steady zone (sink, local window, pending tokens)
//! stays in the plain type until then, which is HACK's requantization elimination: every
//! value is quantized exactly once, never re-quantized as the sequence grows.

use crate::cpu::hack::{HackParams, KeyLayout};
use crate::element::DType;
use std::fmt;
use std::str::FromStr;

/// The storage codec of a context's KV rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Codec {
    /// IEEE single precision.
    F32,
    /// IEEE half precision (the default).
    #[default]
    F16,
    /// bfloat16.
    Bf16,
    /// HACK 2-bit codes with per-partition f16 minimum and scale; rows not yet encoded are
    /// f16. `hack2`: HACK's per-token keys; `hack2c`: keys normalized per channel over each
    /// block of Π tokens first ([`KeyLayout::PerChannel`]).
    Hack2(HackParams),
}

impl Codec {
    /// The type of rows kept unencoded (all rows for the plain codecs; the steady zone for
    /// `hack2`).
    pub fn plain_dtype(self) -> DType {
        match self {
            Codec::F32 => DType::F32,
            Codec::F16 | Codec::Hack2(_) => DType::F16,
            Codec::Bf16 => DType::Bf16,
        }
    }

    /// The 2-bit parameters, for `hack2`.
    pub fn hack(self) -> Option<HackParams> {
        match self {
            Codec::Hack2(p) => Some(p),
            _ => None,
        }
    }

    /// Stored bytes of one token's key and value rows in one KV head, metadata included
    /// (for `hack2`: 2-bit codes, per key partition and per value block an f16 minimum and
    /// scale, and the key code sums).
    pub fn kv_row_bytes(self, head_dim: usize) -> f64 {
        match self {
            Codec::Hack2(p) => {
                let sum = if 3 * p.partition <= 255 { 1.0 } else { 2.0 };
                let key_meta = head_dim.div_ceil(p.partition) as f64 * (4.0 + sum);
                let channel_meta = if p.per_channel() { 4.0 } else { 0.0 };
                let value_meta = head_dim as f64 * (4.0 + channel_meta) / p.partition as f64;
                head_dim as f64 / 2.0 + key_meta + value_meta
            }
            plain => 2.0 * (head_dim * plain.plain_dtype().size_bytes()) as f64,
        }
    }

    /// The name on the command line and in JSON (`f32`, `f16`, `bf16`, `hack2`, `hack2c`).
    pub fn name(self) -> &'static str {
        match self {
            Codec::Hack2(p) if p.per_channel() => "hack2c",
            Codec::Hack2(_) => "hack2",
            plain => plain.plain_dtype().name(),
        }
    }
}

impl From<DType> for Codec {
    fn from(d: DType) -> Self {
        match d {
            DType::F32 => Codec::F32,
            DType::F16 => Codec::F16,
            DType::Bf16 => Codec::Bf16,
        }
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Codec::Hack2(p) if p.partition != HackParams::default().partition => {
                write!(f, "{}:{}", self.name(), p.partition)
            }
            c => f.write_str(c.name()),
        }
    }
}

impl FromStr for Codec {
    type Err = String;
    /// `f32`, `f16`, `bf16`, `hack2` / `hack2c` (Π = 64) or `hack2:Π` / `hack2c:Π`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        const EXPECTED: &str = "expected f32, f16, bf16, hack2, hack2c, hack2:N or hack2c:N";
        let lower = s.to_ascii_lowercase();
        if let Some(rest) = lower.strip_prefix("hack2") {
            let (keys, rest) = match rest.strip_prefix('c') {
                Some(rest) => (KeyLayout::PerChannel, rest),
                None => (KeyLayout::PerToken, rest),
            };
            let partition = match rest.strip_prefix(':') {
                Some(n) => n.parse::<usize>().map_err(|_| format!("bad partition in {s:?}: {EXPECTED}"))?,
                None if rest.is_empty() => HackParams::default().partition,
                None => return Err(format!("unknown codec {s:?}: {EXPECTED}")),
            };
            return HackParams::new(partition).map(|p| Codec::Hack2(p.with_keys(keys))).map_err(|e| e.to_string());
        }
        lower.parse::<DType>().map(Codec::from).map_err(|_| format!("unknown codec {s:?}: {EXPECTED}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_bad_ones_say_what_is_expected() {
        let channel = HackParams::default().with_keys(KeyLayout::PerChannel);
        for c in [Codec::F32, Codec::F16, Codec::Bf16, Codec::Hack2(HackParams::default()), Codec::Hack2(channel)] {
            assert_eq!(c.to_string().parse::<Codec>(), Ok(c));
        }
        assert_eq!(Codec::Hack2(channel).to_string(), "hack2c");
        let c32 = Codec::Hack2(HackParams::new(32).unwrap().with_keys(KeyLayout::PerChannel));
        assert_eq!("hack2c:32".parse::<Codec>(), Ok(c32));
        assert_eq!(c32.to_string(), "hack2c:32");
        assert!("hack2c:48x".parse::<Codec>().unwrap_err().contains("bad partition"));
        assert!("hack2cc".parse::<Codec>().unwrap_err().contains("hack2c"));
        let p32 = HackParams::new(32).unwrap();
        assert_eq!("hack2:32".parse::<Codec>(), Ok(Codec::Hack2(p32)));
        assert_eq!(Codec::Hack2(p32).to_string(), "hack2:32");
        assert!("hack2:40".parse::<Codec>().unwrap_err().contains("multiple of 16"));
        assert!("int4".parse::<Codec>().unwrap_err().contains("expected"));
        assert!("hack2x".parse::<Codec>().is_err());
    }

    #[test]
    fn hack2_rows_are_under_a_fifth_of_f16() {
        let f16 = Codec::F16.kv_row_bytes(128);
        assert_eq!(f16, 512.0);
        let h = Codec::Hack2(HackParams::default()).kv_row_bytes(128);
        // 64 code bytes, 2 key partitions × 5 bytes, 128 channels × 4 bytes / 64 rows.
        assert_eq!(h, 64.0 + 10.0 + 8.0);
        assert!(h / f16 <= 0.2);
        // Per-channel keys add an f16 minimum and range per channel and block of 64 rows.
        let c = Codec::Hack2(HackParams::default().with_keys(KeyLayout::PerChannel)).kv_row_bytes(128);
        assert_eq!(c, h + 4.0 * 128.0 / 64.0);
        assert_eq!(
            Codec::Hack2(HackParams::default().with_keys(KeyLayout::PerChannel)).kv_row_bytes(64) / 256.0,
            45.0 / 256.0
        );
    }
}
