//! The runtime's exact method against candle-transformers' own llama forward (no attnstore),
//! with the GGUF's quantized weights; and attnstore's exact attention inside the model against
//! a naive f64 attention. Skips with a printed reason when the model is not fetched.

mod common;

use attnstore::{Codec, Engine, EngineConfig};
use attnstore_runtime::{argmax, AttentionBackend, AttnConfig, AttnMethod, Model, Session, Weights};
#[cfg(feature = "candle-reference")]
use common::compare_with_reference;
use common::{model_or_skip, NaiveAttention, PROMPTS};

/// With quantized weights candle quantizes each matmul's activations to 8 bits, so a 1e-7
/// difference in an attention output (summation order) can move a value across a rounding
/// step: logits then differ by a few percent while every argmax agrees. The whole-prompt
/// prefill runs the same operations in the same order as the reference and must be exact.
#[test]
#[cfg(not(feature = "candle-reference"))]
fn exact_method_matches_candle_llama_forward_quantized() {
    common::reference_skipped();
}

#[test]
#[cfg(feature = "candle-reference")]
fn exact_method_matches_candle_llama_forward_quantized() {
    let Some(model) = model_or_skip(Weights::Quantized) else { return };
    let a = compare_with_reference(&model, attnstore::DType::F32, 4096, 8);
    println!(
        "quantized weights, f32 KV: prefill {:.1e}, decode {:.2e}, argmax {}/{}",
        a.prefill, a.decode, a.argmax.0, a.argmax.1
    );
    assert_eq!(a.prefill, 0.0, "the same operations in the same order give the same logits");
    assert!(a.decode < 0.1, "decode logits differ by {} (relative)", a.decode);
    assert!(a.argmax.0 * 100 >= a.argmax.1 * 95, "argmax agreement {}/{}", a.argmax.0, a.argmax.1);
}

/// Records the largest relative error of the session's exact attention against a naive
/// f64 attention over the same tokens, layer by layer.
struct Audit<'a, 'b> {
    session: &'b mut Session<'a>,
    naive: NaiveAttention,
    worst: f64,
}

impl AttentionBackend for Audit<'_, '_> {
    fn attend(&mut self, layer: usize, q: &[f32], k: &[f32], v: &[f32]) -> attnstore_runtime::Result<Vec<f32>> {
        let got = self.session.attend(layer, q, k, v)?;
        let want = self.naive.attend(layer, q, k, v)?;
        self.worst = self.worst.max(attnstore_runtime::relative_l2(&got, &want));
        Ok(want)
    }
}

#[test]
fn engine_exact_attention_matches_naive_attention_in_the_model() {
    let Some(model) = model_or_skip(Weights::Quantized) else { return };
    let ids = model.tokenizer().encode(&model.tokenizer().chat_prompt(PROMPTS[2])).unwrap();
    let prefill = model.prefill(&ids, 16, &mut |_| {}).unwrap();
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let config = AttnConfig { codec: Codec::F32.into(), ..AttnConfig::new(AttnMethod::Exact) };
    let mut session = Session::new(&model, &engine, config, &prefill, false).unwrap();
    let naive = NaiveAttention { shape: model.config().attn_shape(), kv: prefill.kv.clone() };
    let mut audit = Audit { session: &mut session, naive, worst: 0.0 };
    let mut next = argmax(&prefill.logits);
    for step in 0..6 {
        next = argmax(&model.decode_step(next, ids.len() + step, &mut audit).unwrap());
    }
    println!("engine exact vs naive f64 attention, worst layer output error {:.2e}", audit.worst);
    assert!(audit.worst < 1e-5, "engine exact vs naive f64 attention: {}", audit.worst);
}

#[test]
fn tokenizer_round_trips_and_knows_the_chat_tokens() {
    let Some(model) = model_or_skip(Weights::Quantized) else { return };
    let tok = model.tokenizer();
    let text = "The pass key is 73021. Remember it: 73021!";
    let ids = tok.encode(text).unwrap();
    assert_eq!(tok.decode(&ids).unwrap(), text);
    // Digits are split one by one (SmolLM2's pre-tokenizer).
    let digits = tok.encode("73021").unwrap();
    assert_eq!(digits.len(), 5, "{digits:?}");
    let chat = tok.encode(&tok.chat_prompt("hi")).unwrap();
    assert_eq!(chat[0], 1, "<|im_start|> is one special token");
    assert!(chat.contains(&tok.eos()), "<|im_end|> is the end-of-turn token");
}

#[test]
fn bad_inputs_are_typed_errors() {
    let Some(model) = model_or_skip(Weights::Quantized) else { return };
    assert!(matches!(model.prefill(&[], 64, &mut |_| {}), Err(attnstore_runtime::Error::InvalidInput(_))));
    assert!(matches!(model.prefill(&[1, 2], 0, &mut |_| {}), Err(attnstore_runtime::Error::InvalidInput(_))));
    assert!(matches!(model.prefill(&[u32::MAX], 64, &mut |_| {}), Err(attnstore_runtime::Error::InvalidInput(_))));
    let too_long = vec![5u32; model.config().context_length + 1];
    assert!(matches!(model.prefill(&too_long, 64, &mut |_| {}), Err(attnstore_runtime::Error::InvalidInput(_))));
    assert!(matches!(
        Model::load(std::path::Path::new("/nonexistent/model.gguf"), Weights::Quantized),
        Err(attnstore_runtime::Error::ModelMissing { .. })
    ));
    assert!(AttnMethod::parse("dense").is_err());
}
