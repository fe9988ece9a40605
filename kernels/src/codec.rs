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
use std::ops::RangeInclusive;
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
    /// Keys in 4 (or 5) bits per channel over groups of tokens, values in 3 (or 4) bits per
    /// channel over blocks of tokens (`cpu::kv43`), attended on the codes; rows not yet
    /// encoded are f16. `kv43` (4-bit keys over 128 tokens, 3-bit values over 64), or with
    /// any of `:kB` (key bits), `:vB` (value bits), `:G` or `:gG` (key group), `:bN` (value
    /// block), e.g. `kv43:k5:b128`.
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
    /// scale, and the key code sums; for `kv43`: 4- or 5-bit key and 3- or 4-bit value codes, a u16 key
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
            Codec::Kv43(p) => {
                let d = Kv43Params::default();
                f.write_str(self.name())?;
                if p.key_bits != d.key_bits {
                    write!(f, ":k{}", p.key_bits)?;
                }
                if p.value_bits != d.value_bits {
                    write!(f, ":v{}", p.value_bits)?;
                }
                if p.key_group != d.key_group {
                    write!(f, ":{}", p.key_group)?;
                }
                if p.value_block != d.value_block {
                    write!(f, ":b{}", p.value_block)?;
                }
                Ok(())
            }
            c => f.write_str(c.name()),
        }
    }
}

impl FromStr for Codec {
    type Err = String;
    /// `f32`, `f16`, `bf16`, `hack2` / `hack2c` (Π = 64) or `hack2:Π` / `hack2c:Π`, `kv43`
    /// (4-bit keys over groups of 128 tokens, 3-bit values over blocks of 64) with any of
    /// `:kB` (key bits, 4 or 5), `:vB` (value bits, 3 or 4), `:G` or `:gG` (key group) and
    /// `:bN` (value block).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        const EXPECTED: &str =
            "expected f32, f16, bf16, hack2, hack2c, hack2:N, hack2c:N, or kv43 with any of :kBITS :vBITS :gGROUP :bBLOCK";
        let lower = s.to_ascii_lowercase();
        if let Some(rest) = lower.strip_prefix("kv43") {
            if !rest.is_empty() && !rest.starts_with(':') {
                return Err(format!("unknown codec {s:?}: {EXPECTED}"));
            }
            let mut p = Kv43Params::default();
            let bits = |n: usize, what: &str| u8::try_from(n).map_err(|_| format!("bad {what} in {s:?}: {EXPECTED}"));
            for part in rest.split(':').skip(1) {
                let number =
                    |x: &str, what: &str| x.parse::<usize>().map_err(|_| format!("bad {what} in {s:?}: {EXPECTED}"));
                if let Some(n) = part.strip_prefix('k') {
                    p.key_bits = bits(number(n, "key bits")?, "key bits")?;
                } else if let Some(n) = part.strip_prefix('v') {
                    p.value_bits = bits(number(n, "value bits")?, "value bits")?;
                } else if let Some(n) = part.strip_prefix('b') {
                    p.value_block = number(n, "value block")?;
                } else {
                    p.key_group = number(part.strip_prefix('g').unwrap_or(part), "key group")?;
                }
            }
            return p.check_groups().map(|()| Codec::Kv43(p)).map_err(|e| e.to_string());
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

/// Most layer ranges a context may give a codec of their own ([`CodecOverrides`]).
pub const MAX_CODEC_OVERRIDES: usize = 4;

/// Codecs for ranges of a context's layers, overriding its codec there (e.g. 5-bit `kv43`
/// keys in the layers whose keys need them): at most [`MAX_CODEC_OVERRIDES`] disjoint
/// ranges, kept in a fixed array so configurations holding it stay `Copy`. Written
/// `A-B=CODEC` (or `A=CODEC`), ranges inclusive, comma-separated; empty for none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CodecOverrides {
    ranges: [Option<(u32, u32, Codec)>; MAX_CODEC_OVERRIDES],
}

impl CodecOverrides {
    /// These overrides and `codec` for layers `layers`; more than [`MAX_CODEC_OVERRIDES`]
    /// ranges, an empty range or one overlapping another is an error saying so.
    pub fn with(mut self, layers: RangeInclusive<usize>, codec: Codec) -> Result<Self, String> {
        let (first, last) = (*layers.start(), *layers.end());
        if first > last {
            return Err(format!("layer range {first}-{last} is empty"));
        }
        let wide = |x: usize| u32::try_from(x).map_err(|_| format!("layer {x} is out of range"));
        let (first, last) = (wide(first)?, wide(last)?);
        if let Some((a, b, _)) = self.iter_raw().find(|&(a, b, _)| first <= b && a <= last) {
            return Err(format!("layers {first}-{last} overlap layers {a}-{b}, which already have a codec"));
        }
        let Some(free) = self.ranges.iter_mut().find(|r| r.is_none()) else {
            return Err(format!("at most {MAX_CODEC_OVERRIDES} layer ranges can have their own codec"));
        };
        *free = Some((first, last, codec));
        self.ranges.sort_by_key(|r| r.map_or(u32::MAX, |(a, _, _)| a));
        Ok(self)
    }

    fn iter_raw(&self) -> impl Iterator<Item = (u32, u32, Codec)> + '_ {
        self.ranges.iter().flatten().copied()
    }

    /// The ranges (inclusive) and their codecs, in layer order.
    pub fn iter(&self) -> impl Iterator<Item = (RangeInclusive<usize>, Codec)> + '_ {
        self.iter_raw().map(|(a, b, c)| (a as usize..=b as usize, c))
    }

    /// The codec of `layer` where a range names it.
    pub fn get(&self, layer: usize) -> Option<Codec> {
        self.iter_raw().find(|&(a, b, _)| (a as usize..=b as usize).contains(&layer)).map(|(_, _, c)| c)
    }

    /// True when no range has a codec of its own.
    pub fn is_empty(&self) -> bool {
        self.ranges.iter().all(Option::is_none)
    }

    /// The last layer any range names, if any.
    pub fn last_layer(&self) -> Option<usize> {
        self.iter_raw().map(|(_, b, _)| b as usize).max()
    }
}

impl fmt::Display for CodecOverrides {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (a, b, c)) in self.iter_raw().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            if a == b {
                write!(f, "{sep}{a}={c}")?;
            } else {
                write!(f, "{sep}{a}-{b}={c}")?;
            }
        }
        Ok(())
    }
}

impl FromStr for CodecOverrides {
    type Err = String;
    /// `A-B=CODEC` or `A=CODEC`, comma-separated (empty: none).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = Self::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((layers, codec)) = part.split_once('=') else {
                return Err(format!("bad layer codec {part:?}: expected LAYERS=CODEC, e.g. 17-21=kv43:k5"));
            };
            let layer = |x: &str| x.trim().parse::<usize>().map_err(|_| format!("bad layer {x:?} in {part:?}"));
            let range = match layers.split_once('-') {
                Some((a, b)) => layer(a)?..=layer(b)?,
                None => layer(layers)?..=layer(layers)?,
            };
            out = out.with(range, codec.trim().parse()?)?;
        }
        Ok(out)
    }
}

/// A context's codec and its overrides for ranges of layers, as the command line and JSON
/// write them: `CODEC` or `CODEC,A-B=CODEC,…`, e.g. `kv43:b128,17-21=kv43:k5`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LayerCodecs {
    /// The codec of every layer no range names.
    pub default: Codec,
    /// Ranges of layers with a codec of their own.
    pub overrides: CodecOverrides,
}

impl LayerCodecs {
    /// Every layer in `codec`.
    pub fn uniform(codec: Codec) -> Self {
        Self { default: codec, overrides: CodecOverrides::default() }
    }

    /// The codec of `layer`.
    pub fn of(&self, layer: usize) -> Codec {
        self.overrides.get(layer).unwrap_or(self.default)
    }

    /// True when any layer's codec encodes its indexed rows.
    pub fn is_encoded(&self) -> bool {
        self.default.is_encoded() || self.overrides.iter().any(|(_, c)| c.is_encoded())
    }

    /// The type of rows kept unencoded (the default codec's; a context checks that every
    /// layer's agrees).
    pub fn plain_dtype(&self) -> DType {
        self.default.plain_dtype()
    }
}

impl From<Codec> for LayerCodecs {
    fn from(codec: Codec) -> Self {
        Self::uniform(codec)
    }
}

impl fmt::Display for LayerCodecs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.default)?;
        if !self.overrides.is_empty() {
            write!(f, ",{}", self.overrides)?;
        }
        Ok(())
    }
}

impl FromStr for LayerCodecs {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (default, rest) = s.split_once(',').unwrap_or((s, ""));
        Ok(Self { default: default.trim().parse()?, overrides: rest.parse()? })
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
        // Key bits and value blocks: only what differs from the default is written.
        let k5 = Kv43Params { key_bits: 5, ..Kv43Params::default() };
        assert_eq!("kv43:k5".parse::<Codec>(), Ok(Codec::Kv43(k5)));
        let b128 = Kv43Params { value_block: 128, ..Kv43Params::default() };
        assert_eq!(Codec::Kv43(b128).to_string(), "kv43:b128");
        let all = Kv43Params { key_bits: 5, value_bits: 4, key_group: 256, value_block: 128 };
        assert_eq!("kv43:k5:v4:g256:b128".parse::<Codec>(), Ok(Codec::Kv43(all)));
        assert_eq!(Codec::Kv43(all).to_string(), "kv43:k5:v4:256:b128");
        assert_eq!(Codec::Kv43(all).to_string().parse::<Codec>(), Ok(Codec::Kv43(all)));
        assert!("kv43:k6".parse::<Codec>().unwrap_err().contains("4 or 5 bits"));
        assert!("kv43:v2".parse::<Codec>().unwrap_err().contains("3 or 4 bits"));
        assert!("kv43:k300".parse::<Codec>().unwrap_err().contains("key bits"));
        assert!("kv43:b256".parse::<Codec>().unwrap_err().contains("multiple of the value block"));
        assert!("kv43:bx".parse::<Codec>().unwrap_err().contains("bad value block"));
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

#[cfg(test)]
mod layer_tests {
    use super::*;

    #[test]
    fn layer_codecs_parse_back_find_each_layers_codec_and_refuse_bad_tables() {
        let lc: LayerCodecs = "kv43:b128,17-21=kv43:k5, 3=f16".parse().unwrap();
        let k5 = Codec::Kv43(Kv43Params { key_bits: 5, ..Kv43Params::default() });
        let b128 = Codec::Kv43(Kv43Params { value_block: 128, ..Kv43Params::default() });
        assert_eq!((lc.of(16), lc.of(17), lc.of(21), lc.of(22), lc.of(3)), (b128, k5, k5, b128, Codec::F16));
        // Ranges are kept in layer order, whatever order they were given in.
        assert_eq!(lc.to_string(), "kv43:b128,3=f16,17-21=kv43:k5");
        assert_eq!(lc.to_string().parse::<LayerCodecs>(), Ok(lc));
        assert_eq!(lc.overrides.last_layer(), Some(21));
        assert_eq!("kv43".parse::<LayerCodecs>(), Ok(LayerCodecs::uniform(Codec::Kv43(Kv43Params::default()))));
        assert_eq!(LayerCodecs::uniform(Codec::F16).to_string(), "f16");
        assert!("kv43,5-9=kv43,7=f16".parse::<LayerCodecs>().unwrap_err().contains("overlap"));
        assert!("kv43,9-5=f16".parse::<LayerCodecs>().unwrap_err().contains("empty"));
        assert!("kv43,x=f16".parse::<LayerCodecs>().unwrap_err().contains("bad layer"));
        assert!("kv43,5".parse::<LayerCodecs>().unwrap_err().contains("LAYERS=CODEC"));
        assert!("kv43,5=int4".parse::<LayerCodecs>().unwrap_err().contains("unknown codec"));
        let five = "f16,0=f16,1=f16,2=f16,3=f16,4=f16".parse::<LayerCodecs>().unwrap_err();
        assert!(five.contains("at most 4"), "{five}");
    }
}
