//! The remote tier in Python (`attnstore.RemoteTier`): contexts published to Redis or a
//! Redis Cluster and attached by other engines, so a prompt prefilled on one process or
//! node is reused on another (`docs/remote.md`).

use crate::{py_err, spec_of, Engine, InvalidArgumentError, LayerKinds, ShapeError};
use attnstore::remote::{LayerKv, ModelId, RemoteConfig, RemoteStats};
use attnstore::ContextId;
use attnstore_remote::{RedisConfig, RedisStore};
use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Arc;
use std::time::Duration;

create_exception!(
    _attnstore,
    RemoteError,
    crate::AttnstoreError,
    "The remote store could not be reached when the tier was made."
);

/// A model's identity from the 64 hex digits of a sha256 of its weights (`model_id`).
fn model(model: &str) -> PyResult<ModelId> {
    ModelId::from_hex(model).ok_or_else(|| {
        InvalidArgumentError::new_err(format!(
            "model {model:?}: expected the 64 hex digits of a sha256 of the weights (attnstore.model_id)"
        ))
    })
}

/// Token ids from a sequence of ints or a 1-D integer array.
fn token_ids(tokens: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let ids: Vec<i64> = if let Ok(a) = tokens.cast::<numpy::PyUntypedArray>() {
        if a.ndim() != 1 {
            return Err(ShapeError::new_err(format!("tokens has shape {:?}; expected one dimension", a.shape())));
        }
        tokens.call_method1("astype", ("int64",))?.cast_into::<PyArray1<i64>>()?.readonly().as_array().to_vec()
    } else {
        tokens.extract().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err("tokens must be a sequence of ints or a 1-D integer array")
        })?
    };
    ids.into_iter()
        .map(|t| u32::try_from(t).map_err(|_| PyValueError::new_err(format!("token id {t} is not in 0..2^32"))))
        .collect()
}

/// The sha256 of a weights file (64 hex digits), for `RemoteTier.publish` and `attach`: KV
/// is only reused between engines that name the same weights. `data=` hashes bytes instead.
#[pyfunction]
#[pyo3(signature = (path=None, data=None))]
pub(crate) fn model_id(py: Python<'_>, path: Option<std::path::PathBuf>, data: Option<&[u8]>) -> PyResult<String> {
    match (path, data) {
        (Some(p), None) => py
            .detach(|| ModelId::of_file(&p))
            .map(|m| m.hex())
            .map_err(|e| pyo3::exceptions::PyOSError::new_err(format!("{}: {e}", p.display()))),
        (None, Some(d)) => Ok(ModelId::of_bytes(d).hex()),
        _ => Err(PyValueError::new_err("model_id takes exactly one of path= or data=")),
    }
}

/// A layer's keys and values as `[kv_heads, rows, head_dim]` float32 arrays.
type KvArrays<'py> = (Bound<'py, numpy::PyArray3<f32>>, Bound<'py, numpy::PyArray3<f32>>);

/// A context attached from the remote tier.
#[pyclass(module = "attnstore._attnstore", frozen)]
pub(crate) struct Attached {
    /// The new context's id.
    #[pyo3(get)]
    context: u64,
    /// Tokens reused (whole chunks; the caller prefills the rest of its prompt).
    #[pyo3(get)]
    tokens: usize,
    /// Layers whose index was restored from a published layout (nothing clustered again).
    #[pyo3(get)]
    layouts_used: usize,
    /// Seconds spent finding the prefix and reading and checking its values.
    #[pyo3(get)]
    fetch_seconds: f64,
    /// Seconds spent building the context from them.
    #[pyo3(get)]
    build_seconds: f64,
    kv: Vec<LayerKv>,
    kv_heads: usize,
    head_dim: usize,
}

#[pymethods]
impl Attached {
    /// Layer `layer`'s attached keys and values, each `[kv_heads, rows, head_dim]` float32:
    /// every token for a global layer, the last `min(window, tokens)` for a sliding-window
    /// one (what a model continuing the prompt attends to).
    fn kv<'py>(&self, py: Python<'py>, layer: usize) -> PyResult<KvArrays<'py>> {
        let Some((k, v)) = self.kv.get(layer) else {
            return Err(crate::UnknownContextError::new_err(format!(
                "layer {layer}: the attached context has {} layers",
                self.kv.len()
            )));
        };
        let rows = k.len() / (self.kv_heads * self.head_dim).max(1);
        let shape = [self.kv_heads, rows, self.head_dim];
        Ok((PyArray1::from_slice(py, k).reshape(shape)?, PyArray1::from_slice(py, v).reshape(shape)?))
    }

    fn __repr__(&self) -> String {
        format!(
            "<attnstore.Attached context {} with {} tokens, {} layouts used, fetch {:.3} s, build {:.3} s>",
            self.context, self.tokens, self.layouts_used, self.fetch_seconds, self.build_seconds
        )
    }
}

/// A remote tier on Redis (`redis://HOST:PORT`) or a Redis Cluster (seeds separated by
/// commas): `publish` queues a context's KV and index layouts for a background writer;
/// `attach` builds a new context from the longest published prefix of a token sequence.
/// A store that fails or is slow costs a bounded wait (`timeout` seconds per call) and
/// shortens what is reused, never a wrong answer. `chunk_tokens` is the unit of reuse.
#[pyclass(module = "attnstore._attnstore", frozen)]
pub(crate) struct RemoteTier {
    inner: attnstore::remote::RemoteTier,
}

#[pymethods]
impl RemoteTier {
    #[new]
    #[pyo3(signature = (url, chunk_tokens=256, timeout=2.0, namespace="attnstore", queue_publishes=4))]
    fn new(
        py: Python<'_>,
        url: &str,
        chunk_tokens: usize,
        timeout: f64,
        namespace: &str,
        queue_publishes: usize,
    ) -> PyResult<Self> {
        if !(timeout > 0.0 && timeout.is_finite()) {
            return Err(PyValueError::new_err(format!("timeout {timeout} must be a finite number of seconds > 0")));
        }
        let config = RedisConfig { timeout: Duration::from_secs_f64(timeout), ..RedisConfig::default() };
        let store =
            py.detach(|| RedisStore::connect(url, config)).map_err(|e| RemoteError::new_err(format!("{url}: {e}")))?;
        let tier =
            RemoteConfig { namespace: namespace.to_string(), chunk_tokens, queue_publishes, ..RemoteConfig::default() };
        let inner = attnstore::remote::RemoteTier::new(Arc::new(store), tier).map_err(py_err)?;
        Ok(Self { inner })
    }

    /// Queues context `ctx` of `engine` for publishing under `model` (`model_id`): `tokens`
    /// are the token ids whose KV it holds, `kv` one `(k, v)` pair per layer as given to
    /// `prefill` / `append` (`[kv_heads, tokens, head_dim]`; a sliding-window layer may give
    /// only its last rows). Whole chunks are published with the layers' index layouts.
    /// Returns once queued; `flush` waits for the writer.
    fn publish(
        &self,
        py: Python<'_>,
        engine: &Engine,
        ctx: u64,
        model: &str,
        tokens: &Bound<'_, PyAny>,
        kv: Vec<(Bound<'_, PyAny>, Bound<'_, PyAny>)>,
    ) -> PyResult<()> {
        let e = engine.engine()?;
        let model = self::model(model)?;
        let ids = token_ids(tokens)?;
        let layers = kv
            .iter()
            .map(|(k, v)| {
                let (mut keys, mut values) = (Vec::new(), Vec::new());
                Engine::kv(&e, ctx, k, v, (&mut keys, &mut values)).map(|()| (keys, values))
            })
            .collect::<PyResult<Vec<LayerKv>>>()?;
        py.detach(|| self.inner.publish(&e, ContextId(ctx), &model, &ids, layers)).map_err(py_err)
    }

    /// Waits up to `timeout` seconds until every queued publish is written; whether it was.
    #[pyo3(signature = (timeout=60.0))]
    fn flush(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let timeout = crate::seconds(timeout)?;
        Ok(py.detach(|| self.inner.flush(timeout)))
    }

    /// Builds a new context in `engine` (arguments as `Engine.create_context`) from the
    /// longest prefix of `tokens` published under `model`, whole chunks; `None` when not one
    /// chunk is usable. Missing, corrupt or unreachable values shorten the prefix (see
    /// `stats`). A model that needs the logits of its last prompt token attaches the prompt
    /// without it.
    #[pyo3(signature = (engine, model, tokens, q_heads, kv_heads, head_dim, layers=1, dtype="f16", method="wave",
                        codec=None, windows=None))]
    #[allow(clippy::too_many_arguments, reason = "the Python signature: keyword arguments with defaults")]
    fn attach(
        &self,
        py: Python<'_>,
        engine: &Engine,
        model: &str,
        tokens: &Bound<'_, PyAny>,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        layers: usize,
        dtype: &str,
        method: &str,
        codec: Option<&str>,
        windows: Option<LayerKinds>,
    ) -> PyResult<Option<Attached>> {
        let e = engine.engine()?;
        let spec = spec_of(q_heads, kv_heads, head_dim, layers, dtype, method, codec, windows)?;
        let model = self::model(model)?;
        let ids = token_ids(tokens)?;
        let got = py.detach(|| self.inner.attach(&e, spec, &model, &ids)).map_err(py_err)?;
        Ok(got.map(|a| Attached {
            context: a.context.0,
            tokens: a.tokens,
            layouts_used: a.layouts_used,
            fetch_seconds: a.fetch_time.as_secs_f64(),
            build_seconds: a.build_time.as_secs_f64(),
            kv: a.kv,
            kv_heads,
            head_dim,
        }))
    }

    /// The tier's counters: bytes and values in and out, hits, misses, corrupt values,
    /// failures by kind, publishes queued / done / failed / dropped, attaches and the tokens
    /// they asked for and reused, layouts used, store calls and their latency.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s: RemoteStats = self.inner.stats();
        let out = PyDict::new(py);
        let fields: [(&str, u64); 21] = [
            ("bytes_out", s.bytes_out),
            ("bytes_in", s.bytes_in),
            ("values_out", s.values_out),
            ("values_present", s.values_present),
            ("hits", s.hits),
            ("misses", s.misses),
            ("corrupt", s.corrupt),
            ("timeouts", s.timeouts),
            ("connection_failures", s.connection_failures),
            ("server_failures", s.server_failures),
            ("publishes_queued", s.publishes_queued),
            ("publishes_done", s.publishes_done),
            ("publishes_failed", s.publishes_failed),
            ("publishes_dropped", s.publishes_dropped),
            ("attaches", s.attaches),
            ("attach_tokens_asked", s.attach_tokens_asked),
            ("attach_tokens_reused", s.attach_tokens_reused),
            ("layouts_used", s.layouts_used),
            ("calls", s.calls),
            ("call_micros", s.call_micros),
            ("max_call_micros", s.max_call_micros),
        ];
        for (name, value) in fields {
            out.set_item(name, value)?;
        }
        Ok(out)
    }

    /// Tokens per chunk (the unit of reuse).
    #[getter]
    fn chunk_tokens(&self) -> usize {
        self.inner.config().chunk_tokens
    }

    fn __repr__(&self) -> String {
        format!("<attnstore.RemoteTier {} ({})>", self.inner.describe(), self.inner.stats().summary())
    }
}

/// Adds the remote tier's classes, function and exception to the module.
pub(crate) fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RemoteTier>()?;
    m.add_class::<Attached>()?;
    m.add_function(wrap_pyfunction!(model_id, m)?)?;
    m.add("RemoteError", m.py().get_type::<RemoteError>())?;
    Ok(())
}
