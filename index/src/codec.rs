//! The codec of an access method's indexed rows, as a type: plain rows of the method's
//! element type, HACK's 2-bit rows, or kv43's 4-bit keys and 3-bit values. Methods hold a [`RowCodec`] and ask it to encode what
//! they build; the executor dispatches on the rows' form ([`crate::Run`]), never on
//! parameters.

use crate::error::{Error, Result};
use attnstore_kernels::random::SplitMix64;
use attnstore_kernels::{Codec, Element, HackParams, HackRows, Kv43Head, Kv43Params};

/// How an access method stores the rows it indexes (the steady zone is always plain).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowCodec {
    /// Rows in the method's element type.
    #[default]
    Plain,
    /// HACK 2-bit rows (keys and values quantized per partition of Π rows).
    Hack2(HackParams),
    /// kv43 rows: keys 4- or 5-bit per channel over key groups, values 3- or 4-bit per channel over
    /// value blocks ([`Kv43Head`] per KV head and segment: whole key groups encoded, the
    /// segment's last partial group in f16).
    Kv43(Kv43Params),
}

/// One head's segment rows in an encoded form.
#[derive(Debug, Clone)]
pub enum EncodedRows {
    /// HACK 2-bit rows (`hack2`).
    Hack(HackRows),
    /// kv43 rows: whole key groups encoded, the segment's last partial group in f16.
    Kv43(Kv43Head),
}

impl EncodedRows {
    /// Rows held.
    pub fn rows(&self) -> usize {
        match self {
            EncodedRows::Hack(r) => r.rows(),
            EncodedRows::Kv43(r) => r.rows(),
        }
    }

    /// Bytes held (codes, metadata and any f16 rows).
    pub fn bytes(&self) -> usize {
        match self {
            EncodedRows::Hack(r) => r.bytes(),
            EncodedRows::Kv43(r) => r.bytes(),
        }
    }

    /// The 2-bit rows, for `hack2`.
    pub fn hack(&self) -> Option<&HackRows> {
        match self {
            EncodedRows::Hack(r) => Some(r),
            EncodedRows::Kv43(_) => None,
        }
    }

    /// The kv43 rows, for `kv43`.
    pub fn kv43(&self) -> Option<&Kv43Head> {
        match self {
            EncodedRows::Kv43(r) => Some(r),
            EncodedRows::Hack(_) => None,
        }
    }
}

impl RowCodec {
    /// The row codec of a context codec (`f32`, `f16`, `bf16` are plain).
    pub fn of(codec: Codec) -> Self {
        match codec {
            Codec::Hack2(p) => RowCodec::Hack2(p),
            Codec::Kv43(p) => RowCodec::Kv43(p),
            Codec::F32 | Codec::F16 | Codec::Bf16 => RowCodec::Plain,
        }
    }

    /// The 2-bit parameters, for `hack2`.
    pub fn hack(self) -> Option<HackParams> {
        match self {
            RowCodec::Hack2(p) => Some(p),
            RowCodec::Plain | RowCodec::Kv43(_) => None,
        }
    }

    /// The 4+3-bit parameters, for `kv43`.
    pub fn kv43(self) -> Option<Kv43Params> {
        match self {
            RowCodec::Kv43(p) => Some(p),
            RowCodec::Plain | RowCodec::Hack2(_) => None,
        }
    }

    /// True for encoded rows (`hack2`, `kv43`).
    pub fn is_encoded(self) -> bool {
        !matches!(self, RowCodec::Plain)
    }

    /// Checks that rows of `head_dim` values can take this codec.
    pub(crate) fn check(self, head_dim: usize) -> Result<()> {
        if let RowCodec::Kv43(p) = self {
            return p.check(head_dim).map_err(|e| Error::InvalidParameter { what: "codec", message: e.to_string() });
        }
        if self.is_encoded() && !head_dim.is_multiple_of(4) {
            return Err(Error::InvalidParameter {
                what: "codec",
                message: format!("hack2 packs four values per byte: head_dim must be a multiple of 4, got {head_dim}"),
            });
        }
        Ok(())
    }

    /// Encodes plain `keys`/`values` (`rows × d`, in storage order) with rounding seeded by
    /// `seed` (`hack2`; `kv43` rounds to nearest), each value quantized once, or `None` for
    /// the plain codec.
    pub(crate) fn encode<E: Element>(
        self,
        keys: &[E],
        values: &[E],
        d: usize,
        seed: u64,
    ) -> Result<Option<EncodedRows>> {
        match self {
            RowCodec::Plain => Ok(None),
            RowCodec::Hack2(params) => {
                let mut rows = HackRows::new(d, params)?;
                rows.push_rows(keys, values, &mut SplitMix64::new(seed))?;
                Ok(Some(EncodedRows::Hack(rows)))
            }
            RowCodec::Kv43(params) => {
                let (mut k, mut v) = (vec![0.0f32; keys.len()], vec![0.0f32; values.len()]);
                E::widen(keys, &mut k);
                E::widen(values, &mut v);
                let mut head = Kv43Head::new(d, params)?;
                head.append(&k, &v)?;
                Ok(Some(EncodedRows::Kv43(head)))
            }
        }
    }
}

impl From<Option<HackParams>> for RowCodec {
    /// `Some` is `hack2` with those parameters, `None` plain.
    fn from(hack: Option<HackParams>) -> Self {
        hack.map_or(RowCodec::Plain, RowCodec::Hack2)
    }
}

impl From<Codec> for RowCodec {
    fn from(codec: Codec) -> Self {
        RowCodec::of(codec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    #[test]
    fn kv43_encodes_whole_key_groups_once_and_keeps_the_last_partial_group_in_f16() {
        let (d, rows) = (64, 300);
        let mut g = SplitMix64::new(3);
        let k: Vec<f16> = (0..rows * d).map(|_| f16::from_f32(g.normal())).collect();
        let v: Vec<f16> = (0..rows * d).map(|_| f16::from_f32(g.normal())).collect();
        let codec = RowCodec::of(Codec::Kv43(Kv43Params::default()));
        assert!(codec.is_encoded() && codec.hack().is_none() && codec.kv43().is_some());
        let Some(EncodedRows::Kv43(head)) = codec.encode(&k, &v, d, 1).unwrap() else { panic!("kv43 rows") };
        assert_eq!((head.rows(), head.encoded_rows()), (300, 256));
        // Rounding to nearest: encoding again gives the same codes (a restore re-derives them).
        let Some(EncodedRows::Kv43(again)) = codec.encode(&k, &v, d, 99).unwrap() else { panic!("kv43 rows") };
        assert_eq!(head, again);
        assert!(matches!(codec.check(48), Err(Error::InvalidParameter { .. })));
        assert!(codec.check(128).is_ok());
        assert_eq!(RowCodec::of(Codec::F16), RowCodec::Plain);
        // PQ takes kv43 where the head dimension does, and says why where it does not.
        let pq = |d| crate::PqIndex::<f16>::new(crate::PqParams::default(), 2, d).unwrap();
        assert!(pq(64).with_codec(Codec::Kv43(Kv43Params::default())).is_ok());
        let err = pq(48).with_codec(Codec::Kv43(Kv43Params::default())).unwrap_err();
        assert!(matches!(&err, Error::InvalidParameter { .. }) && err.to_string().contains("multiple of 64"), "{err}");
    }
}
