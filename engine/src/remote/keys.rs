//! The key scheme of the remote tier. A token sequence is cut into chunks of
//! [`RemoteConfig::chunk_tokens`](super::RemoteConfig) tokens; chunk `k` is named by a hash
//! chain, `h_k = sha256(h_{k-1} ‖ token ids of chunk k)`, started from `h_0 = sha256(format
//! ‖ model identity ‖ chunk size)`. Two sequences share `h_k` exactly when they share their
//! first `k` chunks under the same model weights, so the chain names a *prefix*, and KV
//! computed by other weights never matches. Each chunk is stored per layer, under a key that
//! also names the layer's kind and the stored element type:
//!
//! ```text
//! {ns}:{model}:kv:{h_k}:{layer}:{kind}:{dtype}   rows of chunk k of one layer
//! {ns}:{model}:ix:{h_k}:{layer}:{method}         an index layout covering chunks 1..=k
//! {ns}:{model}:ixs:{h_k}                         which layers have a layout at chunk k
//! ```
//!
//! `{model}` is the first 16 hex digits of the model's sha256 (for operators: every key of a
//! model matches one pattern); `{h_k}` is the first 32 hex digits of the chain hash (128
//! bits). Every value also carries the full chain hash it was stored for, which decoding
//! checks (`value.rs`).

use crate::spec::LayerKind;
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

/// Version of the key scheme and value format: part of `h_0`, so a changed format never
/// reads the old one's values.
pub(crate) const FORMAT: &[u8] = b"attnstore-remote-v1";

/// The identity of a model's weights (their sha256): KV is only ever reused between engines
/// serving the same identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModelId(pub [u8; 32]);

impl ModelId {
    /// The sha256 of a weights file (e.g. a GGUF), read in 1 MiB pieces.
    pub fn of_file(path: &Path) -> std::io::Result<Self> {
        let mut file = std::fs::File::open(path)?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = file.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
        }
        Ok(Self(hasher.finalize().into()))
    }

    /// The sha256 of `bytes` (weights held in memory, or a name in tests).
    pub fn of_bytes(bytes: &[u8]) -> Self {
        Self(Sha256::digest(bytes).into())
    }

    /// Parses 64 hex digits (as `sha256sum` prints them).
    pub fn from_hex(hex: &str) -> Option<Self> {
        let hex = hex.trim();
        if hex.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Self(out))
    }

    /// The 64 hex digits.
    pub fn hex(&self) -> String {
        hex(&self.0)
    }
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The chain hashes of the whole chunks of `tokens`: element `k - 1` names chunks `1..=k`.
pub(crate) fn chain(model: &ModelId, chunk_tokens: usize, tokens: &[u32]) -> Vec<[u8; 32]> {
    let mut h: [u8; 32] = {
        let mut s = Sha256::new();
        s.update(FORMAT);
        s.update(model.0);
        s.update((chunk_tokens as u64).to_le_bytes());
        s.finalize().into()
    };
    tokens
        .chunks_exact(chunk_tokens)
        .map(|chunk| {
            let mut s = Sha256::new();
            s.update(h);
            for t in chunk {
                s.update(t.to_le_bytes());
            }
            h = s.finalize().into();
            h
        })
        .collect()
}

/// Names the values of one model in one namespace.
#[derive(Debug, Clone)]
pub(crate) struct KeySpace {
    prefix: String,
}

impl KeySpace {
    pub fn new(namespace: &str, model: &ModelId) -> Self {
        Self { prefix: format!("{namespace}:{}", &model.hex()[..16]) }
    }

    /// Rows of one layer's chunk named by `h`.
    pub fn chunk(&self, h: &[u8; 32], layer: usize, kind: LayerKind, dtype: &str) -> String {
        let kind = match kind {
            LayerKind::Global => "g".to_owned(),
            LayerKind::SlidingWindow(w) => format!("w{w}"),
        };
        format!("{}:kv:{}:{layer}:{kind}:{dtype}", self.prefix, hex(&h[..16]))
    }

    /// An index layout of one layer covering the chunks up to the one named by `h`.
    pub fn layout(&self, h: &[u8; 32], layer: usize, method: &str) -> String {
        format!("{}:ix:{}:{layer}:{method}", self.prefix, hex(&h[..16]))
    }

    /// The list of layers with a layout at the chunk named by `h`.
    pub fn layouts(&self, h: &[u8; 32]) -> String {
        format!("{}:ixs:{}", self.prefix, hex(&h[..16]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_name_prefixes() {
        let m = ModelId::of_bytes(b"model a");
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[25] = 999; // chunk 3 of 8-token chunks differs
        let (ca, cb) = (chain(&m, 8, &a), chain(&m, 8, &b));
        assert_eq!(ca.len(), 5);
        assert_eq!(ca[..3], cb[..3]);
        assert!(ca[3..].iter().zip(&cb[3..]).all(|(x, y)| x != y), "a divergence changes every later link");
        let other = chain(&ModelId::of_bytes(b"model b"), 8, &a);
        assert!(ca.iter().zip(&other).all(|(x, y)| x != y), "another model shares no link");
        assert_ne!(chain(&m, 4, &a)[1], ca[0], "the chunk size is part of the chain");
    }

    #[test]
    fn model_ids_round_trip_hex() {
        let m = ModelId::of_bytes(b"weights");
        assert_eq!(ModelId::from_hex(&m.hex()), Some(m));
        assert_eq!(ModelId::from_hex("abc"), None);
        assert_eq!(ModelId::from_hex(&"zz".repeat(32)), None);
    }
}
