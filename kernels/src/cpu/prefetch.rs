//! Software prefetch of K and V rows ahead of the kernels. With one or two threads per
//! memory channel the hardware prefetchers alone keep too few misses in flight while the
//! kernels compute, so the attention loop asks for rows a few tiles ahead.

/// Hints the CPU to bring `data` into cache (a no-op off x86-64).
#[inline(always)]
pub(crate) fn prefetch<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let base = data.as_ptr().cast::<i8>();
        for off in (0..std::mem::size_of_val(data)).step_by(64) {
            prefetch_line(base.wrapping_add(off));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// Spreads the prefetch of a slice's cache lines over the iterations of a loop: each
/// [`Self::step`] asks for the lines due by then, so `steps` steps ask for every line once,
/// evenly (an add and a compare per step when no line is due).
pub(crate) struct Trickle<'a> {
    bytes: &'a [u8],
    lines: usize,
    steps: usize,
    credit: usize,
    next: usize,
}

impl<'a> Trickle<'a> {
    /// Prefetches `data` over `steps` calls of [`Self::step`] (nothing when `data` is empty).
    #[inline(always)]
    pub(crate) fn new<T: bytemuck::Pod>(data: &'a [T], steps: usize) -> Self {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        Self { bytes, lines: bytes.len().div_ceil(64), steps: steps.max(1), credit: 0, next: 0 }
    }

    /// One iteration of the loop: prefetches the lines now due.
    #[inline(always)]
    pub(crate) fn step(&mut self) {
        self.credit += self.lines;
        while self.credit >= self.steps {
            self.credit -= self.steps;
            if let Some(line) = self.bytes.get(self.next * 64..) {
                prefetch(&line[..1.min(line.len())]);
            }
            self.next += 1;
        }
    }
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

#[cfg(test)]
mod tests {
    use super::Trickle;

    #[test]
    fn a_trickle_asks_for_every_line_once_spread_evenly_over_its_steps() {
        for (bytes, steps) in [(64 * 1024, 2048), (64 * 1024, 512), (100, 7), (6400, 3), (0, 10), (64, 1)] {
            let data = vec![0u8; bytes];
            let mut t = Trickle::new(&data, steps);
            let lines = bytes.div_ceil(64);
            for k in 1..=steps {
                t.step();
                // By step k, exactly the lines due by then: floor(k · lines / steps).
                assert_eq!(t.next, k * lines / steps, "{bytes} bytes over {steps} steps, step {k}");
            }
            assert_eq!(t.next, lines);
        }
    }
}
