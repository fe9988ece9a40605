//! Storage element types (f32, f16, bf16) and their conversion to the f32 compute type.
//!
//! KV is stored in a narrow type and widened to f32 tile by tile inside the kernels, so the
//! bytes read from memory are the stored bytes while all accumulation happens in f32.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use std::fmt;
use std::str::FromStr;

/// The storage data type of a context's keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// IEEE half precision (the default storage type).
    #[default]
    F16,
    /// bfloat16.
    Bf16,
}

impl DType {
    /// Bytes one element occupies.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }

    /// The lower-case name used on the command line and in JSON (`f32`, `f16`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(DType::F32),
            "f16" => Ok(DType::F16),
            "bf16" => Ok(DType::Bf16),
            other => Err(format!("unknown dtype {other:?}: expected f32, f16 or bf16")),
        }
    }
}

/// A storage element: something kernels can widen to f32 in bulk.
pub trait Element: Copy + Default + Send + Sync + bytemuck::Pod + 'static {
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Narrows one f32 (round to nearest even).
    fn from_f32(x: f32) -> Self;
    /// Widens one element.
    fn to_f32(self) -> f32;
    /// Widens `src` into `dst` (same length), using SIMD conversion where the CPU has it.
    fn widen(src: &[Self], dst: &mut [f32]);
    /// Narrows `src` into `dst` (same length).
    fn narrow(src: &[f32], dst: &mut [Self]);
    /// Widens exactly 8 elements (`src.len() == 8`) into one vector: a single `vcvtph2ps`
    /// for f16 on x86-64-v3, so kernels convert in registers instead of through memory.
    #[inline(always)]
    fn load8(src: &[Self]) -> wide::f32x8 {
        let mut a = [0.0f32; 8];
        Self::widen(src, &mut a);
        wide::f32x8::from(a)
    }
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline]
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[inline]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline]
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    #[inline]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;
    #[inline]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline]
    fn widen(src: &[Self], dst: &mut [f32]) {
        // bf16 is the upper half of an f32: a shift, which LLVM vectorizes.
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
    #[inline]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

/// Converts a whole f32 slice into a new vector of `E`.
pub fn narrow_vec<E: Element>(src: &[f32]) -> Vec<E> {
    let mut out = vec![E::default(); src.len()];
    E::narrow(src, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widening_matches_scalar_conversion_for_every_dtype() {
        let src: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.731).collect();
        fn check<E: Element>(src: &[f32]) {
            let narrow: Vec<E> = narrow_vec(src);
            let mut wide = vec![0.0; src.len()];
            E::widen(&narrow, &mut wide);
            for (w, n) in wide.iter().zip(&narrow) {
                assert_eq!(*w, n.to_f32());
            }
        }
        check::<f32>(&src);
        check::<f16>(&src);
        check::<bf16>(&src);
    }

    #[test]
    fn dtype_names_round_trip() {
        for d in [DType::F32, DType::F16, DType::Bf16] {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        assert!("f8".parse::<DType>().is_err());
    }
}

/// The index of the first element of `data` that is NaN or infinite, if any. Tests 64
/// elements at a time without branching (the loop vectorizes), so checking a decode step's
/// queries costs a fraction of a `position` scan.
pub fn first_non_finite(data: &[f32]) -> Option<usize> {
    const CHUNK: usize = 64;
    let finite = |x: &f32| x.to_bits() & 0x7f80_0000 != 0x7f80_0000;
    data.chunks(CHUNK).enumerate().find_map(|(c, chunk)| {
        let all = chunk.iter().fold(true, |ok, x| ok & finite(x));
        (!all).then(|| c * CHUNK + chunk.iter().position(|x| !finite(x)).unwrap_or(0))
    })
}

#[cfg(test)]
mod finite_tests {
    use super::first_non_finite;

    #[test]
    fn finds_the_first_nan_or_infinity_anywhere() {
        let mut x = vec![1.5f32; 300];
        assert_eq!(first_non_finite(&x), None);
        assert_eq!(first_non_finite(&[]), None);
        for (at, bad) in [(0, f32::NAN), (63, f32::INFINITY), (64, f32::NEG_INFINITY), (299, f32::NAN)] {
            x[at] = bad;
            x[299.min(at + 5)] = f32::NAN; // a later one must not be reported instead
            assert_eq!(first_non_finite(&x), Some(at), "{bad} at {at}");
            x.iter_mut().for_each(|v| *v = 1.5);
        }
        // The largest finite values and subnormals are finite.
        assert_eq!(first_non_finite(&[f32::MAX, f32::MIN, f32::MIN_POSITIVE / 2.0, -0.0]), None);
    }
}
