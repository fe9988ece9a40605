//! The runtime's exact method against candle-transformers' llama with both models' weights
//! dequantized to f32 (CANDLE_DEQUANTIZE_ALL, which candle reads once per thread: this file
//! holds one test so no other test shares the setting). With continuous arithmetic the
//! logits must agree to float tolerance, chunked prefill and engine-served decode included.

mod common;

#[cfg(feature = "candle-reference")]
use attnstore::DType;
#[cfg(feature = "candle-reference")]
use attnstore_runtime::Weights;
#[cfg(feature = "candle-reference")]
use common::{compare_with_reference, model_or_skip};

#[test]
#[cfg(not(feature = "candle-reference"))]
fn exact_method_matches_candle_llama_forward_f32() {
    common::reference_skipped();
}

#[test]
#[cfg(feature = "candle-reference")]
fn exact_method_matches_candle_llama_forward_f32() {
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let Some(model) = model_or_skip(Weights::Dequantized) else { return };
    for (dtype, tolerance) in [(DType::F32, 1e-4), (DType::F16, 2e-2)] {
        let a = compare_with_reference(&model, dtype, 7, 8);
        println!(
            "f32 weights, {dtype:?} KV, prefill in 7-token chunks: prefill {:.2e}, decode {:.2e}, argmax {}/{}",
            a.prefill, a.decode, a.argmax.0, a.argmax.1
        );
        assert!(a.prefill < tolerance && a.decode < tolerance, "{dtype:?}: {a:?} exceeds {tolerance}");
        assert_eq!(a.argmax.0, a.argmax.1, "{dtype:?}: every argmax must agree");
    }
}
