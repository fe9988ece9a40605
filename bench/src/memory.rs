//! What a synthetic run needs in memory, and whether this machine has it: the commands that
//! generate synthetic KV (`bench`, `explain`, `inspect`, `bench-wal`) compare the bytes a
//! context of the asked length needs with `MemAvailable` before allocating anything, so a
//! context that cannot fit is refused with the figures rather than aborting in the allocator.

use crate::synth::SynthParams;
use attnstore::{AttnShape, Codec, Method};

/// Bytes per key element a wave context holds beyond its rows: cluster centroids and value
/// sums, and the working buffers of the clustering (about 1.25x the keys in f32), which
/// the allocator keeps after the prefill. Peak RSS of `attnstore explain --tokens 256K`
/// (8 KV heads, d=128): flat f16 3.02 GiB, PQ f16 3.03 GiB, wave f16 4.24 GiB, wave hack2
/// 3.40 GiB; of `attnstore bench --tokens 128K` 3.64 GiB (all methods) and 2.53 GiB (PQ).
const WAVE_BYTES_PER_KEY_ELEMENT: f64 = 5.0;
/// Slack on a context's bytes (PQ codes and codebooks, allocator rounding): the estimates
/// of the runs above are 4-7% over their measured peaks.
const CONTEXT_SLACK: f64 = 1.1;
/// Floor added to every run whatever its length (binary, thread stacks, small buffers).
const FIXED_BYTES: u64 = 64 << 20;

/// Bytes one engine context of `codec` and `method` holds for `tokens` tokens in one layer:
/// its stored rows ([`Codec::kv_row_bytes`]), for a wave index its clusters and clustering
/// buffers, and some slack. `None` past `u64`.
pub fn context_bytes(shape: &AttnShape, codec: Codec, method: &Method, tokens: usize) -> Option<u64> {
    let token_heads = tokens as f64 * shape.kv_heads as f64;
    let rows = token_heads * codec.kv_row_bytes(shape.head_dim);
    let index = match method {
        Method::Wave(_) => token_heads * shape.head_dim as f64 * WAVE_BYTES_PER_KEY_ELEMENT,
        Method::Flat | Method::Pq(_) => 0.0,
    };
    let bytes = (rows + index) * CONTEXT_SLACK;
    (bytes < u64::MAX as f64).then_some(bytes as u64)
}

/// Bytes a run needs at its peak when it holds a synthetic context of `tokens` tokens
/// together with `steady(tokens)` bytes of other buffers (engine contexts, narrowed copies):
/// the larger of [`SynthParams::peak_bytes`] (generation, when nothing else is allocated yet)
/// and the generated keys and values plus `steady`, plus a fixed floor. `None` past `u64`.
pub fn run_bytes(shape: &AttnShape, tokens: usize, steady: Option<u64>) -> Option<u64> {
    let params = SynthParams::new(*shape, tokens, 0);
    let held = params.kv_bytes()?.checked_add(steady?)?;
    held.max(params.peak_bytes()?).checked_add(FIXED_BYTES)
}

/// Bytes of memory available for new allocations: `MemAvailable` of `/proc/meminfo`
/// (`None` where that file or line is missing or unreadable: the caller skips its check).
pub fn available_bytes() -> Option<u64> {
    parse_mem_available(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line["MemAvailable:".len()..].split_whitespace();
    let kib: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") | None => kib.checked_mul(1024),
        Some(_) => None,
    }
}

/// A context too large for the memory available.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{what}: {tokens} tokens need about {} of memory ({needed_bytes} bytes: synthetic f32 keys and values \
     plus what the engine stores), but {} are available (MemAvailable); at most about {fits_tokens} tokens \
     fit with this shape and codec",
    human(*needed_bytes),
    human(*available_bytes)
)]
pub struct TooLarge {
    /// What was asked (the command and its option).
    pub what: String,
    /// Tokens asked for.
    pub tokens: usize,
    /// Bytes the run needs.
    pub needed_bytes: u64,
    /// Bytes available.
    pub available_bytes: u64,
    /// The largest token count whose need fits in the available bytes (0 when none does).
    pub fits_tokens: usize,
}

/// `300.0 MiB`, `1.5 GiB`, `2.0 TiB`.
fn human(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..=0xF_FFFF => format!("{bytes} B"),
        0x10_0000..=0x3FFF_FFFF => format!("{:.1} MiB", b / (1u64 << 20) as f64),
        0x4000_0000..=0xFF_FFFF_FFFF => format!("{:.1} GiB", b / (1u64 << 30) as f64),
        _ => format!("{:.1} TiB", b / (1u64 << 40) as f64),
    }
}

/// Checks that `needed(tokens)` bytes fit in `available` bytes (`None`: not known, the
/// check passes). `needed` must grow with the token count (it is searched for the largest
/// count that fits); `None` from it means the count overflows and never fits.
pub fn check_fits(
    what: &str,
    tokens: usize,
    available: Option<u64>,
    needed: impl Fn(usize) -> Option<u64>,
) -> Result<(), TooLarge> {
    let Some(available) = available else { return Ok(()) };
    let fits = |t: usize| needed(t).is_some_and(|b| b <= available);
    if fits(tokens) {
        return Ok(());
    }
    // Largest count that fits, by bisection over 0..tokens (the need grows with the count).
    let (mut lo, mut hi) = (0usize, tokens);
    while lo + 1 < hi {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Err(TooLarge {
        what: what.to_string(),
        tokens,
        needed_bytes: needed(tokens).unwrap_or(u64::MAX),
        available_bytes: available,
        fits_tokens: if fits(lo) { lo } else { 0 },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_kib_and_missing_lines_give_none() {
        let meminfo = "MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(parse_mem_available(meminfo), Some(2 << 20));
        assert_eq!(parse_mem_available("MemTotal: 10 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: lots\n"), None);
    }

    #[test]
    fn a_context_that_does_not_fit_is_refused_with_the_largest_count_that_does() {
        let shape = AttnShape::new(32, 8, 128).unwrap();
        let need = |t: usize| run_bytes(&shape, t, context_bytes(&shape, Codec::F16, &Method::default(), t));
        let available = need(100_000);
        assert_eq!(check_fits("bench --tokens", 100_000, available, need), Ok(()));
        assert_eq!(check_fits("bench --tokens", 1 << 30, None, need), Ok(()));
        let err = check_fits("bench --tokens", 64 << 20, available, need).unwrap_err();
        assert_eq!(err.fits_tokens, 100_000);
        assert_eq!(err.tokens, 64 << 20);
        let text = err.to_string();
        assert!(text.starts_with("bench --tokens: 67108864 tokens need about"), "{text}");
        assert!(text.contains("at most about 100000 tokens fit"), "{text}");
    }

    #[test]
    fn an_overflowing_count_never_fits() {
        let shape = AttnShape::new(32, 8, 128).unwrap();
        let need = |t: usize| run_bytes(&shape, t, context_bytes(&shape, Codec::F16, &Method::default(), t));
        let err = check_fits("explain --tokens", usize::MAX / 2, Some(1 << 40), need).unwrap_err();
        assert_eq!(err.needed_bytes, u64::MAX);
        assert!(err.fits_tokens > 0);
    }
}
