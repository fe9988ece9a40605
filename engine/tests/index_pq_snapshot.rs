//! A PQ index restored from its snapshot and the KV of its base region (a checkpoint's PQ
//! meta data) is the index it came from: same codebooks, codes, plans and answers, with no
//! training; decoding goes on from it the same way; a snapshot that does not fit is a typed
//! error that changes nothing.

#[allow(dead_code, reason = "helpers shared by the test files; this one uses some")]
#[path = "index_common/mod.rs"]
mod common;

use attnstore_index::{
    AccessMethod, IndexLayout, PqIndex, PqParams, PqSnapshot, SelectionMode, Snapshots, WaveLayout, ZoneBudget,
};
use attnstore_kernels::{AttnShape, HackParams};
use common::{append_in_batches, randn, run, token_slice};
use half::f16;

const HEADS: usize = 2;
const D: usize = 32;

fn params() -> PqParams {
    PqParams { min_build_tokens: 256, local_tokens: 32, background: false, ..PqParams::default() }
}

/// Tokens `from..to` of `all` (`HEADS × total × D`) as one batch (`HEADS × n × D`).
fn slice(all: &[f32], total: usize, from: usize, to: usize) -> Vec<f32> {
    token_slice(all, (HEADS, D), total, from, to)
}

fn empty(hack: Option<HackParams>) -> PqIndex<f16> {
    PqIndex::<f16>::new(params(), HEADS, D).unwrap().with_codec(hack).unwrap()
}

/// Prefill `prefill` tokens, then append the rest in batches of 37.
fn build(hack: Option<HackParams>, k: &[f32], v: &[f32], total: usize, prefill: usize) -> PqIndex<f16> {
    let mut pq = empty(hack);
    pq.prefill(&slice(k, total, 0, prefill), &slice(v, total, 0, prefill)).unwrap();
    append_in_batches(&mut pq, (k, v), (HEADS, D), total, prefill);
    pq
}

/// Restores from `snapshot` and the KV of its base region, then ingests the rest as the
/// original did.
fn restore(hack: Option<HackParams>, snapshot: &PqSnapshot, k: &[f32], v: &[f32], total: usize) -> PqIndex<f16> {
    let base = snapshot.tokens as usize;
    let mut pq = empty(hack);
    let layout = IndexLayout::Pq(snapshot.clone());
    assert!(Snapshots::restore(&mut pq, &layout, &slice(k, total, 0, base), &slice(v, total, 0, base)).unwrap());
    append_in_batches(&mut pq, (k, v), (HEADS, D), total, base);
    pq
}

#[test]
fn a_restored_pq_index_is_the_index_it_came_from() {
    let shape = AttnShape::new(8, HEADS, D).unwrap();
    let total = 3000;
    let (k, v) = (randn(shape.kv_len(total), 1, 1.0), randn(shape.kv_len(total), 2, 1.0));
    for hack in [None, Some(HackParams::default())] {
        let original = build(hack, &k, &v, total, 2000);
        let snapshot = original.snapshot().expect("built synchronously");
        // What a checkpoint compares before it copies a layout.
        assert_eq!(original.layout_end(), original.layout().map(|l| l.indexed_end()));
        assert_eq!(empty(hack).layout_end(), None, "nothing built, nothing to keep");
        assert_eq!(snapshot.tokens, 2000, "the base region is the prefill");
        let restored = restore(hack, &snapshot, &k, &v, total);
        assert_eq!(restored.snapshot(), Some(snapshot), "{hack:?}");
        assert_eq!(restored.stats(), original.stats(), "{hack:?}");
        for h in 0..HEADS {
            assert_eq!(restored.codebook(h), original.codebook(h));
            for p in [4, 1000, 1999, 2500, total - 40] {
                assert_eq!(restored.codes_of(h, p), original.codes_of(h, p), "head {h} position {p}");
            }
        }
        let report = restored.handle().and_then(|b| b.report()).expect("ready at once");
        assert_eq!(report.tokens, original.handle().unwrap().report().unwrap().tokens);
        for seed in 0..3 {
            let q = randn(shape.query_len(), 10 + seed, 2.0);
            assert_eq!(run(&restored, &shape, &q, None), run(&original, &shape, &q, None), "exact, {hack:?}");
            for mode in [SelectionMode::PerKvHead, SelectionMode::PerQueryHead] {
                let zone = ZoneBudget { retrieve_tokens: 100, estimate_tokens: 0, mode };
                for h in 0..HEADS {
                    let qh = &q[h * 4 * D..(h + 1) * 4 * D];
                    assert_eq!(restored.plan_head(h, qh, &zone), original.plan_head(h, qh, &zone));
                }
                assert_eq!(run(&restored, &shape, &q, Some(&zone)), run(&original, &shape, &q, Some(&zone)));
            }
        }
    }
}

#[test]
fn a_snapshot_that_does_not_fit_is_a_typed_error_and_changes_nothing() {
    let shape = AttnShape::new(8, HEADS, D).unwrap();
    let total = 1500;
    let (k, v) = (randn(shape.kv_len(total), 3, 1.0), randn(shape.kv_len(total), 4, 1.0));
    let good = build(None, &k, &v, total, total).snapshot().unwrap();
    let mut broken: Vec<(&str, PqSnapshot)> = Vec::new();
    let mut s = good.clone();
    s.tokens += 1;
    broken.push(("more tokens than the KV", s));
    let mut s = good.clone();
    s.bits = 8;
    broken.push(("another layout", s));
    let mut s = good.clone();
    s.end -= 1;
    broken.push(("another coded range", s));
    let mut s = good.clone();
    s.codes = 0;
    broken.push(("no centroids", s));
    let mut s = good.clone();
    s.codebooks.pop();
    broken.push(("a missing head", s));
    let mut s = good.clone();
    s.codebooks[1].pop();
    broken.push(("a short codebook", s));
    let mut s = good.clone();
    s.codebooks[0][5] = f32::NAN;
    broken.push(("a NaN centroid", s));
    let mut s = good.clone();
    s.packed[1].pop();
    broken.push(("short codes", s));
    let mut s = good.clone();
    let (m, sub) = (s.subspaces as usize, D / s.subspaces as usize);
    s.codes = 3;
    s.codebooks.iter_mut().for_each(|b| b.truncate(m * 3 * sub));
    broken.push(("codes naming centroids the codebook lacks", s));
    for (what, snapshot) in broken {
        let mut pq = empty(None);
        let err = pq.restore(&snapshot, &k, &v).unwrap_err();
        let text = err.to_string();
        assert!(["pq snapshot", "expected", "packed codes"].iter().any(|w| text.contains(w)), "{what}: {text}");
        assert_eq!(pq.stats().tokens, 0, "{what}");
        assert!(pq.snapshot().is_none(), "{what}");
    }
    // A wave layout is refused by a PQ index, and a non-empty index is not restored over.
    let mut pq = empty(None);
    let err = Snapshots::restore(&mut pq, &IndexLayout::Wave(WaveLayout::default()), &k, &v).unwrap_err();
    assert!(err.to_string().contains("a wave layout cannot restore a pq index"), "{err}");
    let mut pq = build(None, &k, &v, total, total);
    assert!(pq.restore(&good, &k, &v).is_err());
}

#[test]
fn a_hack2_pq_index_restored_from_its_encoded_home_is_the_index_it_came_from() {
    let shape = AttnShape::new(8, HEADS, D).unwrap();
    let (total, prefill) = (5600, 5000);
    let (k, v) = (randn(shape.kv_len(total), 5, 1.0), randn(shape.kv_len(total), 6, 1.0));
    let hack = Some(HackParams::new(16).unwrap());
    let original = build(hack, &k, &v, total, prefill);
    // Base rows past the sink in pieces of 128 blocks of 16 rows: 2048, 2048 and the rest.
    assert_eq!(original.encoded_segments(), Some(3));
    assert_eq!(build(None, &k, &v, total, prefill).encoded_segments(), None, "plain rows: no 2-bit home");
    assert_eq!(build(hack, &k, &v, 200, 200).encoded_segments(), None, "no codebooks yet: no 2-bit home");
    let home = original.encoded_home(0).unwrap().unwrap();
    assert_eq!((home.segments.len(), home.tail_start, home.tokens), (3, prefill as u64, total as u64));
    assert_eq!(home.segments.iter().map(|s| s.len).sum::<u64>(), prefill as u64 - home.sink_len);
    assert!(home.pq.is_none(), "the codebooks are the layer's layout, not part of the home");
    // A later checkpoint writes no segment again: the base never changes.
    let later = original.encoded_home(3).unwrap().unwrap();
    assert!(later.segments.is_empty() && later.steady == home.steady);

    let mut without = empty(hack);
    let err = without.restore_encoded(home.clone()).unwrap_err();
    assert!(err.to_string().contains("carries no codebooks"), "{err}");
    let snapshot = original.snapshot();
    let with = |mut h: attnstore_index::EncodedHome| {
        h.pq = snapshot.clone();
        h
    };
    let mut restored = empty(hack);
    Snapshots::restore_encoded(&mut restored, with(home.clone())).unwrap();
    assert_eq!(restored.snapshot(), original.snapshot());
    assert_eq!(restored.stats(), original.stats());
    for h in 0..HEADS {
        for p in [4, 2100, 4999, 5300, total - 40] {
            assert_eq!(restored.codes_of(h, p), original.codes_of(h, p), "head {h} position {p}");
        }
    }
    let mut original = original;
    for round in 0..2 {
        for seed in 0..3 {
            let q = randn(shape.query_len(), 20 + seed, 2.0);
            assert_eq!(run(&restored, &shape, &q, None), run(&original, &shape, &q, None), "exact, round {round}");
            let zone = ZoneBudget { retrieve_tokens: 100, estimate_tokens: 0, mode: SelectionMode::PerKvHead };
            for h in 0..HEADS {
                let qh = &q[h * 4 * D..(h + 1) * 4 * D];
                assert_eq!(restored.plan_head(h, qh, &zone), original.plan_head(h, qh, &zone));
            }
            assert_eq!(run(&restored, &shape, &q, Some(&zone)), run(&original, &shape, &q, Some(&zone)));
        }
        // Decoding goes on the same way from the restored index.
        let more = 300;
        let (k2, v2) = (randn(shape.kv_len(more), 30 + round, 1.0), randn(shape.kv_len(more), 40 + round, 1.0));
        for pq in [&mut original, &mut restored] {
            append_in_batches(pq, (&k2, &v2), (HEADS, D), more, 0);
        }
        assert_eq!(restored.stats(), original.stats());
    }

    // Homes that do not fit are typed errors that change nothing.
    let mut broken: Vec<(&str, attnstore_index::EncodedHome)> = Vec::new();
    let mut h = with(home.clone());
    h.segments.pop();
    broken.push(("a missing segment", h));
    let mut h = with(home.clone());
    h.segment_count -= 1;
    h.segments.remove(1);
    broken.push(("a gap between segments", h));
    let mut h = with(home.clone());
    h.steady[1].tail_keys.pop();
    broken.push(("a short tail row", h));
    let mut h = with(home.clone());
    h.steady[0].sink_values[3] = f16::NAN;
    broken.push(("a NaN sink value", h));
    let mut h = with(home.clone());
    h.tail_start -= 1;
    broken.push(("a base that is not the codebooks'", h));
    let mut h = with(home.clone());
    h.segments[2].heads[0] = h.segments[1].heads[0].clone();
    broken.push(("a head with another segment's row count", h));
    for (what, h) in broken {
        let mut pq = empty(hack);
        let err = pq.restore_encoded(h).unwrap_err();
        assert!(err.to_string().contains("encoded pq index"), "{what}: {err}");
        assert_eq!(pq.stats().tokens, 0, "{what}");
        assert!(pq.snapshot().is_none(), "{what}");
    }
    assert!(empty(None).restore_encoded(with(home.clone())).is_err(), "an index without the codec");
    assert!(restored.restore_encoded(with(home)).is_err(), "a non-empty index");
}
