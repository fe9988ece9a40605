//! Prints a digest of the engine's outputs (the bits of every output value) over seeded
//! synthetic contexts, for every access method, codec, storage type, buffer setting and plan
//! kind: two builds that print the same digests compute the same outputs bit for bit. Used
//! to check that a restructuring changes no behaviour (`docs/bench.md`).
//!
//! `cargo run --release -p attnstore --example output_digest [tokens]`

use attnstore::{
    Budget, BufferSettings, Codec, ContextSpec, DType, Engine, EngineConfig, HackParams, LayerKind, Method, PqParams,
    Request, SelectionMode,
};
use attnstore_kernels::random::SplitMix64;
use attnstore_kernels::AttnShape;
use std::time::Duration;

/// FNV-1a over the bits of `values`.
fn digest(values: &[f32], mut h: u64) -> u64 {
    for v in values {
        for b in v.to_bits().to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

/// Keys around a few dozen directions per head (so clusters mean something), values normal.
fn kv(shape: &AttnShape, tokens: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut g = SplitMix64::new(seed);
    let d = shape.head_dim;
    let centres: Vec<f32> = (0..shape.kv_heads * 48 * d).map(|_| g.normal() * 2.0).collect();
    let mut k = Vec::with_capacity(shape.kv_len(tokens));
    for h in 0..shape.kv_heads {
        for _ in 0..tokens {
            let c = (g.next_u64() % 48) as usize;
            k.extend((0..d).map(|i| centres[(h * 48 + c) * d + i] + g.normal() * 0.5));
        }
    }
    let v = (0..shape.kv_len(tokens)).map(|_| g.normal()).collect();
    (k, v)
}

fn main() {
    let tokens: usize = std::env::args().nth(1).map_or(6000, |s| s.parse().expect("tokens: a number"));
    let shape = AttnShape::new(8, 2, 64).expect("shape");
    let (k, v) = kv(&shape, tokens, 7);
    let (dk, dv) = kv(&shape, 300, 8);
    let wave = Method::Wave(attnstore::WaveParams::default());
    let pq = Method::Pq(PqParams::default());
    let hack = Codec::Hack2(HackParams::default());
    let cases: Vec<(&str, ContextSpec, bool)> = vec![
        ("wave f16", ContextSpec::new(shape, 1), false),
        ("wave f16 buffered", ContextSpec::new(shape, 1), true),
        ("wave f32", ContextSpec::new(shape, 1).with_dtype(DType::F32).with_codec(Codec::F32), false),
        ("wave bf16", ContextSpec::new(shape, 1).with_dtype(DType::Bf16).with_codec(Codec::Bf16), false),
        ("wave hack2", ContextSpec::new(shape, 1).with_codec(hack), false),
        ("wave hack2 buffered", ContextSpec::new(shape, 1).with_codec(hack), true),
        ("flat f16", ContextSpec::new(shape, 1).with_method(Method::Flat), false),
        (
            "flat f32",
            ContextSpec::new(shape, 1).with_method(Method::Flat).with_dtype(DType::F32).with_codec(Codec::F32),
            false,
        ),
        ("pq f16", ContextSpec::new(shape, 1).with_method(pq), false),
        ("pq f16 buffered", ContextSpec::new(shape, 1).with_method(pq), true),
        ("pq hack2", ContextSpec::new(shape, 1).with_method(pq).with_codec(hack), false),
        (
            "window f16",
            ContextSpec::new(shape, 1).with_method(wave).with_layers(vec![LayerKind::SlidingWindow(512)]),
            false,
        ),
    ];
    let budgets = [
        ("exact", Budget::full()),
        ("sparse", Budget::default().with_short_context(0).with_exact_threshold(100.0)),
        (
            "per-query-head",
            Budget::default().with_short_context(0).with_exact_threshold(100.0).with_mode(SelectionMode::PerQueryHead),
        ),
    ];
    let mut all = 0xcbf2_9ce4_8422_2325u64;
    for (name, spec, buffered) in cases {
        let config = EngineConfig {
            buffers: buffered.then(|| BufferSettings { maintainer_idle: None, ..BufferSettings::new(16384) }),
            ..EngineConfig::default()
        };
        let engine = Engine::in_memory(config).expect("engine");
        let ctx = engine.create_context(spec).expect("context");
        engine.prefill(ctx, 0, &k, &v).expect("prefill");
        engine.wait_index(ctx, 0, Duration::from_secs(120)).expect("index");
        for phase in ["prefilled", "appended"] {
            if phase == "appended" {
                for t in 0..300 {
                    let one = |x: &[f32]| -> Vec<f32> {
                        (0..shape.kv_heads)
                            .flat_map(|h| x[(h * 300 + t) * 64..(h * 300 + t + 1) * 64].to_vec())
                            .collect()
                    };
                    engine.append(ctx, 0, &one(&dk), &one(&dv)).expect("append");
                }
            }
            for (bname, budget) in &budgets {
                let mut h = 0xcbf2_9ce4_8422_2325u64;
                for step in 0..3u64 {
                    let q: Vec<f32> = {
                        let mut g = SplitMix64::new(100 + step);
                        (0..shape.query_len()).map(|_| g.normal()).collect()
                    };
                    let plan = engine.plan(&[Request::new(ctx, 0, q)], budget).expect("plan");
                    let out = engine.execute(&plan).expect("execute");
                    h = digest(&out[0], h);
                }
                all = digest(&[f32::from_bits(h as u32), f32::from_bits((h >> 32) as u32)], all);
                println!("{name:22} {phase:9} {bname:15} {h:016x}");
            }
        }
    }
    println!("all {all:016x}");
}
