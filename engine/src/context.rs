//! A context in the catalog: its spec and, per layer, the access method holding its KV.

use crate::error::Result;
use crate::exec::home::BlockStore;
use crate::spec::{ContextSpec, LayerKind, Method};
use attnstore_buffer::{BufferManager, Reservation};
use attnstore_index::{AccessMethod, FlatIndex, PqIndex, WaveIndex, WindowIndex};
use attnstore_kernels::{DType, Element};
use half::{bf16, f16};
use parking_lot::RwLock;
use std::fmt;
use std::sync::Arc;

/// Identifies a context within an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContextId(pub u64);

impl fmt::Display for ContextId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ctx#{}", self.0)
    }
}

/// One layer's KV and its bookkeeping.
pub(crate) struct Layer {
    pub kind: LayerKind,
    pub method: Box<dyn AccessMethod>,
    /// Where the method homes indexed rows in the engine's buffer manager (wave layers
    /// use it; the executor reads homed rows through it).
    pub home: Option<BlockStore>,
    /// Host memory held for this layer's KV.
    pub reservation: Option<Reservation>,
    /// Bumped by every prefill or append, so a plan can tell it is stale.
    pub version: u64,
    pub prefilled: bool,
    /// A recovered layer served exactly while its index is rebuilt in the background.
    pub rebuilding: bool,
}

/// A context: spec plus layers, each behind its own lock so layers ingest in parallel.
pub(crate) struct Context {
    pub spec: ContextSpec,
    pub layers: Vec<RwLock<Layer>>,
}

impl Context {
    /// `buffers`: where wave and PQ layers home their indexed rows.
    pub fn new(spec: ContextSpec, id: ContextId, buffers: Option<&Arc<BufferManager>>) -> Result<Self> {
        let layers = spec
            .layers
            .iter()
            .enumerate()
            .map(|(layer, &kind)| {
                let home = buffers.map(|b| BlockStore::new(Arc::clone(b), id.0, layer as u32));
                Ok(RwLock::new(Layer {
                    kind,
                    method: make_method(&spec, layer, home.as_ref())?,
                    home,
                    reservation: None,
                    version: 0,
                    prefilled: false,
                    rebuilding: false,
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { spec, layers })
    }
}

/// The access method of layer `layer` (its kind and codec from `spec`); `home` homes a wave
/// index's segment rows in the buffer manager, plain or 2-bit (`hack2`), and a plain PQ
/// index's base rows (ignored by flat and window layers, see `docs/buffer-manager.md`).
pub(crate) fn make_method(
    spec: &ContextSpec,
    layer: usize,
    home: Option<&BlockStore>,
) -> Result<Box<dyn AccessMethod>> {
    fn typed<E: Element>(spec: &ContextSpec, layer: usize, home: Option<&BlockStore>) -> Result<Box<dyn AccessMethod>> {
        let (h, d) = (spec.shape.kv_heads, spec.shape.head_dim);
        let (kind, codec) = (spec.layers[layer], spec.codec_of(layer));
        Ok(match (kind, spec.method) {
            (LayerKind::SlidingWindow(w), _) => Box::new(WindowIndex::<E>::new(w, h, d)?),
            (LayerKind::Global, Method::Wave(p)) => {
                let index = WaveIndex::<E>::new(p, h, d)?.with_codec(codec)?;
                match home {
                    // kv43 segments stay in the index's memory (no row home layout yet).
                    Some(store) if codec.kv43().is_none() => Box::new(index.with_home(Arc::new(store.clone()))?),
                    _ => Box::new(index),
                }
            }
            (LayerKind::Global, Method::Flat) => Box::new(FlatIndex::<E>::new(h, d)?),
            (LayerKind::Global, Method::Pq(p)) => {
                let index = PqIndex::<E>::new(p, h, d)?.with_codec(codec)?;
                match home {
                    // A hack2 or kv43 PQ index keeps its encoded rows (their durable home is
                    // the checkpoint's encoded home).
                    Some(store) if !codec.is_encoded() => Box::new(index.with_home(Arc::new(store.clone()))?),
                    _ => Box::new(index),
                }
            }
        })
    }
    match spec.dtype {
        DType::F32 => typed::<f32>(spec, layer, home),
        DType::F16 => typed::<f16>(spec, layer, home),
        DType::Bf16 => typed::<bf16>(spec, layer, home),
    }
}
