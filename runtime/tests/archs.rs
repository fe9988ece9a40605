//! The three architectures on generated models (random weights, each architecture's real GGUF
//! layout): decode through attnstore equals the model's own prefill, sliding-window layers
//! keep and attend only their window, a Gemma-3 layer pattern survives checkpoint and
//! recovery, and unknown architectures, missing keys and missing tensors are typed errors.

use attnstore::{Budget, Codec, ContextSpec, Engine, EngineConfig, LayerKind, Method, Request};
use attnstore_runtime::synth::{metadata, tensors, write_gguf, write_model, SynthConfig};
use attnstore_runtime::{relative_l2, Arch, AttnConfig, AttnMethod, Error, Model, Numerics, Session, Weights};
use candle_core::quantized::gguf_file::Value;
use std::path::Path;

const ARCHS: [Arch; 3] = [Arch::Llama, Arch::Qwen2, Arch::Gemma3];

fn synth(dir: &Path, arch: Arch) -> Model {
    let path = dir.join(format!("{arch}.gguf"));
    write_model(&path, &SynthConfig::small(arch)).unwrap();
    Model::load(&path, Weights::Quantized).unwrap()
}

/// `n` token ids spread over the vocabulary (deterministic).
fn ids(model: &Model, n: usize) -> Vec<u32> {
    let v = model.config().vocab as u64;
    (0..n as u64).map(|i| ((i * 2_654_435_761 + 11) % v) as u32).collect()
}

fn exact_f32() -> AttnConfig {
    AttnConfig { codec: Codec::F32.into(), ..AttnConfig::new(AttnMethod::Exact) }
}

#[test]
fn every_architecture_decodes_through_attnstore_exactly_as_its_own_prefill() {
    let dir = tempfile::tempdir().unwrap();
    for arch in ARCHS {
        let model = synth(dir.path(), arch);
        assert_eq!(model.config().arch, arch);
        let tokens = ids(&model, 48);
        // Chunking the prompt changes nothing (the window mask spans chunks).
        let whole = model.prefill(&tokens, 64, &mut |_| {}).unwrap();
        let chunked = model.prefill(&tokens, 5, &mut |_| {}).unwrap();
        assert!(relative_l2(&chunked.logits, &whole.logits) < 1e-5, "{arch}: chunked prefill logits differ");
        for (l, (a, b)) in chunked.kv.iter().zip(&whole.kv).enumerate() {
            assert_eq!(a.0.len(), b.0.len(), "{arch} layer {l}: kept tokens differ");
            assert!(relative_l2(&a.0, &b.0) < 1e-5 && relative_l2(&a.1, &b.1) < 1e-5, "{arch} layer {l}");
        }
        // Teacher-forced decode through attnstore's exact attention: each step's logits are
        // the prefill's of the same prefix, past the window on Gemma-3's local layers.
        let start = 20;
        let engine = Engine::in_memory(EngineConfig::default()).unwrap();
        let prefill = model.prefill(&tokens[..start], 8, &mut |_| {}).unwrap();
        let mut session = Session::new(&model, &engine, exact_f32(), &prefill, false).unwrap();
        let mut worst = 0f64;
        for i in start..tokens.len() {
            let got = session.step(tokens[i]).unwrap();
            let want = model.prefill(&tokens[..=i], 64, &mut |_| {}).unwrap().logits;
            worst = worst.max(relative_l2(&got, &want));
        }
        assert!(worst < 1e-4, "{arch}: decode logits differ from prefill by {worst:e}");
        session.close().unwrap();
    }
}

#[test]
fn ggml_numerics_round_the_kv_to_f16_and_stay_close_to_f32() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path(), Arch::Gemma3);
    let tokens = ids(&model, 40);
    let f32_run = model.prefill(&tokens, 16, &mut |_| {}).unwrap();
    let model = model.with_numerics(Numerics::Ggml).unwrap();
    assert_eq!(model.numerics(), Numerics::Ggml);
    let ggml = model.prefill(&tokens, 16, &mut |_| {}).unwrap();
    // Every kept key and value is an f16 value (llama.cpp's cache type) ...
    for (l, (k, v)) in ggml.kv.iter().enumerate() {
        assert!(k.iter().chain(v).all(|&x| half::f16::from_f32(x).to_f32() == x), "layer {l}: not f16 values");
    }
    // ... and the roundings move the logits, a little.
    let d = relative_l2(&ggml.logits, &f32_run.logits);
    assert!(d > 0.0 && d < 2e-2, "ggml vs f32 logits: relative difference {d:e}");
    // Decoding through attnstore after the Ggml prefill still matches its own prefill.
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let start = model.prefill(&tokens[..30], 16, &mut |_| {}).unwrap();
    let mut session = Session::new(&model, &engine, exact_f32(), &start, false).unwrap();
    let got = session.step(tokens[30]).unwrap();
    let want = model.prefill(&tokens[..=30], 16, &mut |_| {}).unwrap().logits;
    assert!(relative_l2(&got, &want) < 2e-2, "decode vs prefill under Ggml numerics");
    session.close().unwrap();
}

#[test]
fn prefill_argmax_gives_each_prefixs_own_prefill_argmax_in_one_pass() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path(), Arch::Gemma3);
    let tokens = ids(&model, 40);
    // Chunks of 16 rows: prefixes end inside chunks and at their edges.
    let (all, best) = model.prefill_argmax(&tokens, 16, &mut |_| {}).unwrap();
    assert_eq!(best.len(), tokens.len());
    let whole = model.prefill(&tokens, 16, &mut |_| {}).unwrap();
    assert_eq!(all.logits, whole.logits, "the prefill itself is unchanged");
    for end in [1, 15, 16, 17, 39, 40] {
        let p = model.prefill(&tokens[..end], 16, &mut |_| {}).unwrap();
        assert_eq!(best[end - 1], attnstore_runtime::argmax(&p.logits), "after {end} tokens");
    }
}

#[test]
fn gemma3_window_layers_keep_only_their_window_and_global_layers_everything() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path(), Arch::Gemma3);
    let c = *model.config();
    let w = c.sliding_window.unwrap();
    let window = LayerKind::SlidingWindow(w);
    assert_eq!(c.layer_kinds(), vec![window, window, window, window, window, LayerKind::Global]);
    assert_eq!(c.global_layers(), vec![5]);
    let tokens = ids(&model, 40);
    let prefill = model.prefill(&tokens[..30], 7, &mut |_| {}).unwrap();
    let per_token = c.kv_heads * c.head_dim;
    for (l, (k, v)) in prefill.kv.iter().enumerate() {
        let want = if l == 5 { 30 } else { w };
        assert_eq!((k.len() / per_token, v.len() / per_token), (want, want), "layer {l}");
    }
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let mut session = Session::new(&model, &engine, exact_f32(), &prefill, false).unwrap();
    for (i, &t) in tokens[30..].iter().enumerate() {
        session.step(t).unwrap();
        for l in 0..c.layers {
            let kept = engine.stats(session.context(), l).unwrap().tokens;
            let want = if l == 5 { 31 + i } else { w };
            assert_eq!(kept, want, "layer {l} after {} steps", i + 1);
        }
    }
    // Only the global layer's plans count towards the exact share.
    assert_eq!(session.stats().plans, 10);
}

/// A window layer attends exactly like full attention over only its last `W` tokens.
#[test]
fn window_layer_attention_equals_full_attention_restricted_to_the_window() {
    let shape = attnstore::AttnShape { q_heads: 4, kv_heads: 2, head_dim: 16 };
    let (n, w) = (50, 12);
    let mut x = 1u64;
    let mut rand = |len: usize| -> Vec<f32> {
        (0..len)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    };
    let (k, v) = (rand(2 * n * 16), rand(2 * n * 16));
    let q = rand(4 * 16);
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let spec =
        |kind| ContextSpec::new(shape, 1).with_layers(vec![kind]).with_codec(Codec::F32).with_method(Method::Flat);
    let windowed = engine.create_context(spec(LayerKind::SlidingWindow(w))).unwrap();
    engine.prefill(windowed, 0, &k, &v).unwrap();
    // The last w tokens of each head, alone in a global layer.
    let tail = |x: &[f32]| -> Vec<f32> { x.chunks(n * 16).flat_map(|h| h[(n - w) * 16..].to_vec()).collect() };
    let full = engine.create_context(spec(LayerKind::Global)).unwrap();
    engine.prefill(full, 0, &tail(&k), &tail(&v)).unwrap();
    let attend = |ctx| {
        let plan = engine.plan(&[Request::new(ctx, 0, q.clone())], &Budget::full()).unwrap();
        engine.execute(&plan).unwrap().pop().unwrap()
    };
    assert!(relative_l2(&attend(windowed), &attend(full)) < 1e-6);
    assert_eq!(engine.stats(windowed, 0).unwrap().tokens, w);
}

#[test]
fn gemma3_layer_pattern_survives_checkpoint_and_recovery() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path(), Arch::Gemma3);
    let c = *model.config();
    let tokens = ids(&model, 36);
    let prefill = model.prefill(&tokens, 9, &mut |_| {}).unwrap();
    let spec = ContextSpec::new(c.attn_shape(), c.layers).with_layers(c.layer_kinds()).with_codec(Codec::F32);
    let q: Vec<f32> = (0..c.q_heads * c.head_dim).map(|i| (i as f32 * 0.37).sin()).collect();
    let attend_all = |engine: &Engine, ctx| -> Vec<Vec<f32>> {
        (0..c.layers)
            .map(|l| {
                let plan = engine.plan(&[Request::new(ctx, l, q.clone())], &Budget::full()).unwrap();
                engine.execute(&plan).unwrap().pop().unwrap()
            })
            .collect()
    };
    let store = dir.path().join("engine");
    let (ctx, before) = {
        let engine = Engine::open(&store, EngineConfig::default()).unwrap();
        let ctx = engine.create_context(spec.clone()).unwrap();
        for (l, (k, v)) in prefill.kv.iter().enumerate() {
            engine.prefill(ctx, l, k, v).unwrap();
        }
        engine.checkpoint().unwrap();
        (ctx, attend_all(&engine, ctx))
    };
    let engine = Engine::open(&store, EngineConfig::default()).unwrap();
    assert_eq!(engine.spec(ctx).unwrap().layers, c.layer_kinds());
    let after = attend_all(&engine, ctx);
    for (l, (a, b)) in after.iter().zip(&before).enumerate() {
        assert!(relative_l2(a, b) < 1e-6, "layer {l} differs after recovery");
        let want = if c.layer_kind(l) == LayerKind::Global { tokens.len() } else { c.sliding_window.unwrap() };
        assert_eq!(engine.stats(ctx, l).unwrap().tokens, want, "layer {l}");
    }
}

/// Loads a GGUF written from `meta` and `tens` and returns the error.
fn load_error(dir: &Path, meta: &[(String, Value)], tens: &[(String, candle_core::quantized::QTensor)]) -> Error {
    let path = dir.join("bad.gguf");
    write_gguf(&path, meta, tens).unwrap();
    match Model::load(&path, Weights::Quantized) {
        Ok(_) => panic!("a bad model loaded"),
        Err(e) => e,
    }
}

#[test]
fn unknown_architectures_missing_keys_and_tensors_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let c = SynthConfig::small(Arch::Gemma3);
    let (meta, tens) = (metadata(&c), tensors(&c).unwrap());
    let with = |key: &str, value: Option<Value>| -> Vec<(String, Value)> {
        let mut m: Vec<_> = meta.iter().filter(|(k, _)| k != key).cloned().collect();
        if let Some(v) = value {
            m.push((key.to_string(), v));
        }
        m
    };
    let expect = |e: Error, what: &str, says: &str| match &e {
        Error::BadModel { what: w, detail } => {
            assert_eq!(w, what, "{e}");
            assert!(detail.contains(says), "{e}");
        }
        other => panic!("expected BadModel about {what}, got {other}"),
    };
    let e = load_error(dir.path(), &with("general.architecture", Some(Value::String("mamba".into()))), &tens);
    expect(e, "general.architecture", "mamba is not supported");
    for key in ["gemma3.attention.sliding_window", "gemma3.attention.key_length", "gemma3.rope.freq_base"] {
        expect(load_error(dir.path(), &with(key, None), &tens), key, "missing");
    }
    let e = load_error(dir.path(), &with("gemma3.attention.sliding_window", Some(Value::U32(0))), &tens);
    expect(e, "gemma3.attention.sliding_window", "at least one token");
    let e = load_error(dir.path(), &with("tokenizer.ggml.model", Some(Value::String("bert".into()))), &tens);
    expect(e, "tokenizer.ggml.model", "bert");
    let without: Vec<_> = tensors(&c).unwrap().into_iter().filter(|(n, _)| n != "blk.3.attn_k_norm.weight").collect();
    expect(load_error(dir.path(), &meta, &without), "blk.3.attn_k_norm.weight", "gemma3");
    // Qwen2 needs its biases.
    let q = SynthConfig::small(Arch::Qwen2);
    let without: Vec<_> = tensors(&q).unwrap().into_iter().filter(|(n, _)| n != "blk.1.attn_v.bias").collect();
    expect(load_error(dir.path(), &metadata(&q), &without), "blk.1.attn_v.bias", "qwen2");
}

#[test]
fn sentencepiece_tokenizer_merges_by_score_falls_back_to_bytes_and_cuts_out_specials() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path(), Arch::Gemma3);
    let tok = model.tokenizer();
    assert_eq!(tok.bos(), Some(2));
    let id = |piece: &str| tok.encode(piece).unwrap();
    // "▁the" outscores "th"+"e" and "▁t"+"he".
    let the = id(" the");
    assert_eq!(the.len(), 1, "{the:?}");
    assert_eq!(tok.decode(&the).unwrap(), " the");
    // Control and user-defined tokens are cut out before merging; é is two byte tokens.
    let ids = tok.encode("<start_of_turn>user\n\ncafé").unwrap();
    assert_eq!(ids[0], 4);
    assert!(ids.contains(&6), "the user-defined \\n\\n token: {ids:?}");
    assert_eq!(tok.decode(&ids).unwrap(), "<start_of_turn>user\n\ncafé");
    let prompt = tok.encode_prompt("hi").unwrap();
    assert_eq!(prompt[0], 2, "Gemma prompts start with <bos>");
    // Byte-level BPE with Qwen2's split round-trips too.
    let qwen = synth(dir.path(), Arch::Qwen2);
    let text = "the answer is 42, they said.\n\n";
    assert_eq!(qwen.tokenizer().decode(&qwen.tokenizer().encode(text).unwrap()).unwrap(), text);
    assert_eq!(qwen.tokenizer().bos(), None);
}

/// Qwen2 against candle-transformers' own quantized Qwen2 forward on the same generated file
/// (no attnstore): the whole prompt's last logits, then teacher-forced decode steps through
/// attnstore's exact attention. (candle-transformers' Gemma-3 is no reference: its MLP uses
/// SiLU where Gemma-3 uses GELU, and its window admits one token more; Gemma-3 is checked
/// against llama.cpp by `scripts/llamacpp-check` instead.)
#[test]
#[cfg(feature = "candle-reference")]
fn qwen2_matches_candle_transformers_qwen2_forward() {
    use candle_core::{Device, Tensor};
    use candle_transformers::models::quantized_qwen2::ModelWeights;
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path(), Arch::Qwen2);
    let path = dir.path().join("qwen2.gguf");
    let mut file = std::fs::File::open(&path).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
    let mut reference = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
    let mut forward = |ids: &[u32], pos: usize| -> Vec<f32> {
        let input = Tensor::new(ids, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        reference.forward(&input, pos).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    let tokens = ids(&model, 40);
    let want = forward(&tokens[..24], 0);
    let prefill = model.prefill(&tokens[..24], 5, &mut |_| {}).unwrap();
    assert!(relative_l2(&prefill.logits, &want) < 1e-4, "prefill {:e}", relative_l2(&prefill.logits, &want));
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let mut session = Session::new(&model, &engine, exact_f32(), &prefill, false).unwrap();
    for (i, &t) in tokens[24..].iter().enumerate() {
        let (got, want) = (session.step(t).unwrap(), forward(&[t], 24 + i));
        assert!(relative_l2(&got, &want) < 1e-4, "step {i}: {:e}", relative_l2(&got, &want));
    }
}

/// `kv43:auto`: a prefill keeps queries of each layer's last positions as probes, the session's context
/// gets the kv43 table the policy chooses from them (a quarter of f16's bytes or less, every
/// layer a kv43 variant), and decode runs over it close to exact; a prefill without probes
/// (a prefix from the remote tier) cannot be resolved and says why.
#[test]
fn a_kv43_table_chosen_at_prefill_is_the_sessions_and_decodes_close_to_exact() {
    use attnstore_runtime::codec_policy::{choose_kv43, PROBE_QUERIES};
    use attnstore_runtime::CodecPolicy;
    let dir = tempfile::tempdir().unwrap();
    // kv43 needs heads of a multiple of 64 dimensions.
    let path = dir.path().join("llama64.gguf");
    let config = SynthConfig { d_model: 256, head_dim: 64, layers: 3, ffn: 256, ..SynthConfig::small(Arch::Llama) };
    write_model(&path, &config).unwrap();
    let model = Model::load(&path, Weights::Quantized).unwrap();
    let c = *model.config();
    // Longer than the probes' window (512), in chunks that do not divide it.
    let tokens = ids(&model, 600);
    let prefill = model.prefill(&tokens, 96, &mut |_| {}).unwrap();
    assert_eq!(prefill.probes.len(), c.layers);
    assert!(prefill.probes.iter().all(|p| p.len() == PROBE_QUERIES * c.q_heads * c.head_dim));
    let choice = choose_kv43(&c, &prefill).unwrap();
    assert!(choice.bytes_share <= 0.25 + 1e-9, "{choice:?}");
    assert_eq!(choice.errors.len(), c.layers);
    assert!(choice.errors.iter().flatten().all(|e| e.is_finite() && *e > 0.0), "{choice:?}");
    let auto = AttnConfig { codec_policy: CodecPolicy::Kv43Auto, ..AttnConfig::new(AttnMethod::Exact) };
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let mut session = Session::new(&model, &engine, auto, &prefill, false).unwrap();
    let spec = engine.spec(session.context()).unwrap();
    assert_eq!(spec.layer_codecs(), choice.codecs);
    assert!((0..c.layers).all(|l| spec.codec_of(l).kv43().is_some()), "{}", spec.layer_codecs());
    let mut exact = Session::new(&model, &engine, exact_f32(), &prefill, false).unwrap();
    let (got, want) = (session.step(tokens[0]).unwrap(), exact.step(tokens[0]).unwrap());
    let err = relative_l2(&got, &want);
    assert!(err < 0.05, "decode over the chosen table vs exact: {err}");
    session.close().unwrap();
    exact.close().unwrap();
    let mut attached = prefill.clone();
    attached.probes.clear();
    match Session::new(&model, &engine, auto, &attached, false) {
        Err(Error::InvalidInput(why)) => assert!(why.contains("probe queries"), "{why}"),
        other => panic!("a prefill without probes: expected InvalidInput, got {:?}", other.err()),
    }
}
