//! What a context is: its attention shape, its layers' kinds, its storage type and the
//! access method that serves its global layers.

use crate::error::{Error, Result};
use attnstore_index::{PqParams, WaveParams};
use attnstore_kernels::{AttnShape, DType};

/// The kind of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Attends all tokens; served by the context's access method.
    Global,
    /// Attends only the last `w` tokens (e.g. Gemma-3's local layers): only those are kept,
    /// always exactly.
    SlidingWindow(usize),
}

/// The access method of a context's global layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// RetroInfer's segmented cluster index with tripartite attention.
    Wave(WaveParams),
    /// No index: exact attention, or an exact top-k of true scores (the oracle).
    Flat,
    /// PQCache's product-quantization index: top-k of approximate scores from PQ codes.
    Pq(PqParams),
}

impl Method {
    /// Name for EXPLAIN and JSON.
    pub fn name(&self) -> &'static str {
        match self {
            Method::Wave(_) => "wave",
            Method::Flat => "flat",
            Method::Pq(_) => "pq",
        }
    }
}

impl Default for Method {
    fn default() -> Self {
        Method::Wave(WaveParams::default())
    }
}

/// Everything needed to create a context.
#[derive(Debug, Clone, PartialEq)]
pub struct ContextSpec {
    /// Heads and head dimension (shared by all layers).
    pub shape: AttnShape,
    /// One entry per layer.
    pub layers: Vec<LayerKind>,
    /// Storage type of keys and values.
    pub dtype: DType,
    /// Access method of the global layers.
    pub method: Method,
}

impl ContextSpec {
    /// `layers` global layers of `shape`, f16 storage, the wave index.
    pub fn new(shape: AttnShape, layers: usize) -> Self {
        Self { shape, layers: vec![LayerKind::Global; layers], dtype: DType::F16, method: Method::default() }
    }

    /// Sets the storage type.
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// Sets the access method.
    pub fn with_method(mut self, method: Method) -> Self {
        self.method = method;
        self
    }

    /// Sets the layer kinds.
    pub fn with_layers(mut self, layers: Vec<LayerKind>) -> Self {
        self.layers = layers;
        self
    }

    /// Checks the spec before anything is allocated.
    pub fn validate(&self) -> Result<()> {
        AttnShape::new(self.shape.q_heads, self.shape.kv_heads, self.shape.head_dim)?;
        if self.layers.is_empty() {
            return Err(Error::InvalidSpec("a context needs at least one layer".into()));
        }
        if let Some(i) = self.layers.iter().position(|k| *k == LayerKind::SlidingWindow(0)) {
            return Err(Error::InvalidSpec(format!("layer {i}: a sliding window must hold at least one token")));
        }
        match &self.method {
            Method::Wave(p) => p.validate()?,
            Method::Pq(p) => p.validate(self.shape.head_dim)?,
            Method::Flat => {}
        }
        Ok(())
    }
}
