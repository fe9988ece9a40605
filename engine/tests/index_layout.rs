//! A wave index restored from its layout and the same KV (a checkpoint's index meta data)
//! is the index it came from: same segments, clusters, rows, 2-bit codes and answers, with
//! no clustering; a layout that does not fit is a typed error that changes nothing.

#[allow(dead_code, reason = "helpers shared by the test files; this one uses some")]
#[path = "index_common/mod.rs"]
mod common;

use attnstore_index::{AccessMethod, SelectionMode, Snapshots, WaveIndex, WaveLayout, WaveParams, ZoneBudget};
use attnstore_kernels::{AttnShape, HackParams};
use common::{append_in_batches, randn, run, token_slice};
use half::f16;

const HEADS: usize = 2;
const D: usize = 32;

fn params() -> WaveParams {
    WaveParams { segment_tokens: 512, decode_segment_tokens: 128, ..WaveParams::default() }
}

/// Tokens `from..to` of `all` (`HEADS × total × D`) as one batch (`HEADS × n × D`).
fn slice(all: &[f32], total: usize, from: usize, to: usize) -> Vec<f32> {
    token_slice(all, (HEADS, D), total, from, to)
}

/// Prefill `prefill` tokens, then append the rest in batches of 37.
fn build(hack: Option<HackParams>, k: &[f32], v: &[f32], total: usize, prefill: usize) -> WaveIndex<f16> {
    let mut w = WaveIndex::<f16>::new(params(), HEADS, D).unwrap().with_codec(hack).unwrap();
    w.prefill(&slice(k, total, 0, prefill), &slice(v, total, 0, prefill)).unwrap();
    append_in_batches(&mut w, (k, v), (HEADS, D), total, prefill);
    w
}

#[test]
fn a_restored_index_is_the_index_it_came_from() {
    let shape = AttnShape::new(8, HEADS, D).unwrap();
    let total = 2000;
    let (k, v) = (randn(shape.kv_len(total), 1, 1.0), randn(shape.kv_len(total), 2, 1.0));
    for hack in [None, Some(HackParams::default())] {
        let original = build(hack, &k, &v, total, 1200);
        let layout = original.layout();
        // What a checkpoint compares before it copies a layout.
        assert_eq!(Snapshots::layout_end(&original), Some(layout.tail_start));
        assert!(layout.segments.len() >= 3, "prefill and decode segments: {}", layout.segments.len());
        let mut restored = WaveIndex::<f16>::new(params(), HEADS, D).unwrap().with_codec(hack).unwrap();
        restored.restore(&layout, &k, &v).unwrap();
        assert_eq!(restored.layout(), layout);
        assert_eq!(restored.stats(), original.stats());
        for seed in 0..3 {
            let q = randn(shape.query_len(), 10 + seed, 2.0);
            assert_eq!(run(&restored, &shape, &q, None), run(&original, &shape, &q, None), "exact, {hack:?}");
            for mode in [SelectionMode::PerKvHead, SelectionMode::PerQueryHead] {
                let zone = ZoneBudget { retrieve_tokens: 100, estimate_tokens: 400, mode };
                for h in 0..HEADS {
                    let qh = &q[h * 4 * D..(h + 1) * 4 * D];
                    assert_eq!(restored.plan_head(h, qh, &zone), original.plan_head(h, qh, &zone));
                }
                assert_eq!(run(&restored, &shape, &q, Some(&zone)), run(&original, &shape, &q, Some(&zone)));
            }
        }
        // Decoding goes on from the restored state exactly as from the original.
        let more = randn(HEADS * 300 * D, 7, 1.0);
        let (mut a, mut b) = (original, restored);
        a.append(&more, &more).unwrap();
        b.append(&more, &more).unwrap();
        assert_eq!(a.layout(), b.layout());
    }
}

#[test]
fn a_layout_that_does_not_fit_is_a_typed_error_and_changes_nothing() {
    let shape = AttnShape::new(8, HEADS, D).unwrap();
    let total = 1500;
    let (k, v) = (randn(shape.kv_len(total), 3, 1.0), randn(shape.kv_len(total), 4, 1.0));
    let good = build(None, &k, &v, total, 1500).layout();
    let mut broken: Vec<(&str, WaveLayout)> = Vec::new();
    let mut dup = good.clone();
    dup.segments[0].heads[1].positions[1] = dup.segments[0].heads[1].positions[0];
    broken.push(("a position twice", dup));
    let mut sizes = good.clone();
    sizes.segments[1].heads[0].sizes[0] += 1;
    broken.push(("sizes not summing to the segment", sizes));
    let mut gap = good.clone();
    gap.segments.remove(0);
    broken.push(("a missing segment", gap));
    let mut heads = good.clone();
    heads.segments[0].heads.pop();
    broken.push(("a missing head", heads));
    let mut tokens = good.clone();
    tokens.tokens += 1;
    broken.push(("more tokens than the KV", tokens));
    let mut outside = good.clone();
    outside.segments[0].heads[0].positions[0] = 1_000_000;
    broken.push(("a position outside its segment", outside));
    for (what, layout) in broken {
        let mut w = WaveIndex::<f16>::new(params(), HEADS, D).unwrap();
        let err = w.restore(&layout, &k, &v).unwrap_err();
        assert!(err.to_string().contains("wave layout") || err.to_string().contains("expected"), "{what}: {err}");
        assert_eq!(w.stats().tokens, 0, "{what}");
        assert!(w.layout().segments.is_empty(), "{what}");
    }
    // A non-empty index is not restored over.
    let mut w = build(None, &k, &v, total, 1500);
    assert!(w.restore(&good, &k, &v).is_err());
}

#[test]
fn a_hack2_index_restored_from_its_encoded_home_is_the_index_it_came_from() {
    let shape = AttnShape::new(8, HEADS, D).unwrap();
    let total = 2000;
    let (k, v) = (randn(shape.kv_len(total), 11, 1.0), randn(shape.kv_len(total), 12, 1.0));
    let hack = Some(HackParams::new(32).unwrap());
    let original = build(hack, &k, &v, total, 1200);
    let segments = original.layout().segments.len();
    assert!(segments >= 3, "prefill and decode segments: {segments}");
    assert_eq!(Snapshots::encoded_segments(&original), Some(segments));
    let home = original.encoded_home(0).unwrap().unwrap();
    let (encoded, steady) = home.bytes();
    // Sink (4) and tail rows, keys and values, 2 bytes a value.
    let plain_rows = 4 + total - original.layout().tail_start as usize;
    assert_eq!(steady, plain_rows * 2 * HEADS * D * 2);
    assert!(encoded < total * HEADS * D * 2 * 2 / 2, "2-bit rows and means {encoded} B");
    let mut restored = WaveIndex::<f16>::new(params(), HEADS, D).unwrap().with_codec(hack).unwrap();
    restored.restore_encoded(home.clone()).unwrap();
    assert_eq!(restored.layout(), original.layout());
    assert_eq!(restored.stats(), original.stats());
    for seed in 0..3 {
        let q = randn(shape.query_len(), 20 + seed, 2.0);
        assert_eq!(run(&restored, &shape, &q, None), run(&original, &shape, &q, None), "exact");
        let zone = ZoneBudget { retrieve_tokens: 100, estimate_tokens: 400, mode: SelectionMode::PerKvHead };
        for h in 0..HEADS {
            let qh = &q[h * 4 * D..(h + 1) * 4 * D];
            assert_eq!(restored.plan_head(h, qh, &zone), original.plan_head(h, qh, &zone));
        }
        assert_eq!(run(&restored, &shape, &q, Some(&zone)), run(&original, &shape, &q, Some(&zone)));
    }
    // Decoding goes on from the restored state exactly as from the original, and the new
    // segment is the only one a later checkpoint needs to write.
    let more = randn(HEADS * 300 * D, 17, 1.0);
    let (mut a, mut b) = (original, restored);
    a.append(&more, &more).unwrap();
    b.append(&more, &more).unwrap();
    assert_eq!(a.layout(), b.layout());
    let q = randn(shape.query_len(), 30, 2.0);
    assert_eq!(run(&a, &shape, &q, None), run(&b, &shape, &q, None));
    let later = a.encoded_home(segments).unwrap().unwrap();
    assert_eq!((later.segment_count, later.segments.len()), (segments + 2, 2));

    // What does not fit is refused, and the index stays empty.
    let mut broken: Vec<(&str, attnstore_index::EncodedHome)> = Vec::new();
    broken.push(("only the newer segments", later));
    let mut means = home.clone();
    means.segments[1].heads[0].centroids.pop();
    broken.push(("a centroid short", means));
    let mut nan = home.clone();
    nan.steady[1].tail_values[3] = f16::NAN;
    broken.push(("a NaN plain row", nan));
    let mut rows = home.clone();
    rows.segments.swap(0, 1);
    broken.push(("segments out of order", rows));
    let mut tail = home.clone();
    tail.steady[0].tail_keys.truncate(D);
    broken.push(("a short tail", tail));
    for (what, home) in broken {
        let mut w = WaveIndex::<f16>::new(params(), HEADS, D).unwrap().with_codec(hack).unwrap();
        let err = w.restore_encoded(home).unwrap_err();
        assert!(err.to_string().contains("wave"), "{what}: {err}");
        assert_eq!(w.stats().tokens, 0, "{what}");
        assert!(w.layout().segments.is_empty(), "{what}");
    }
    // A plain index has no encoded home.
    assert!(build(None, &k, &v, total, 1200).encoded_home(0).is_none());
}
