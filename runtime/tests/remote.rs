//! Sessions through the remote tier on generated models of each architecture: a second
//! runtime attaches the first one's published prompt, prefills only the rest, and decodes
//! as if it had prefilled everything (exact f32 attention: to float tolerance).

use attnstore::remote::{MemoryStore, ModelId, RemoteConfig, RemoteStore, RemoteTier};
use attnstore::{Codec, Engine, EngineConfig};
use attnstore_runtime::synth::{write_model, SynthConfig};
use attnstore_runtime::{relative_l2, remote, Arch, AttnConfig, AttnMethod, Model, Session, Weights};
use std::sync::Arc;
use std::time::Duration;

mod common;

const CHUNK: usize = 16;

fn tier(store: &Arc<MemoryStore>) -> RemoteTier {
    let config = RemoteConfig { chunk_tokens: CHUNK, ..RemoteConfig::default() };
    RemoteTier::new(Arc::clone(store) as Arc<dyn RemoteStore>, config).unwrap()
}

#[test]
fn a_second_runtime_attaches_the_published_prompt_and_decodes_the_same() {
    let dir = tempfile::tempdir().unwrap();
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Gemma3] {
        let path = dir.path().join(format!("{arch}.gguf"));
        write_model(&path, &SynthConfig::small(arch)).unwrap();
        let model = Model::load(&path, Weights::Quantized).unwrap();
        let id = ModelId::of_file(&path).unwrap();
        let v = model.config().vocab as u64;
        let tokens: Vec<u32> = (0..100u64).map(|i| ((i * 2_654_435_761 + 11) % v) as u32).collect();
        let config = AttnConfig { codec: Codec::F32.into(), ..AttnConfig::new(AttnMethod::Exact) };
        let store = Arc::new(MemoryStore::new());
        let (first, second) =
            (Engine::in_memory(EngineConfig::default()).unwrap(), Engine::in_memory(EngineConfig::default()).unwrap());
        let t = tier(&store);
        let mut a = remote::start(&model, &first, config, &t, &id, &tokens, 32, &mut |_| {}).unwrap();
        assert_eq!((a.reused_tokens, a.prefilled_tokens), (0, 100), "{arch}: nothing published yet");
        assert!(t.flush(Duration::from_secs(30)));
        let mut b = remote::start(&model, &second, config, &tier(&store), &id, &tokens, 32, &mut |_| {}).unwrap();
        // 99 tokens are looked up (the last is always run): 6 whole chunks.
        assert_eq!((b.reused_tokens, b.prefilled_tokens), (96, 4), "{arch}");
        let scratch = model.prefill(&tokens, 32, &mut |_| {}).unwrap();
        assert!(relative_l2(&b.logits, &scratch.logits) < 1e-4, "{arch}: attached prompt's logits");
        assert!(relative_l2(&a.logits, &scratch.logits) < 1e-5, "{arch}");
        let mut next = attnstore_runtime::argmax(&scratch.logits);
        for step in 0..5 {
            let (la, lb) = (a.session.step(next).unwrap(), b.session.step(next).unwrap());
            assert!(relative_l2(&lb, &la) < 1e-4, "{arch} step {step}");
            next = attnstore_runtime::argmax(&la);
        }
        // Another model's identity reuses nothing.
        let other = ModelId::of_bytes(b"other weights");
        let c = remote::start(&model, &second, config, &tier(&store), &other, &tokens, 32, &mut |_| {}).unwrap();
        assert_eq!(c.reused_tokens, 0, "{arch}");
        drop::<Session>(c.session);
    }
}

/// SmolLM2 (the real model, when fetched) with the wave index and f16 KV: a 1,200-token
/// prompt published by one runtime and attached by another gives the same greedy tokens,
/// and the attached context's decode logits stay within f16 rounding of the first's.
#[test]
fn smollm2_prompt_attached_from_another_runtime_generates_the_same_tokens() {
    let Some(model) = common::model_or_skip(Weights::Quantized) else { return };
    let path = attnstore_runtime::default_model_path();
    let id = ModelId::of_file(&path).unwrap();
    let text = attnstore_runtime::eval::SUMMARY_TEXT;
    let mut tokens = model.tokenizer().encode(text).unwrap();
    tokens.truncate(1200);
    let config = AttnConfig::new(AttnMethod::Wave).scaled(0.25);
    let store = Arc::new(MemoryStore::new());
    let cfg = RemoteConfig { chunk_tokens: 256, ..RemoteConfig::default() };
    let t = RemoteTier::new(Arc::clone(&store) as Arc<dyn RemoteStore>, cfg.clone()).unwrap();
    let (first, second) =
        (Engine::in_memory(EngineConfig::default()).unwrap(), Engine::in_memory(EngineConfig::default()).unwrap());
    let mut a = remote::start(&model, &first, config, &t, &id, &tokens, 256, &mut |_| {}).unwrap();
    assert!(t.flush(Duration::from_secs(60)));
    let t2 = RemoteTier::new(Arc::clone(&store) as Arc<dyn RemoteStore>, cfg).unwrap();
    let mut b = remote::start(&model, &second, config, &t2, &id, &tokens, 256, &mut |_| {}).unwrap();
    assert_eq!(b.reused_tokens, 1024);
    assert_eq!(t2.stats().layouts_used, model.config().layers as u64);
    assert_eq!(attnstore_runtime::argmax(&b.logits), attnstore_runtime::argmax(&a.logits));
    // The attached prefix's KV is the published f16 rows, the first runtime's prefill
    // attended its own f32 KV: the distributions differ by that rounding only.
    let kl = attnstore_runtime::kl_divergence(&a.logits, &b.logits);
    eprintln!("attached vs prefilled prompt: KL {kl:.2e}, logits rel. L2 {:.3}", relative_l2(&b.logits, &a.logits));
    assert!(kl < 0.01, "KL {kl}");
    // Teacher-forced on the first runtime's greedy tokens, the second predicts the same
    // next tokens with nearly the same distribution.
    let (mut next, mut agree, mut worst) = (attnstore_runtime::argmax(&a.logits), 0, 0f64);
    let steps = 16;
    for _ in 0..steps {
        let (la, lb) = (a.session.step(next).unwrap(), b.session.step(next).unwrap());
        next = attnstore_runtime::argmax(&la);
        agree += usize::from(attnstore_runtime::argmax(&lb) == next);
        worst = worst.max(attnstore_runtime::kl_divergence(&la, &lb));
    }
    eprintln!("teacher-forced: top-1 agreement {agree}/{steps}, worst KL {worst:.2e}");
    assert!(agree + 1 >= steps && worst < 0.05, "{agree}/{steps}, KL {worst}");
}
