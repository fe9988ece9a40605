//! How a context's stored KV rows are encoded: plain f32 / f16 / bf16, HACK's 2-bit
//! homomorphic form (`hack2`), or 4-bit per-channel keys with 3-bit values (`kv43`), chosen
//! per context.
//!
//! With `hack2` or `kv43`, rows are encoded when they become part of an indexed unit (a wave
//! segment, a PQ block of Π tokens): the steady zone (sink, local window, pending tokens)
//! stays in the plain type until then, which is HACK's requantization elimination: every
//! value is quantized exactly once, never re-quantized as the sequence grows.

use crate::cpu::hack::{HackParams, KeyLayout};
use crate::cpu::kv43::Kv43Params;
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
    /// Keys in 4 bits per channel over groups of tokens, values in 3 bits per channel over
    /// blocks of 64 tokens (`cpu::kv43`), attended on the codes; rows not yet encoded are
    /// f16. `kv43` (key groups of 128 tokens) or `kv43:G`.
    Kv43(Kv43Params),
}

impl Codec {
    /// The type of rows kept unencoded (all rows for the plain codecs; the steady zone for
    /// `hack2`).
    pub fn plain_dtype(self) -> DType {
        match self {
            Codec::F32 => DType::F32,
            Codec::F16 | Codec::Hack2(_) | Codec::Kv43(_) => DType::F16,
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

    /// The 4+3-bit parameters, for `kv43`.
    pub fn kv43(self) -> Option<Kv43Params> {
        match self {
            Codec::Kv43(p) => Some(p),
            _ => None,
        }
    }

    /// True for the codecs that encode indexed rows (`hack2`, `hack2c`, `kv43`); their
    /// steady zone stays f16.
    pub fn is_encoded(self) -> bool {
        matches!(self, Codec::Hack2(_) | Codec::Kv43(_))
    }

    /// Stored bytes of one token's key and value rows in one KV head, metadata included
    /// (for `hack2`: 2-bit codes, per key partition and per value block an f16 minimum and
    /// scale, and the key code sums; for `kv43`: 4-bit key and 3-bit value codes, a u16 key
    /// code sum per 64 dimensions, per channel an f16 minimum and scale per key group and
    /// per value block).
    pub fn kv_row_bytes(self, head_dim: usize) -> f64 {
        match self {
            Codec::Kv43(p) => p.bytes_per_token(head_dim),
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

    /// The name on the command line and in JSON (`f32`, `f16`, `bf16`, `hack2`, `hack2c`,
    /// `kv43`).
    pub fn name(self) -> &'static str {
        match self {
            Codec::Kv43(_) => "kv43",
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
            Codec::Kv43(p) if p.key_group != Kv43Params::default().key_group => {
                write!(f, "{}:{}", self.name(), p.key_group)
            }
            c => f.write_str(c.name()),
        }
    }
}

impl FromStr for Codec {
    type Err = String;
    /// `f32`, `f16`, `bf16`, `hack2` / `hack2c` (Π = 64) or `hack2:Π` / `hack2c:Π`, `kv43`
    /// (key groups of 128 tokens) or `kv43:G`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        const EXPECTED: &str = "expected f32, f16, bf16, hack2, hack2c, hack2:N, hack2c:N, kv43 or kv43:N";
        let lower = s.to_ascii_lowercase();
        if let Some(rest) = lower.strip_prefix("kv43") {
            let group = match rest.strip_prefix(':') {
                Some(n) => n.parse::<usize>().map_err(|_| format!("bad key group in {s:?}: {EXPECTED}"))?,
                None if rest.is_empty() => Kv43Params::default().key_group,
                None => return Err(format!("unknown codec {s:?}: {EXPECTED}")),
            };
            return Kv43Params::with_key_group(group).map(Codec::Kv43).map_err(|e| e.to_string());
        }
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
        let kv43_256 = Codec::Kv43(Kv43Params::with_key_group(256).unwrap());
        for c in [
            Codec::F32,
            Codec::F16,
            Codec::Bf16,
            Codec::Hack2(HackParams::default()),
            Codec::Hack2(channel),
            Codec::Kv43(Kv43Params::default()),
            kv43_256,
        ] {
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
        // kv43: key groups of 128 tokens unless named; a group must hold whole value blocks.
        assert_eq!("kv43".parse::<Codec>(), Ok(Codec::Kv43(Kv43Params::default())));
        assert_eq!("KV43".parse::<Codec>(), Ok(Codec::Kv43(Kv43Params::default())));
        assert_eq!(Codec::Kv43(Kv43Params::default()).to_string(), "kv43");
        assert_eq!("kv43:256".parse::<Codec>(), Ok(kv43_256));
        assert_eq!(kv43_256.to_string(), "kv43:256");
        assert!("kv43:96".parse::<Codec>().unwrap_err().contains("multiple of the value block"));
        assert!("kv43:0".parse::<Codec>().unwrap_err().contains("multiple of the value block"));
        assert!("kv43:x".parse::<Codec>().unwrap_err().contains("bad key group"));
        assert!("kv43c".parse::<Codec>().unwrap_err().contains("kv43"));
        assert!(Codec::Kv43(Kv43Params::default()).is_encoded() && Codec::Hack2(p32).is_encoded());
        assert!(!Codec::F16.is_encoded() && Codec::Kv43(Kv43Params::default()).hack().is_none());
        assert_eq!(Codec::Kv43(Kv43Params::default()).plain_dtype(), DType::F16);
    }

    #[test]
    fn kv43_rows_are_a_quarter_of_f16_with_every_byte_of_metadata() {
        let kv43 = Codec::Kv43(Kv43Params::default());
        // d = 128: 64 bytes of 4-bit keys, 48 of 3-bit values, two u16 key code sums, and
        // per channel f16 minimum + scale over 128 key rows (4 B) and 64 value rows (8 B).
        assert_eq!(kv43.kv_row_bytes(128), 64.0 + 48.0 + 4.0 + 4.0 + 8.0);
        assert_eq!(kv43.kv_row_bytes(128) / Codec::F16.kv_row_bytes(128), 0.25);
        assert_eq!(kv43.kv_row_bytes(64) / Codec::F16.kv_row_bytes(64), 0.25);
        // The study's 0.246 counts one byte of code sum per 64 dimensions where kv43 stores
        // two (a sum of 64 4-bit codes reaches 960).
        assert_eq!((kv43.kv_row_bytes(128) - 2.0) / 512.0, 0.246_093_75);
        // Longer key groups spend less on key metadata: 4·d/G bytes.
        let g256 = Codec::Kv43(Kv43Params::with_key_group(256).unwrap());
        assert_eq!(kv43.kv_row_bytes(128) - g256.kv_row_bytes(128), 2.0);
        // The figure is what Kv43Rows holds, byte for byte.
        let rows =
            crate::cpu::kv43::Kv43Rows::encode(&[0.5; 256 * 128], &[0.25; 256 * 128], 128, Kv43Params::default())
                .unwrap();
        assert_eq!(rows.bytes() as f64, 256.0 * kv43.kv_row_bytes(128));
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
