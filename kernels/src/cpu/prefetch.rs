//! Software prefetch of K and V rows ahead of the kernels. With one or two threads per
//! memory channel the hardware prefetchers alone keep too few misses in flight while the
//! kernels compute, so the attention loop asks for rows a few tiles ahead.

/// Hints the CPU to bring `data` into cache (a no-op off x86-64).
#[inline(always)]
pub(crate) fn prefetch<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        // A plain counted loop (`step_by` cost ~5 instructions a line around the prefetch).
        let base = data.as_ptr().cast::<i8>();
        let lines = std::mem::size_of_val(data).div_ceil(64);
        for i in 0..lines {
            prefetch_line(base.wrapping_add(i * 64));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(unsafe_code, reason = "the prefetch intrinsic is an unsafe fn, though it cannot fault")]
fn prefetch_line(p: *const i8) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    // SAFETY: `_mm_prefetch` (SSE, present on every x86-64 CPU) is only a hint: it never
    // faults and has no architectural effect whatever the address; `p` points into a slice.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p) }
}
