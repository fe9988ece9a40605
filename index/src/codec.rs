//! The codec of an access method's indexed rows, as a type: plain rows of the method's
//! element type, or HACK's 2-bit rows. Methods hold a [`RowCodec`] and ask it to encode what
//! they build; the executor dispatches on the rows' form ([`crate::Run`]), never on
//! parameters.

use crate::error::{Error, Result};
use attnstore_kernels::random::SplitMix64;
use attnstore_kernels::{Codec, Element, HackParams, HackRows};

/// How an access method stores the rows it indexes (the steady zone is always plain).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowCodec {
    /// Rows in the method's element type.
    #[default]
    Plain,
    /// HACK 2-bit rows (keys and values quantized per partition of Π rows).
    Hack2(HackParams),
}

impl RowCodec {
    /// The row codec of a context codec (`f32`, `f16`, `bf16` are plain).
    pub fn of(codec: Codec) -> Self {
        codec.hack().map_or(RowCodec::Plain, RowCodec::Hack2)
    }

    /// The 2-bit parameters, for `hack2`.
    pub fn hack(self) -> Option<HackParams> {
        match self {
            RowCodec::Plain => None,
            RowCodec::Hack2(p) => Some(p),
        }
    }

    /// True for 2-bit rows.
    pub fn is_encoded(self) -> bool {
        matches!(self, RowCodec::Hack2(_))
    }

    /// Checks that rows of `head_dim` values can take this codec.
    pub(crate) fn check(self, head_dim: usize) -> Result<()> {
        if self.is_encoded() && !head_dim.is_multiple_of(4) {
            return Err(Error::InvalidParameter {
                what: "codec",
                message: format!("hack2 packs four values per byte: head_dim must be a multiple of 4, got {head_dim}"),
            });
        }
        Ok(())
    }

    /// Encodes plain `keys`/`values` (`rows × d`, in storage order) with rounding seeded by
    /// `seed` (each value quantized once), or `None` for the plain codec.
    pub(crate) fn encode<E: Element>(self, keys: &[E], values: &[E], d: usize, seed: u64) -> Result<Option<HackRows>> {
        let RowCodec::Hack2(params) = self else { return Ok(None) };
        let mut rows = HackRows::new(d, params)?;
        rows.push_rows(keys, values, &mut SplitMix64::new(seed))?;
        Ok(Some(rows))
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
