//! Python bindings of attnstore (`import attnstore`): an [`Engine`] in memory or durable at a
//! path, contexts with their shape, method and codec, `prefill` / `append` / `plan` /
//! `execute` over NumPy arrays, `Plan.explain()`, and the one-call `attend`. The GIL is
//! released while the engine plans, executes and does I/O, so one engine serves several
//! Python threads. Rust errors become `attnstore.AttnstoreError` subclasses; a panic across
//! the boundary is raised as pyo3's `PanicException`, never an abort.

use attnstore::{
    AttnShape, Budget, BufferSettings, ContextId, ContextSpec, DType, EngineConfig, EstimateShare, LayerCodecs,
    LayerKind, Method, Request,
};
use numpy::{IntoPyArray, PyArray2, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

mod dlpack;
mod remote;

create_exception!(_attnstore, AttnstoreError, PyException, "Base class of every error attnstore raises.");
create_exception!(_attnstore, ShapeError, AttnstoreError, "An array of the wrong shape, or NaN/Inf in it.");
create_exception!(_attnstore, UnknownContextError, AttnstoreError, "No such context or layer.");
create_exception!(_attnstore, InvalidArgumentError, AttnstoreError, "A bad budget, spec or argument.");
create_exception!(_attnstore, CorruptDataError, AttnstoreError, "Stored data failed its checks.");
create_exception!(_attnstore, StorageError, AttnstoreError, "The buffer manager, disk or log failed or is full.");
create_exception!(_attnstore, StalePlanError, AttnstoreError, "A layer changed since the plan was made.");
create_exception!(_attnstore, ClosedError, AttnstoreError, "The engine was closed.");

/// The Python exception of an engine error, with its message.
fn py_err(e: attnstore::Error) -> PyErr {
    use attnstore::ErrorKind as K;
    let msg = e.to_string();
    match e.kind() {
        K::Shape => ShapeError::new_err(msg),
        K::UnknownContext => UnknownContextError::new_err(msg),
        K::InvalidArgument => InvalidArgumentError::new_err(msg),
        K::StalePlan => StalePlanError::new_err(msg),
        K::Corrupt => CorruptDataError::new_err(msg),
        K::Storage => StorageError::new_err(msg),
        K::Other => AttnstoreError::new_err(msg),
    }
}

/// An array's elements as f32 in C order, with its shape: NumPy float32 is read as it is,
/// float16 and float64 are converted; other objects are read through DLPack (CPU tensors);
/// anything else is a `TypeError` naming what is accepted.
fn floats(what: &str, array: &Bound<'_, PyAny>) -> PyResult<(Vec<f32>, Vec<usize>)> {
    let mut values = Vec::new();
    let shape = floats_into(what, array, &mut values)?;
    Ok((values, shape))
}

/// [`floats`] written over `out` (its capacity reused: a staging buffer kept warm between
/// large ingests faults no new pages in).
fn floats_into(what: &str, array: &Bound<'_, PyAny>, out: &mut Vec<f32>) -> PyResult<Vec<usize>> {
    let Ok(untyped) = array.cast::<PyUntypedArray>() else {
        // Not NumPy: a DLPack tensor (torch, JAX, ...) on the CPU.
        return dlpack::floats_into(what, array, out)?.ok_or_else(|| {
            PyTypeError::new_err(format!(
                "{what} must be a numpy.ndarray or a DLPack tensor (__dlpack__) of float32, float16, bfloat16 or float64"
            ))
        });
    };
    let shape = untyped.shape().to_vec();
    let dtype = untyped.dtype();
    let py = array.py();
    out.clear();
    if dtype.is_equiv_to(&numpy::dtype::<f32>(py)) {
        let a = array.cast::<numpy::PyArrayDyn<f32>>()?;
        // A C-contiguous array is one copy, made under the GIL without taking rust-numpy's
        // borrow flags (a global table: a tenth of what the boundary adds); others are
        // walked in C order.
        // SAFETY: the slice is read only while this thread holds the GIL and runs no Python
        // code, so nothing can write the array or free it meanwhile.
        match unsafe { a.as_slice() } {
            Ok(run) => out.extend_from_slice(run),
            Err(_) => out.extend(a.readonly().as_array().iter().copied()),
        }
    } else if dtype.is_equiv_to(&numpy::dtype::<half::f16>(py)) {
        let a = array.cast::<numpy::PyArrayDyn<half::f16>>()?.readonly();
        out.extend(a.as_array().iter().map(|x| x.to_f32()));
    } else if dtype.is_equiv_to(&numpy::dtype::<f64>(py)) {
        let a = array.cast::<numpy::PyArrayDyn<f64>>()?.readonly();
        out.extend(a.as_array().iter().map(|&x| x as f32));
    } else {
        return Err(PyTypeError::new_err(format!("{what} has dtype {dtype}; expected float32, float16 or float64")));
    }
    Ok(shape)
}

/// Checks `shape` against `want` (`None`: any length), naming the layout in the error
/// (`layout` is only formatted then: a decode step's query passes every time).
fn check_shape(what: &str, shape: &[usize], want: &[Option<usize>], layout: impl FnOnce() -> String) -> PyResult<()> {
    let ok = shape.len() == want.len() && shape.iter().zip(want).all(|(s, w)| w.is_none_or(|w| w == *s));
    if ok {
        return Ok(());
    }
    Err(ShapeError::new_err(format!("{what} has shape {shape:?}; expected {}", layout())))
}

/// The budget of a call: exact, else `given` (a [`PyBudget`]) or the engine's default, with
/// `retrieve` overriding its retrieval fraction.
fn budget(exact: bool, retrieve: Option<f64>, given: Option<&PyBudget>) -> PyResult<Budget> {
    if exact {
        return Ok(Budget::full());
    }
    let mut b = given.map_or_else(Budget::default, |g| g.inner);
    if let Some(r) = retrieve {
        b = b.with_retrieve(r);
    }
    b.validate().map_err(py_err)?;
    Ok(b)
}

/// How much of a context a sparse plan attends exactly and how much it estimates.
///
/// `Budget()` is the engine's default (1.8% of the tokens retrieved, at least 512, 23.2%
/// estimated). `exact=True` attends every token. `floor`: the fewest retrieved tokens;
/// `estimate`: the estimated share of tokens, or `"rest"` for every cluster not retrieved;
/// `short_context`: contexts of at most this many tokens are attended exactly.
#[pyclass(name = "Budget", module = "attnstore._attnstore", frozen)]
#[derive(Clone)]
struct PyBudget {
    inner: Budget,
}

#[pymethods]
impl PyBudget {
    #[new]
    #[pyo3(signature = (exact=false, retrieve=None, floor=None, estimate=None, short_context=None))]
    fn new(
        exact: bool,
        retrieve: Option<f64>,
        floor: Option<usize>,
        estimate: Option<&Bound<'_, PyAny>>,
        short_context: Option<usize>,
    ) -> PyResult<Self> {
        if exact {
            return Ok(Self { inner: Budget::full() });
        }
        let mut b = Budget::default();
        if let Some(r) = retrieve {
            b = b.with_retrieve(r);
        }
        if let Some(f) = floor {
            b = b.with_retrieve_floor(f);
        }
        if let Some(e) = estimate {
            let share = if let Ok(s) = e.extract::<String>() {
                if s != "rest" {
                    return Err(InvalidArgumentError::new_err(format!(
                        "estimate {s:?}: expected a fraction of the tokens in [0, 1] or \"rest\""
                    )));
                }
                EstimateShare::Rest
            } else {
                let f: f64 = e.extract().map_err(|_| {
                    PyTypeError::new_err("estimate must be a float (a fraction of the tokens) or \"rest\"")
                })?;
                EstimateShare::Fraction(f)
            };
            b = b.with_estimate(share);
        }
        if let Some(s) = short_context {
            b = b.with_short_context(s);
        }
        b.validate().map_err(py_err)?;
        Ok(Self { inner: b })
    }

    /// Whether every token is attended exactly.
    #[getter]
    fn exact(&self) -> bool {
        self.inner.exact
    }

    /// The retrieved fraction of the tokens.
    #[getter]
    fn retrieve(&self) -> f64 {
        self.inner.retrieve_frac
    }

    /// The fewest retrieved tokens.
    #[getter]
    fn floor(&self) -> usize {
        self.inner.retrieve_floor_tokens
    }

    /// Contexts of at most this many tokens are attended exactly (0: no such rule).
    #[getter]
    fn short_context(&self) -> usize {
        self.inner.short_context_tokens
    }

    fn __repr__(&self) -> String {
        format!("<attnstore.Budget {}>", self.inner.describe())
    }
}

/// A storage engine for the attention KV cache.
///
/// `Engine()` keeps everything in memory; `Engine(path="dir")` is durable (a write-ahead
/// log and checkpoints in `dir`, reopened with the same call). `host_blocks` gives it a
/// buffer manager of that many 2 KiB blocks (the home of the indexed rows; the GPU path
/// reads them there).
#[pyclass(module = "attnstore._attnstore", frozen)]
struct Engine {
    /// The engine; `None` once closed. Calls hold their own `Arc`, so `close` waits for none
    /// of them: the engine shuts down when the last running call returns.
    slot: RwLock<Option<Arc<attnstore::Engine>>>,
    /// Plans with `plan_gpu` and executes with `execute_gpu` (the `cuda` build, `gpu=True`).
    gpu: bool,
    /// What the GPU executor did, summed over calls (`gpu_stats`).
    gpu_totals: GpuTotals,
    /// Buffers that `prefill` and `append` read their arrays into.
    staging: Staging,
}

/// f32 buffers kept between ingests. A 128K-token prompt of 8 KV heads of 128 dimensions is
/// 512 MiB of f32 keys and as much of values per layer; read into fresh memory, every
/// layer pays for faulting a gibibyte of new pages in, which on a VM is as slow as the
/// index build itself (`docs/python.md`, "Ingest"). Up to [`Staging::KEEP`] buffers are
/// kept, each as large as the largest array read into it, until the engine is closed.
#[derive(Default)]
struct Staging {
    free: std::sync::Mutex<Vec<Vec<f32>>>,
}

impl Staging {
    /// Buffers kept: the keys and values of two concurrent ingests.
    const KEEP: usize = 4;

    /// A kept buffer (empty, its capacity kept), or a new one.
    fn take(&self) -> Vec<f32> {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default()
    }

    /// Keeps `buffer` for the next ingest, unless [`Staging::KEEP`] are kept already.
    fn give(&self, mut buffer: Vec<f32>) {
        buffer.clear();
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < Self::KEEP {
            free.push(buffer);
        }
    }

    /// Frees every kept buffer.
    fn release(&self) {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// Sums of the GPU executor's per-call reports.
#[derive(Default)]
struct GpuTotals {
    on_gpu: AtomicU64,
    on_cpu: AtomicU64,
    device_clusters: AtomicU64,
    device_missed: AtomicU64,
}

/// A plan: what a decode step will read, per request and zone. `explain()` prints it.
#[pyclass(module = "attnstore._attnstore", frozen)]
struct Plan {
    inner: attnstore::Plan,
}

#[pymethods]
impl Plan {
    /// The plan as text, one line per request and zone (EXPLAIN).
    fn explain(&self) -> String {
        self.inner.explain()
    }

    fn __repr__(&self) -> String {
        format!("<attnstore.Plan of {} request(s)>", self.inner.requests.len())
    }

    fn __str__(&self) -> String {
        self.inner.explain()
    }
}

/// The engine's prefill or append.
type Store = fn(&attnstore::Engine, ContextId, usize, &[f32], &[f32]) -> attnstore::Result<()>;

impl Engine {
    /// The engine, or a `ClosedError` after `close`.
    fn engine(&self) -> PyResult<Arc<attnstore::Engine>> {
        let slot = self.slot.read().unwrap_or_else(|e| e.into_inner());
        slot.clone().ok_or_else(|| ClosedError::new_err("the engine is closed; open a new attnstore.Engine"))
    }

    /// The context's shape, or an `UnknownContextError`.
    fn shape(e: &attnstore::Engine, ctx: u64) -> PyResult<AttnShape> {
        e.spec(ContextId(ctx)).map(|s| s.shape).map_err(py_err)
    }

    /// Reads `k` and `v` into `keys` and `values` as the engine takes them, checked against
    /// context `ctx`'s shape.
    fn kv(
        e: &attnstore::Engine,
        ctx: u64,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
        (keys, values): (&mut Vec<f32>, &mut Vec<f32>),
    ) -> PyResult<()> {
        let shape = Self::shape(e, ctx)?;
        let layout = || format!("[kv_heads={}, tokens, head_dim={}]", shape.kv_heads, shape.head_dim);
        let want = [Some(shape.kv_heads), None, Some(shape.head_dim)];
        let ks = floats_into("k", k, keys)?;
        check_shape("k", &ks, &want, layout)?;
        let vs = floats_into("v", v, values)?;
        check_shape("v", &vs, &want, layout)?;
        if ks != vs {
            return Err(ShapeError::new_err(format!("k has shape {ks:?} but v has {vs:?}; they must match")));
        }
        Ok(())
    }

    /// `prefill` and `append`: `store` (the engine's prefill or append) of checked keys and
    /// values, with the GIL released. They are read into two of the engine's staging
    /// buffers ([`Staging`]), so a long prompt's layers after the first reuse memory
    /// already faulted in.
    fn ingest(
        &self,
        py: Python<'_>,
        ctx: u64,
        layer: usize,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
        store: Store,
    ) -> PyResult<()> {
        let e = self.engine()?;
        let (mut keys, mut values) = (self.staging.take(), self.staging.take());
        let stored = Self::kv(&e, ctx, k, v, (&mut keys, &mut values))
            .and_then(|()| py.detach(|| store(&e, ContextId(ctx), layer, &keys, &values)).map_err(py_err));
        self.staging.give(keys);
        self.staging.give(values);
        stored
    }

    /// One request per context of `ctxs` (one shape) over `layer`, the queries from `q`
    /// (`[len(ctxs), q_heads, head_dim]`), checked.
    fn batch(
        e: &attnstore::Engine,
        ctxs: &[u64],
        layer: usize,
        q: &Bound<'_, PyAny>,
    ) -> PyResult<(Vec<Request>, AttnShape)> {
        let Some(&first) = ctxs.first() else {
            return Err(PyValueError::new_err("ctxs is empty; expected at least one context id"));
        };
        let shape = Self::shape(e, first)?;
        for &c in &ctxs[1..] {
            let s = Self::shape(e, c)?;
            if s != shape {
                return Err(ShapeError::new_err(format!(
                    "context {c} has shape {s:?} but context {first} has {shape:?}; a batch needs one shape"
                )));
            }
        }
        let (query, qs) = floats("q", q)?;
        let layout = || format!("[{}, q_heads={}, head_dim={}]", ctxs.len(), shape.q_heads, shape.head_dim);
        check_shape("q", &qs, &[Some(ctxs.len()), Some(shape.q_heads), Some(shape.head_dim)], layout)?;
        if let [c] = ctxs {
            // One context (batch 1): its request takes the query as read, no second copy.
            return Ok((vec![Request::new(ContextId(*c), layer, query)], shape));
        }
        let per = shape.q_heads * shape.head_dim;
        let requests = ctxs
            .iter()
            .zip(query.chunks_exact(per))
            .map(|(&c, q)| Request::new(ContextId(c), layer, q.to_vec()))
            .collect();
        Ok((requests, shape))
    }

    /// A query checked against the context's shape.
    fn query(e: &attnstore::Engine, ctx: u64, q: &Bound<'_, PyAny>) -> PyResult<(Vec<f32>, AttnShape)> {
        let shape = Self::shape(e, ctx)?;
        let (query, qs) = floats("q", q)?;
        let layout = || format!("[q_heads={}, head_dim={}]", shape.q_heads, shape.head_dim);
        check_shape("q", &qs, &[Some(shape.q_heads), Some(shape.head_dim)], layout)?;
        Ok((query, shape))
    }
}

impl Engine {
    /// Whether a call over `q` runs in place on the GPU: a CUDA `q` on a `gpu=True` engine.
    /// `out` is only for those calls (else a `ValueError`).
    fn in_place(&self, q: &Bound<'_, PyAny>, out: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
        let cuda = self.gpu && dlpack::on_cuda(q)?;
        if out.is_some() && !cuda {
            return Err(PyValueError::new_err(
                "out= is for CUDA queries on an Engine(gpu=True) (written in place); this call returns a new array",
            ));
        }
        Ok(cuda)
    }

    /// Attention of one CUDA query per context of `ctxs` (one shape) over `layer`, read from
    /// `q` and written to `out` in place (`Engine::attend_device`): `q` is `[q_heads,
    /// head_dim]`, or `[len(ctxs), q_heads, head_dim]` when `batched`. Returns `out`.
    #[cfg(feature = "cuda")]
    #[allow(clippy::too_many_arguments, reason = "one call's arguments, as attend and attend_many take them")]
    fn attend_cuda<'py>(
        &self,
        py: Python<'py>,
        e: &Arc<attnstore::Engine>,
        ctxs: &[u64],
        layer: usize,
        q: &Bound<'py, PyAny>,
        out: Option<Bound<'py, PyAny>>,
        stream: Option<u64>,
        budget: &Budget,
        batched: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let Some(&first) = ctxs.first() else {
            return Err(PyValueError::new_err("ctxs is empty; expected at least one context id"));
        };
        let shape = Self::shape(e, first)?;
        for &c in &ctxs[1..] {
            if Self::shape(e, c)? != shape {
                return Err(ShapeError::new_err(format!("context {c}'s shape differs from context {first}'s")));
            }
        }
        let mut want = vec![shape.q_heads, shape.head_dim];
        if batched {
            want.insert(0, ctxs.len());
        }
        let qt = dlpack::cuda_tensor("q", q)?;
        if qt.shape != want {
            return Err(ShapeError::new_err(format!("q has shape {:?}; expected {want:?}", qt.shape)));
        }
        if qt.device != 0 {
            return Err(PyValueError::new_err(format!(
                "q is on CUDA device {}; attnstore runs on device 0",
                qt.device
            )));
        }
        let out = match out {
            Some(o) => o,
            None => q.call_method1("new_empty", (want.clone(),)).map_err(|_| {
                PyTypeError::new_err("q has no new_empty(shape): pass out=, a CUDA tensor of q's shape and dtype")
            })?,
        };
        let ot = dlpack::cuda_tensor("out", &out)?;
        if ot.shape != want || ot.dtype != qt.dtype || ot.device != qt.device {
            return Err(ShapeError::new_err(format!(
                "out is {:?} {:?} on CUDA device {}; expected q's: {want:?} {:?} on device {}",
                ot.dtype, ot.shape, ot.device, qt.dtype, qt.device
            )));
        }
        let stream = match stream {
            Some(s) => s,
            None => dlpack::current_stream(q, qt.device)?,
        };
        let per = (shape.q_heads * shape.head_dim * qt.dtype.size_bytes()) as u64;
        let requests: Vec<attnstore::DeviceRequest> = ctxs
            .iter()
            .enumerate()
            .map(|(i, &c)| attnstore::DeviceRequest {
                context: ContextId(c),
                layer,
                query: qt.address + i as u64 * per,
                output: ot.address + i as u64 * per,
                dtype: qt.dtype,
            })
            .collect();
        let run = py
            .detach(|| {
                // SAFETY: each request names a slice of q and out, CUDA tensors on device 0
                // of the context's shape and one dtype (checked above), alive while their
                // capsules (held by qt and ot) are, past this call.
                unsafe { e.attend_device(&requests, budget, stream) }
            })
            .map_err(py_err)?;
        self.count(&run);
        Ok(out)
    }

    /// Adds a GPU run's counts to `gpu_stats`.
    #[cfg(feature = "cuda")]
    fn count(&self, run: &attnstore::GpuRun) {
        let t = &self.gpu_totals;
        t.on_gpu.fetch_add(run.on_gpu as u64, Ordering::Relaxed);
        t.on_cpu.fetch_add(run.on_cpu as u64, Ordering::Relaxed);
        t.device_clusters.fetch_add(run.device_clusters as u64, Ordering::Relaxed);
        t.device_missed.fetch_add(run.device_missed as u64, Ordering::Relaxed);
    }

    /// Plans `requests` under `budget` and executes them (on the GPU for a `gpu=True`
    /// engine), one output per request.
    fn run(&self, e: &attnstore::Engine, requests: &[Request], budget: &Budget) -> attnstore::Result<Vec<Vec<f32>>> {
        self.execute_plan(e, &self.make_plan(e, requests, budget)?)
    }

    /// `plan_gpu` on a `gpu=True` engine, else `plan`.
    fn make_plan(
        &self,
        e: &attnstore::Engine,
        requests: &[Request],
        budget: &Budget,
    ) -> attnstore::Result<attnstore::Plan> {
        #[cfg(feature = "cuda")]
        if self.gpu {
            return e.plan_gpu(requests, budget);
        }
        e.plan(requests, budget)
    }

    /// `execute_gpu` on a `gpu=True` engine, else `execute`.
    fn execute_plan(&self, e: &attnstore::Engine, plan: &attnstore::Plan) -> attnstore::Result<Vec<Vec<f32>>> {
        #[cfg(feature = "cuda")]
        if self.gpu {
            let (out, run) = e.execute_gpu(plan)?;
            self.count(&run);
            return Ok(out);
        }
        e.execute(plan)
    }
}

/// A timeout argument in seconds, or a `ValueError` unless it is finite and at least 0.
fn seconds(timeout: f64) -> PyResult<Duration> {
    if !(timeout >= 0.0 && timeout.is_finite()) {
        return Err(PyValueError::new_err(format!("timeout {timeout} must be a finite number of seconds ≥ 0")));
    }
    Ok(Duration::from_secs_f64(timeout))
}

/// Per layer, `None` (global) or a sliding window's length (`create_context(windows=...)`).
type LayerKinds = Vec<Option<usize>>;

/// The spec `create_context` and `RemoteTier.attach` make from their keyword arguments.
#[allow(clippy::too_many_arguments, reason = "the Python signature's keyword arguments")]
fn spec_of(
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    layers: usize,
    dtype: &str,
    method: &str,
    codec: Option<&str>,
    windows: Option<LayerKinds>,
) -> PyResult<ContextSpec> {
    let shape = AttnShape::new(q_heads, kv_heads, head_dim).map_err(|e| ShapeError::new_err(e.to_string()))?;
    let dtype: DType = dtype.parse().map_err(|e| InvalidArgumentError::new_err(format!("dtype: {e}")))?;
    let method: Method = method.parse().map_err(py_err)?;
    let mut spec = ContextSpec::new(shape, layers).with_dtype(dtype).with_method(method);
    if let Some(c) = codec {
        let codecs: LayerCodecs = c.parse().map_err(|e| InvalidArgumentError::new_err(format!("codec: {e}")))?;
        spec = spec.with_layer_codecs(codecs);
    }
    if let Some(w) = windows {
        if w.len() != layers {
            return Err(InvalidArgumentError::new_err(format!(
                "windows has {} entries; expected one per layer ({layers}): None for a global layer or a window length",
                w.len()
            )));
        }
        spec = spec.with_layers(w.into_iter().map(|x| x.map_or(LayerKind::Global, LayerKind::SlidingWindow)).collect());
    }
    spec.validate().map_err(py_err)?;
    Ok(spec)
}

/// One output as a `[q_heads, head_dim]` float32 array, the engine's vector as its memory.
fn output<'py>(py: Python<'py>, out: Vec<f32>, shape: AttnShape) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let dims = (shape.q_heads, shape.head_dim);
    let array = numpy::ndarray::Array2::from_shape_vec(dims, out).map_err(|e| output_error(e, dims))?;
    Ok(array.into_pyarray(py))
}

/// An engine output of the wrong length for its array (a broken engine invariant, raised
/// rather than aborting the interpreter).
fn output_error(e: numpy::ndarray::ShapeError, dims: impl std::fmt::Debug) -> PyErr {
    AttnstoreError::new_err(format!("the engine's output does not fill an array of shape {dims:?}: {e}"))
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (path=None, host_blocks=None, gpu_blocks=None, gpu=false))]
    fn new(
        py: Python<'_>,
        path: Option<std::path::PathBuf>,
        host_blocks: Option<usize>,
        gpu_blocks: Option<usize>,
        gpu: bool,
    ) -> PyResult<Self> {
        let mut config = EngineConfig::default();
        if let Some(n) = host_blocks {
            if n == 0 {
                return Err(PyValueError::new_err("host_blocks must be at least 1"));
            }
            let mut settings = BufferSettings::new(n);
            if let Some(g) = gpu_blocks {
                settings.gpu_blocks = g;
            }
            config.buffers = Some(settings);
        } else if gpu_blocks.is_some() {
            return Err(PyValueError::new_err("gpu_blocks needs host_blocks (the Gpu tier caches the Host arena)"));
        }
        if gpu && (cfg!(not(feature = "cuda")) || config.buffers.is_none()) {
            return Err(PyValueError::new_err(if cfg!(feature = "cuda") {
                "gpu=True needs host_blocks: the GPU reads the rows the buffer manager homes in pinned host memory"
            } else {
                "gpu=True needs a build with the `cuda` feature (pip install ./python --config-settings=build-args='--features cuda')"
            }));
        }
        let inner = py
            .detach(|| match path {
                Some(p) => attnstore::Engine::open(p, config),
                None => attnstore::Engine::in_memory(config),
            })
            .map_err(py_err)?;
        Ok(Self {
            slot: RwLock::new(Some(Arc::new(inner))),
            gpu,
            gpu_totals: GpuTotals::default(),
            staging: Staging::default(),
        })
    }

    /// Creates a context and returns its id. `dtype`: f32, f16 or bf16 (how rows are
    /// stored); `method`: wave (default), pq or flat (exact only); `codec`: None (plain
    /// `dtype`), "hack2" (2-bit indexed rows, HACK's per-token keys), "hack2c" (2-bit rows
    /// with keys normalized per channel) or "kv43" (4-bit per-channel keys, 3-bit values; wave
    /// or pq; "kv43:k5" for 5-bit keys, ":v4" for 4-bit values, ":b128" for 128-token value
    /// blocks); all need dtype f16; a codec per range of layers after a comma, e.g.
    /// "kv43:256:b128,3-10=kv43:v4";
    /// `windows`: per layer, None
    /// for a global layer or the window of a sliding-window layer (exact over its last
    /// `window` tokens, nothing older kept); by default every layer is global.
    #[pyo3(signature = (q_heads, kv_heads, head_dim, layers=1, dtype="f16", method="wave", codec=None, windows=None))]
    #[allow(clippy::too_many_arguments, reason = "the Python signature: keyword arguments with defaults")]
    fn create_context(
        &self,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        layers: usize,
        dtype: &str,
        method: &str,
        codec: Option<&str>,
        windows: Option<LayerKinds>,
    ) -> PyResult<u64> {
        let spec = spec_of(q_heads, kv_heads, head_dim, layers, dtype, method, codec, windows)?;
        self.engine()?.create_context(spec).map(|id| id.0).map_err(py_err)
    }

    /// Drops a context and frees its rows.
    fn drop_context(&self, py: Python<'_>, ctx: u64) -> PyResult<()> {
        let e = self.engine()?;
        py.detach(|| e.drop_context(ContextId(ctx))).map_err(py_err)
    }

    /// Stores a layer's prompt KV: `k`, `v` of shape `[kv_heads, tokens, head_dim]`
    /// (post-RoPE keys). A layer is prefilled once; later tokens are appended. A `gpu=True`
    /// engine clusters a wave index on the GPU.
    fn prefill(
        &self,
        py: Python<'_>,
        ctx: u64,
        layer: usize,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        #[cfg(feature = "cuda")]
        if self.gpu {
            // The wave index's clustering on the GPU where it applies (else the CPU's).
            return self.ingest(py, ctx, layer, k, v, |e, id, l, k, v| e.prefill_gpu(id, l, k, v).map(|_| ()));
        }
        self.ingest(py, ctx, layer, k, v, attnstore::Engine::prefill)
    }

    /// Appends decode tokens' KV to a layer: `k`, `v` of shape `[kv_heads, tokens, head_dim]`.
    fn append(
        &self,
        py: Python<'_>,
        ctx: u64,
        layer: usize,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.ingest(py, ctx, layer, k, v, attnstore::Engine::append)
    }

    /// Waits until the layer's index is built (a PQ build runs in the background); `False`
    /// when `timeout` seconds passed first.
    #[pyo3(signature = (ctx, layer, timeout=600.0))]
    fn wait_index(&self, py: Python<'_>, ctx: u64, layer: usize, timeout: f64) -> PyResult<bool> {
        let timeout = seconds(timeout)?;
        let e = self.engine()?;
        py.detach(|| e.wait_index(ContextId(ctx), layer, timeout)).map_err(py_err)
    }

    /// Plans attention of query `q` (`[q_heads, head_dim]`) over a layer: exact, or the
    /// default sparse budget (`retrieve`: the retrieved share of tokens, e.g. 0.02).
    #[pyo3(signature = (ctx, layer, q, exact=false, retrieve=None, budget=None))]
    #[allow(clippy::too_many_arguments, reason = "the Python signature: keyword arguments with defaults")]
    fn plan(
        &self,
        py: Python<'_>,
        ctx: u64,
        layer: usize,
        q: &Bound<'_, PyAny>,
        exact: bool,
        retrieve: Option<f64>,
        budget: Option<PyRef<'_, PyBudget>>,
    ) -> PyResult<Plan> {
        let e = self.engine()?;
        let (query, _) = Self::query(&e, ctx, q)?;
        let budget = self::budget(exact, retrieve, budget.as_deref())?;
        let request = [Request::new(ContextId(ctx), layer, query)];
        let inner = py.detach(|| self.make_plan(&e, &request, &budget)).map_err(py_err)?;
        Ok(Plan { inner })
    }

    /// Executes a plan: one `[q_heads, head_dim]` float32 array per request.
    fn execute<'py>(&self, py: Python<'py>, plan: &Plan) -> PyResult<Vec<Bound<'py, PyArray2<f32>>>> {
        let e = self.engine()?;
        let outs = py.detach(|| self.execute_plan(&e, &plan.inner)).map_err(py_err)?;
        outs.into_iter().zip(&plan.inner.requests).map(|(o, r)| output(py, o, r.shape)).collect()
    }

    /// Plans and executes attention of `q` (`[q_heads, head_dim]`) over a layer in one call:
    /// exact, or the default sparse plan. Returns `[q_heads, head_dim]` float32 — or, on a
    /// `gpu=True` engine with a CUDA `q`, the CUDA tensor `out` (`q`'s shape, dtype and
    /// device; made with `q.new_empty` when not given), `q` read and `out` written in place
    /// after the work queued on `stream` (torch's current stream when not given).
    #[pyo3(signature = (ctx, layer, q, exact=false, retrieve=None, budget=None, out=None, stream=None))]
    #[allow(clippy::too_many_arguments, reason = "the Python signature: keyword arguments with defaults")]
    fn attend<'py>(
        &self,
        py: Python<'py>,
        ctx: u64,
        layer: usize,
        q: &Bound<'py, PyAny>,
        exact: bool,
        retrieve: Option<f64>,
        budget: Option<PyRef<'_, PyBudget>>,
        out: Option<Bound<'py, PyAny>>,
        #[cfg_attr(not(feature = "cuda"), allow(unused_variables, reason = "CUDA calls only"))] stream: Option<u64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let e = self.engine()?;
        let budget = self::budget(exact, retrieve, budget.as_deref())?;
        // Only a `cuda` build's engine runs on the GPU (in_place is false, or an error, else).
        if self.in_place(q, out.as_ref())? {
            #[cfg(feature = "cuda")]
            return self.attend_cuda(py, &e, &[ctx], layer, q, out, stream, &budget, false);
        }
        let (query, shape) = Self::query(&e, ctx, q)?;
        let request = [Request::new(ContextId(ctx), layer, query)];
        let mut outs = py.detach(|| self.run(&e, &request, &budget)).map_err(py_err)?;
        Ok(output(py, outs.remove(0), shape)?.into_any())
    }

    /// Attention of one query per context over the same layer of each, planned and executed
    /// as one batch (a decode step of a batch of sequences): `q` is `[len(ctxs), q_heads,
    /// head_dim]`, the contexts share their shape; returns `[len(ctxs), q_heads, head_dim]`
    /// float32 — or, on a `gpu=True` engine with a CUDA `q`, the CUDA tensor `out`, in place
    /// as [`Engine::attend`] does.
    #[pyo3(signature = (ctxs, layer, q, exact=false, retrieve=None, budget=None, out=None, stream=None))]
    #[allow(clippy::too_many_arguments, reason = "the Python signature: keyword arguments with defaults")]
    fn attend_many<'py>(
        &self,
        py: Python<'py>,
        ctxs: Vec<u64>,
        layer: usize,
        q: &Bound<'py, PyAny>,
        exact: bool,
        retrieve: Option<f64>,
        budget: Option<PyRef<'_, PyBudget>>,
        out: Option<Bound<'py, PyAny>>,
        #[cfg_attr(not(feature = "cuda"), allow(unused_variables, reason = "CUDA calls only"))] stream: Option<u64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let e = self.engine()?;
        let budget = self::budget(exact, retrieve, budget.as_deref())?;
        // Only a `cuda` build's engine runs on the GPU (in_place is false, or an error, else).
        if self.in_place(q, out.as_ref())? {
            #[cfg(feature = "cuda")]
            return self.attend_cuda(py, &e, &ctxs, layer, q, out, stream, &budget, true);
        }
        let (requests, shape) = Self::batch(&e, &ctxs, layer, q)?;
        let mut outs = py.detach(|| self.run(&e, &requests, &budget)).map_err(py_err)?;
        // One context's output becomes the array as it is; several are laid end to end.
        let flat = if outs.len() == 1 { outs.remove(0) } else { outs.concat() };
        let dims = (ctxs.len(), shape.q_heads, shape.head_dim);
        let array = numpy::ndarray::Array3::from_shape_vec(dims, flat).map_err(|e| output_error(e, dims))?;
        Ok(array.into_pyarray(py).into_any())
    }

    /// Times `iters` calls of the step `attend_many` runs (plan and execute, on the GPU for a
    /// `gpu=True` engine) inside Rust, with no Python in between: seconds per call. The
    /// baseline of the Python overhead (`python/examples/overhead.py`): the same step timed
    /// around `attend_many` from Python, minus this, is what the boundary adds.
    #[pyo3(signature = (ctxs, layer, q, iters, exact=false, budget=None))]
    #[allow(clippy::too_many_arguments, reason = "the Python signature: keyword arguments with defaults")]
    fn time_steps(
        &self,
        py: Python<'_>,
        ctxs: Vec<u64>,
        layer: usize,
        q: &Bound<'_, PyAny>,
        iters: usize,
        exact: bool,
        budget: Option<PyRef<'_, PyBudget>>,
    ) -> PyResult<Vec<f64>> {
        let e = self.engine()?;
        let (requests, _) = Self::batch(&e, &ctxs, layer, q)?;
        let budget = self::budget(exact, None, budget.as_deref())?;
        py.detach(|| {
            (0..iters)
                .map(|_| {
                    let start = std::time::Instant::now();
                    let out = self.run(&e, &requests, &budget)?;
                    std::hint::black_box(out);
                    Ok(start.elapsed().as_secs_f64())
                })
                .collect::<attnstore::Result<Vec<f64>>>()
        })
        .map_err(py_err)
    }

    /// The buffer manager's counters (`None` without `host_blocks`): `block_bytes`, and per
    /// tier (`gpu`, `host`, `disk`) its capacity and used blocks, hits, misses, blocks moved
    /// in, evictions and failures.
    fn buffer_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(stats) = self.engine()?.buffer_stats() else { return Ok(None) };
        let out = PyDict::new(py);
        out.set_item("block_bytes", stats.block_bytes)?;
        out.set_item("dropped_access_records", stats.dropped_access_records)?;
        for t in &stats.tiers {
            let tier = PyDict::new(py);
            tier.set_item("capacity_blocks", t.capacity_blocks)?;
            tier.set_item("used_blocks", t.used_blocks)?;
            tier.set_item("hits", t.hits)?;
            tier.set_item("misses", t.misses)?;
            tier.set_item("moves_in", t.moves_in)?;
            tier.set_item("evictions", t.evictions)?;
            tier.set_item("failures", t.failures)?;
            out.set_item(format!("{:?}", t.tier).to_lowercase(), tier)?;
        }
        Ok(Some(out))
    }

    /// What the GPU executor did, summed over this engine's calls: requests run on the GPU
    /// and on the CPU, clusters the device-selected steps retrieved and, of those, the ones
    /// read from the Host arena rather than the Gpu tier (`1 - device_missed /
    /// device_clusters` is the steps' hit ratio by cluster). Zeros on a CPU engine.
    fn gpu_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = &self.gpu_totals;
        let out = PyDict::new(py);
        out.set_item("on_gpu", t.on_gpu.load(Ordering::Relaxed))?;
        out.set_item("on_cpu", t.on_cpu.load(Ordering::Relaxed))?;
        out.set_item("device_clusters", t.device_clusters.load(Ordering::Relaxed))?;
        out.set_item("device_missed", t.device_missed.load(Ordering::Relaxed))?;
        Ok(out)
    }

    /// Closes the engine: later calls raise `ClosedError`. A durable engine's log is flushed
    /// and its directory released once calls still running on other threads return, so the
    /// same path can be opened again. Closing twice is fine. `with attnstore.Engine(...) as
    /// eng:` closes it at the end of the block.
    fn close(&self, py: Python<'_>) {
        let taken = self.slot.write().unwrap_or_else(|e| e.into_inner()).take();
        self.staging.release();
        // Dropping the last reference joins the engine's threads and flushes: without the GIL.
        py.detach(move || drop(taken));
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.slot.read().unwrap_or_else(|e| e.into_inner()).is_none()
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    /// Whether this engine runs its steps on the GPU (`gpu=True`, a `cuda` build).
    #[getter]
    fn gpu(&self) -> bool {
        self.gpu
    }

    /// Tokens stored in a layer.
    fn tokens(&self, ctx: u64, layer: usize) -> PyResult<usize> {
        self.engine()?.stats(ContextId(ctx), layer).map(|s| s.tokens).map_err(py_err)
    }

    /// Writes a checkpoint (durable engines): later opens replay less of the log.
    fn checkpoint(&self, py: Python<'_>) -> PyResult<()> {
        let e = self.engine()?;
        py.detach(|| e.checkpoint()).map(|_| ()).map_err(py_err)
    }

    /// The ids of the engine's contexts.
    fn contexts(&self) -> PyResult<Vec<u64>> {
        Ok(self.engine()?.contexts().into_iter().map(|id| id.0).collect())
    }
}

/// The extension module `attnstore._attnstore` (re-exported by the `attnstore` package).
#[pymodule]
fn _attnstore(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Engine>()?;
    m.add_class::<Plan>()?;
    m.add_class::<PyBudget>()?;
    m.add("AttnstoreError", py.get_type::<AttnstoreError>())?;
    m.add("ShapeError", py.get_type::<ShapeError>())?;
    m.add("UnknownContextError", py.get_type::<UnknownContextError>())?;
    m.add("InvalidArgumentError", py.get_type::<InvalidArgumentError>())?;
    m.add("CorruptDataError", py.get_type::<CorruptDataError>())?;
    m.add("StorageError", py.get_type::<StorageError>())?;
    m.add("StalePlanError", py.get_type::<StalePlanError>())?;
    m.add("ClosedError", py.get_type::<ClosedError>())?;
    remote::add(m)
}
