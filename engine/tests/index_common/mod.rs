//! Helpers shared by the access-method tests: seeded data, running every KV head of an
//! index through the engine's executor, and f64 reference attention.

use attnstore_index::{AccessMethod, ZoneBudget};
use attnstore_kernels::cpu::reference::reference_attention;
use attnstore_kernels::random::SplitMix64;
use attnstore_kernels::{narrow_vec, AttnShape, Element, HeadsView};

/// `n` normal values times `scale`, from `seed`.
pub fn randn(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut g = SplitMix64::new(seed);
    (0..n).map(|_| g.normal() * scale).collect()
}

/// Runs every KV head of `index` under `budget` (or exactly) and returns `q_heads × d` outputs.
pub fn run(index: &dyn AccessMethod, shape: &AttnShape, q: &[f32], budget: Option<&ZoneBudget>) -> Vec<f32> {
    let (g, d) = (shape.group(), shape.head_dim);
    let mut out = Vec::new();
    for h in 0..shape.kv_heads {
        let qg = &q[h * g * d..(h + 1) * g * d];
        let plan = match budget {
            Some(b) => index.plan_head(h, qg, b),
            None => index.plan_exact(),
        };
        for p in attnstore::execute_head(index, h, qg, d, &plan).expect("rows in memory are readable") {
            out.extend(p.finish());
        }
    }
    out
}

/// f64 attention over `tokens` tokens of `k`/`v` stored as `E`.
pub fn reference<E: Element>(shape: &AttnShape, q: &[f32], k: &[f32], v: &[f32], tokens: usize) -> Vec<f64> {
    let (kn, vn): (Vec<E>, Vec<E>) = (narrow_vec(k), narrow_vec(v));
    let d = shape.head_dim;
    let kv = HeadsView::new(&kn, shape.kv_heads, tokens, d).unwrap();
    let vv = HeadsView::new(&vn, shape.kv_heads, tokens, d).unwrap();
    reference_attention(shape, q, kv, vv, None)
}

/// Tokens `from..to` of `all` (`heads × total × d`) as one batch (`heads × (to − from) × d`).
#[allow(dead_code, reason = "used by the restore tests only")]
pub fn token_slice(all: &[f32], (heads, d): (usize, usize), total: usize, from: usize, to: usize) -> Vec<f32> {
    (0..heads).flat_map(|h| all[(h * total + from) * d..(h * total + to) * d].iter().copied()).collect()
}

/// Appends tokens `from..total` of `k`/`v` (`heads × total × d`) to `index` in batches of 37
/// tokens, as a decode loop with uneven steps would.
#[allow(dead_code, reason = "used by the restore tests only")]
pub fn append_in_batches(
    index: &mut dyn AccessMethod,
    (k, v): (&[f32], &[f32]),
    shape: (usize, usize),
    total: usize,
    from: usize,
) {
    let mut at = from;
    while at < total {
        let to = (at + 37).min(total);
        index.append(&token_slice(k, shape, total, at, to), &token_slice(v, shape, total, at, to)).unwrap();
        at = to;
    }
}
