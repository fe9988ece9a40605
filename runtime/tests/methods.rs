//! Sparse methods inside the real model: at a full budget (with the exact-plan shortcut
//! disabled, so the sparse executors run) they equal exact attention; at the default budget
//! they stay close. Traces round-trip and corruption is caught. Skips without the model.

mod common;

use attnstore::{Codec, Engine, EngineConfig, EstimateShare};
use attnstore_runtime::eval::{passkey_prompt, summary_prompt};
use attnstore_runtime::trace::{self, Trace};
use attnstore_runtime::{argmax, kl_divergence, AttnConfig, AttnMethod, Error, Session, Weights};
use common::{max_rel, model_or_skip};

#[test]
fn sparse_methods_at_full_budget_equal_exact_and_stay_close_at_the_default() {
    let Some(model) = model_or_skip(Weights::Dequantized) else { return };
    // PQ trains codebooks from 1024 tokens on; 1200 gives every method an index.
    let prompt = summary_prompt(&model, 1200).unwrap();
    assert_eq!(prompt.len(), 1200);
    let prefill = model.prefill(&prompt, 256, &mut |_| {}).unwrap();
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let run = |config: AttnConfig| {
        let mut s = Session::new(&model, &engine, config, &prefill, false).unwrap();
        let mut next = argmax(&prefill.logits);
        let mut logits = Vec::new();
        for _ in 0..4 {
            let l = s.step(next).unwrap();
            next = argmax(&l);
            logits.push(l);
        }
        let stats = s.stats().clone();
        s.close().unwrap();
        (logits, stats)
    };
    let exact = run(AttnConfig { codec: Codec::F32.into(), ..AttnConfig::new(AttnMethod::Exact) }).0;
    for method in [AttnMethod::Wave, AttnMethod::Pq, AttnMethod::TopK] {
        let mut full = AttnConfig { codec: Codec::F32.into(), ..AttnConfig::new(method) };
        full.budget.retrieve_frac = 1.0;
        full.budget.estimate = EstimateShare::Fraction(0.0);
        full.budget.exact_threshold = f64::MAX;
        full.budget.short_context_tokens = 0;
        let (logits, stats) = run(full);
        assert_eq!(stats.exact_plans, 0, "{method:?}: the sparse executor must run");
        let worst = logits.iter().zip(&exact).map(|(a, b)| max_rel(a, b)).fold(0f32, f32::max);
        println!("{method:?} at a full sparse budget vs exact: {worst:.2e}");
        assert!(worst < 1e-4, "{method:?}: {worst}");

        // The default budget plans 1200 tokens exact: a short context (and its 1024-token
        // floor would read most of them anyway).
        let (_, stats) = run(AttnConfig { codec: Codec::F32.into(), ..AttnConfig::new(method) });
        // (The oracle top-k is a measuring device: it is never replaced by exact attention.)
        if method != AttnMethod::TopK {
            assert_eq!(stats.exact_plans, stats.plans, "{method:?}: short contexts are planned exact at the default");
        }
        // A smaller floor makes it sparse, and it stays close.
        let mut small = AttnConfig { codec: Codec::F32.into(), ..AttnConfig::new(method) };
        small.budget.retrieve_floor_tokens = 128;
        small.budget.short_context_tokens = 0;
        let (logits, stats) = run(small);
        let kl = logits.iter().zip(&exact).map(|(a, b)| kl_divergence(b, a)).sum::<f64>() / 4.0;
        println!(
            "{method:?} with a 128-token floor: KL {kl:.4}, {:.0} exact tokens per head ({:.0}%)",
            stats.mean_exact_tokens(),
            100.0 * stats.exact_share()
        );
        assert_eq!(stats.exact_plans, 0, "{method:?}: a 128-token floor plans sparse");
        assert!(stats.exact_share() < 0.4, "{method:?} attends {} of the context", stats.exact_share());
        assert!(kl < 0.1, "{method:?}: KL {kl}");
    }
}

#[test]
fn trace_round_trips_and_corruption_is_a_typed_error() {
    let Some(model) = model_or_skip(Weights::Dequantized) else { return };
    let dir = tempfile::tempdir().unwrap();
    let prompt = summary_prompt(&model, 300).unwrap();
    let meta = trace::capture(&model, &prompt, 128, 3, dir.path(), &mut |_| {}).unwrap();
    assert_eq!((meta.prompt_tokens, meta.decode_steps, meta.tokens.len()), (300, 3, 303));
    let t = Trace::load(dir.path()).unwrap();
    // The prompt KV is the prefill's, stored as f16.
    let prefill = model.prefill(&prompt, 64, &mut |_| {}).unwrap();
    for layer in [0, 29] {
        let (k, v) = t.layer_kv(layer, 0..300);
        for (got, want) in [(&k, &prefill.kv[layer].0), (&v, &prefill.kv[layer].1)] {
            let worst = got.iter().zip(want.iter()).map(|(a, b)| (a - b).abs() / b.abs().max(1.0)).fold(0f32, f32::max);
            assert!(worst < 2e-3, "layer {layer}: {worst}");
        }
    }
    // Exact attention over a trace has no error and full recall.
    let rows = trace::bench_trace(&t, &trace::default_configs()[..2], &mut |_| {}).unwrap();
    assert_eq!(rows[0].rel_error, 0.0);
    assert_eq!(rows[0].recall, 1.0);
    assert!(rows[1].rel_error > 0.0 && rows[1].rel_error < 1.0, "{:?}", rows[1].rel_error);

    // A flipped byte and a truncated file are reported with the file's name.
    let kv = dir.path().join("kv-007.bin");
    let mut bytes = std::fs::read(&kv).unwrap();
    bytes[1000] ^= 0x40;
    std::fs::write(&kv, &bytes).unwrap();
    match Trace::load(dir.path()) {
        Err(Error::BadTrace { path, detail }) => {
            assert!(path.ends_with("kv-007.bin") && detail.contains("checksum"), "{path:?}: {detail}")
        }
        other => panic!("corruption not reported: {:?}", other.map(|_| ())),
    }
    bytes[1000] ^= 0x40;
    std::fs::write(&kv, &bytes[..bytes.len() - 2]).unwrap();
    assert!(matches!(Trace::load(dir.path()), Err(Error::BadTrace { .. })));
    std::fs::write(dir.path().join("trace.json"), b"{\"format\": 1}").unwrap();
    assert!(matches!(Trace::load(dir.path()), Err(Error::BadTrace { .. })));
    assert!(matches!(trace::capture(&model, &prompt, 128, 0, dir.path(), &mut |_| {}), Err(Error::InvalidInput(_))));
}

#[test]
fn eval_prompts_have_the_asked_length_and_hide_the_key() {
    let Some(model) = model_or_skip(Weights::Quantized) else { return };
    for len in [1024, 2048, 8192] {
        assert_eq!(summary_prompt(&model, len).unwrap().len(), len);
        let p = passkey_prompt(&model, len, 0.5, 48213).unwrap();
        assert_eq!(p.len(), len);
        let text = model.tokenizer().decode(&p).unwrap();
        assert_eq!(text.matches("48213").count(), 2, "the needle states the key twice");
        let at = text.find("48213").unwrap() as f64 / text.len() as f64;
        assert!((0.4..0.6).contains(&at), "depth 0.5 put the key at {at}");
    }
    assert!(matches!(summary_prompt(&model, 10), Err(Error::InvalidInput(_))));
    assert!(matches!(summary_prompt(&model, 10_000_000), Err(Error::InvalidInput(_))));
}
