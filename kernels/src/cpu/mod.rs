//! The CPU backend: f32 accumulation over narrow storage, rayon threads across heads and
//! token chunks, inner loops shaped for auto-vectorization (see `simd.rs`).

pub mod attention;
pub mod estimate;
mod gemm;
pub mod hack;
#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
mod hack_avx2;
#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
mod hack_avx512;
pub mod hack_rows;
pub mod kmeans;
pub mod kv43;
mod microkernel;
pub mod partial;
pub mod pq;
mod prefetch;
pub mod reference;
pub mod scoring;
mod simd;

pub use gemm::matmul_transposed;
