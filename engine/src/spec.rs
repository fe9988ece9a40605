//! What a context is: its attention shape, its layers' kinds, its storage type and the
//! access method that serves its global layers.

use crate::error::{Error, Result};
use attnstore_index::{PqParams, WaveParams};
use attnstore_kernels::{AttnShape, Codec, CodecOverrides, DType, LayerCodecs};

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

/// `wave`, `pq` or `flat` (surrounding spaces ignored), each with its default parameters.
impl std::str::FromStr for Method {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "wave" => Ok(Method::Wave(WaveParams::default())),
            "pq" => Ok(Method::Pq(PqParams::default())),
            "flat" => Ok(Method::Flat),
            other => Err(Error::InvalidSpec(format!("unknown method {other:?}: expected wave, pq or flat"))),
        }
    }
}

/// Everything needed to create a context.
#[derive(Debug, Clone, PartialEq)]
pub struct ContextSpec {
    /// Heads and head dimension (shared by all layers).
    pub shape: AttnShape,
    /// One entry per layer.
    pub layers: Vec<LayerKind>,
    /// Storage type of keys and values kept plain (all of them, unless `codec` is `hack2`,
    /// which keeps only the steady zone plain).
    pub dtype: DType,
    /// How stored rows are encoded: the plain `dtype`, or `hack2` / `kv43` for indexed
    /// rows; the codec of every layer `codec_overrides` does not name.
    pub codec: Codec,
    /// Ranges of layers with a codec of their own (e.g. 4-bit kv43 values where a model's
    /// values need them); empty by default.
    pub codec_overrides: CodecOverrides,
    /// Access method of the global layers.
    pub method: Method,
}

impl ContextSpec {
    /// `layers` global layers of `shape`, f16 storage, the wave index.
    pub fn new(shape: AttnShape, layers: usize) -> Self {
        Self {
            shape,
            layers: vec![LayerKind::Global; layers],
            dtype: DType::F16,
            codec: Codec::F16,
            codec_overrides: CodecOverrides::default(),
            method: Method::default(),
        }
    }

    /// The codec of layer `layer`: its override, or the context's codec.
    pub fn codec_of(&self, layer: usize) -> Codec {
        self.layer_codecs().of(layer)
    }

    /// The codecs per layer: the context's codec and its overrides.
    pub fn layer_codecs(&self) -> LayerCodecs {
        LayerCodecs { default: self.codec, overrides: self.codec_overrides }
    }

    /// Sets the plain storage type (the codec follows it, unless it is `hack2`, whose
    /// steady zone then uses this type).
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        if !self.codec.is_encoded() {
            self.codec = Codec::from(dtype);
        }
        self
    }

    /// Sets the codec; a plain codec also sets the storage type.
    pub fn with_codec(mut self, codec: Codec) -> Self {
        self.codec = codec;
        if !codec.is_encoded() {
            self.dtype = codec.plain_dtype();
        }
        self
    }

    /// Sets the codec of every layer and the overrides for ranges of them; the default
    /// codec sets the storage type as [`ContextSpec::with_codec`] does.
    pub fn with_layer_codecs(self, codecs: LayerCodecs) -> Self {
        let mut spec = self.with_codec(codecs.default);
        spec.codec_overrides = codecs.overrides;
        spec
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
        if let Some(last) = self.codec_overrides.last_layer().filter(|&l| l >= self.layers.len()) {
            return Err(Error::InvalidSpec(format!(
                "codec overrides name layer {last}, but the context has {} layers",
                self.layers.len()
            )));
        }
        self.check_codec(self.codec)?;
        for (layers, codec) in self.codec_overrides.iter() {
            self.check_codec(codec).map_err(|e| match e {
                Error::InvalidSpec(m) => Error::InvalidSpec(format!("layers {}-{}: {m}", layers.start(), layers.end())),
                e => e,
            })?;
        }
        match &self.method {
            Method::Wave(p) => p.validate()?,
            Method::Pq(p) => p.validate(self.shape.head_dim)?,
            Method::Flat => {}
        }
        Ok(())
    }

    /// Checks that `codec` can store this spec's rows with its method and storage type.
    fn check_codec(&self, codec: Codec) -> Result<()> {
        if let Some(p) = codec.kv43() {
            p.check(self.shape.head_dim).map_err(|e| Error::InvalidSpec(format!("the kv43 codec: {e}")))?;
        }
        match (codec.is_encoded().then_some(codec), &self.method) {
            (None, _) if codec.plain_dtype() != self.dtype => {
                return Err(Error::InvalidSpec(format!(
                    "codec {} stores {} rows but the spec's dtype is {}: set one with with_codec",
                    codec,
                    codec.plain_dtype(),
                    self.dtype
                )));
            }
            (Some(c), Method::Flat) => {
                return Err(Error::InvalidSpec(format!(
                    "the {} codec encodes indexed rows: use it with the wave or pq method (flat keeps rows plain as the exact oracle)",
                    c.name()
                )));
            }
            (Some(c), _) if self.dtype != DType::F16 => {
                return Err(Error::InvalidSpec(format!(
                    "the {} codec keeps its unencoded rows (steady zone) in f16, not {}",
                    c.name(),
                    self.dtype
                )));
            }
            (Some(_), _) if !self.shape.head_dim.is_multiple_of(4) => {
                return Err(Error::InvalidSpec(format!(
                    "the hack2 codec packs four values per byte: head_dim must be a multiple of 4, got {}",
                    self.shape.head_dim
                )));
            }
            _ => {}
        }
        Ok(())
    }
}
