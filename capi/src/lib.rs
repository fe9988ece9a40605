//! The C ABI of attnstore (`include/attnstore.h`): an opaque engine handle, contexts by id,
//! prefill / append / attend / explain over host pointers. Every function returns an
//! [`AttnstoreStatus`]; on failure [`attnstore_last_error`] gives the message (per thread,
//! valid until the thread's next call). A null pointer where one is required is
//! `ATTNSTORE_STATUS_NULL_ARGUMENT`; a Rust panic is caught and returned as
//! `ATTNSTORE_STATUS_PANIC`,
//! never unwound into C.
//!
//! Array layouts are the engine's: keys and values `kv_heads × tokens × head_dim` f32,
//! queries and outputs `q_heads × head_dim` f32, each with its element count so that a
//! wrong size is an `ATTNSTORE_STATUS_SHAPE` error rather than a read past the buffer.
//!
//! The unsafe code is confined to turning the caller's pointers into slices and strings
//! ([`slice`], [`slice_mut`], [`c_str`]) and the handle into a reference ([`engine`]);
//! each states what the caller promises in the header's docs.

#![allow(unsafe_code, reason = "a C ABI: raw pointers from the caller, each checked and documented")]

use attnstore::{
    AttnShape, Budget, BufferSettings, ContextId, ContextSpec, DType, Engine, EngineConfig, Method, Request,
};
use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The outcome of a call.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnstoreStatus {
    /// Success.
    Ok = 0,
    /// An array of the wrong size or shape, or NaN/Inf in it.
    Shape = 1,
    /// No such context or layer.
    UnknownContext = 2,
    /// A bad budget, spec or argument (e.g. a second prefill of a layer, an unknown dtype).
    InvalidArgument = 3,
    /// Stored data failed its checks.
    Corrupt = 4,
    /// The buffer manager, disk or log failed or is full.
    Storage = 5,
    /// A layer changed since its plan was made.
    StalePlan = 6,
    /// Any other engine error.
    Other = 7,
    /// A required pointer was null, or a string was not UTF-8.
    NullArgument = 8,
    /// attnstore panicked (a bug); the engine may be unusable.
    Panic = 9,
    /// The output buffer is too small (`attnstore_explain`: see its `needed`).
    BufferTooSmall = 10,
}

/// An attnstore engine (opaque).
pub struct AttnstoreEngine {
    inner: Engine,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `message` as this thread's last error and returns `status`.
fn fail(status: AttnstoreStatus, message: impl Into<String>) -> AttnstoreStatus {
    let text = message.into().replace('\0', " ");
    LAST_ERROR.with(|e| *e.borrow_mut() = CString::new(text).unwrap_or_default());
    status
}

/// The status of an engine error, recorded as the last error.
fn engine_error(e: attnstore::Error) -> AttnstoreStatus {
    use attnstore::ErrorKind as K;
    let status = match e.kind() {
        K::Shape => AttnstoreStatus::Shape,
        K::UnknownContext => AttnstoreStatus::UnknownContext,
        K::InvalidArgument => AttnstoreStatus::InvalidArgument,
        K::StalePlan => AttnstoreStatus::StalePlan,
        K::Corrupt => AttnstoreStatus::Corrupt,
        K::Storage => AttnstoreStatus::Storage,
        K::Other => AttnstoreStatus::Other,
    };
    fail(status, e.to_string())
}

/// Runs `f`, turning a panic into `ATTNSTORE_STATUS_PANIC` and clearing the last error first.
fn guarded(f: impl FnOnce() -> AttnstoreStatus) -> AttnstoreStatus {
    LAST_ERROR.with(|e| *e.borrow_mut() = CString::default());
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(status) => status,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            fail(AttnstoreStatus::Panic, format!("attnstore panicked: {what}"))
        }
    }
}

/// `len` f32 elements at `ptr` as a slice; `None` for a null pointer (an empty array may be null).
fn slice<'a>(ptr: *const f32, len: usize) -> Option<&'a [f32]> {
    if len == 0 {
        return Some(&[]);
    }
    if ptr.is_null() {
        return None;
    }
    // SAFETY: the header requires `ptr` to point at `len` readable, initialized, aligned f32
    // values that stay valid and unmodified for the call; null was refused above.
    Some(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// `len` writable f32 elements at `ptr`; `None` for a null pointer.
fn slice_mut<'a>(ptr: *mut f32, len: usize) -> Option<&'a mut [f32]> {
    if len == 0 {
        return Some(&mut []);
    }
    if ptr.is_null() {
        return None;
    }
    // SAFETY: the header requires `ptr` to point at `len` writable, aligned f32 values that
    // nothing else reads or writes during the call; null was refused above.
    Some(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
}

/// A NUL-terminated UTF-8 string; `None` for null or non-UTF-8.
fn c_str<'a>(ptr: *const c_char) -> Option<&'a str> {
    if ptr.is_null() {
        return None;
    }
    // SAFETY: the header requires a NUL-terminated string valid for the call; null was
    // refused above.
    unsafe { CStr::from_ptr(ptr) }.to_str().ok()
}

/// The engine behind a handle; `None` for null.
fn engine<'a>(handle: *const AttnstoreEngine) -> Option<&'a Engine> {
    // SAFETY: a non-null handle comes from `attnstore_engine_open` and has not been passed
    // to `attnstore_engine_free` (the header's contract); the engine is Sync, so shared
    // references from several threads are sound.
    unsafe { handle.as_ref() }.map(|e| &e.inner)
}

/// Opens an engine: in memory when `path` is null, else durable in the directory `path`
/// (created if missing; reopened with its contexts otherwise). Writes the handle to `*out`.
///
/// # Safety
/// `path` is null or a NUL-terminated UTF-8 string; `out` points at writable storage for a
/// pointer.
#[no_mangle]
pub unsafe extern "C" fn attnstore_engine_open(path: *const c_char, out: *mut *mut AttnstoreEngine) -> AttnstoreStatus {
    guarded(|| open_with(path, EngineConfig::default(), out))
}

/// Opens an engine like `attnstore_engine_open` whose rows are homed by a buffer manager
/// over `host_blocks` blocks of pinned host memory (at least 1), `gpu_blocks` of them cached
/// on the GPU (0: none) — what GPU steps (`attnstore_attend_device`) read.
///
/// # Safety
/// As `attnstore_engine_open`.
#[no_mangle]
pub unsafe extern "C" fn attnstore_engine_open_buffered(
    path: *const c_char,
    host_blocks: usize,
    gpu_blocks: usize,
    out: *mut *mut AttnstoreEngine,
) -> AttnstoreStatus {
    guarded(|| {
        if host_blocks == 0 {
            return fail(AttnstoreStatus::InvalidArgument, "host_blocks must be at least 1");
        }
        let mut settings = BufferSettings::new(host_blocks);
        settings.gpu_blocks = gpu_blocks;
        let config = EngineConfig { buffers: Some(settings), ..EngineConfig::default() };
        open_with(path, config, out)
    })
}

/// Opens an engine under `config`, in memory (null `path`) or durable at `path`, and writes
/// its handle to `*out`.
fn open_with(path: *const c_char, config: EngineConfig, out: *mut *mut AttnstoreEngine) -> AttnstoreStatus {
    if out.is_null() {
        return fail(AttnstoreStatus::NullArgument, "out is null");
    }
    let opened = if path.is_null() {
        Engine::in_memory(config)
    } else {
        match c_str(path) {
            Some(p) => Engine::open(p, config),
            None => return fail(AttnstoreStatus::NullArgument, "path is not UTF-8"),
        }
    };
    match opened {
        Ok(inner) => {
            let handle = Box::into_raw(Box::new(AttnstoreEngine { inner }));
            // SAFETY: `out` is non-null and writable (the caller's contract).
            unsafe { out.write(handle) };
            AttnstoreStatus::Ok
        }
        Err(e) => engine_error(e),
    }
}

/// Closes an engine and frees its handle (null is a no-op). A durable engine's committed
/// data is already on disk.
///
/// # Safety
/// `engine` is null or a handle from `attnstore_engine_open` not freed before; no other
/// thread uses it during or after this call.
#[no_mangle]
pub unsafe extern "C" fn attnstore_engine_free(engine: *mut AttnstoreEngine) {
    if engine.is_null() {
        return;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the handle came from `Box::into_raw` in `attnstore_engine_open` and is
        // freed once (the caller's contract).
        drop(unsafe { Box::from_raw(engine) });
    }));
}

/// Creates a context of `layers` layers and writes its id to `*out`. `dtype`: "f32", "f16"
/// or "bf16" (how rows are stored); `method`: "wave", "pq" or "flat".
///
/// # Safety
/// `engine` is a live handle; `dtype` and `method` are NUL-terminated strings; `out` is
/// writable.
#[no_mangle]
pub unsafe extern "C" fn attnstore_context_create(
    engine: *const AttnstoreEngine,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    layers: usize,
    dtype: *const c_char,
    method: *const c_char,
    out: *mut u64,
) -> AttnstoreStatus {
    guarded(|| {
        let (Some(e), Some(dtype), Some(method), false) =
            (self::engine(engine), c_str(dtype), c_str(method), out.is_null())
        else {
            return fail(
                AttnstoreStatus::NullArgument,
                "engine, dtype, method and out must be non-null (UTF-8 strings)",
            );
        };
        let shape = match AttnShape::new(q_heads, kv_heads, head_dim) {
            Ok(s) => s,
            Err(err) => return fail(AttnstoreStatus::Shape, err.to_string()),
        };
        let dtype: DType = match dtype.parse() {
            Ok(d) => d,
            Err(err) => return fail(AttnstoreStatus::InvalidArgument, format!("dtype: {err}")),
        };
        let method: Method = match method.parse() {
            Ok(m) => m,
            Err(err) => return engine_error(err),
        };
        match e.create_context(ContextSpec::new(shape, layers).with_dtype(dtype).with_method(method)) {
            Ok(id) => {
                // SAFETY: `out` is non-null and writable (checked above; the caller's contract).
                unsafe { out.write(id.0) };
                AttnstoreStatus::Ok
            }
            Err(err) => engine_error(err),
        }
    })
}

/// Keys and values of `tokens` tokens for `ctx`, checked against its shape.
fn kv<'a>(
    e: &Engine,
    ctx: u64,
    k: *const f32,
    v: *const f32,
    tokens: usize,
) -> Result<(&'a [f32], &'a [f32]), AttnstoreStatus> {
    let shape = e.spec(ContextId(ctx)).map_err(engine_error)?.shape;
    let len = shape.kv_len(tokens);
    match (slice(k, len), slice(v, len)) {
        (Some(k), Some(v)) => Ok((k, v)),
        _ => Err(fail(AttnstoreStatus::NullArgument, "k and v must be non-null")),
    }
}

/// The engine's prefill or append.
type Store = fn(&Engine, ContextId, usize, &[f32], &[f32]) -> attnstore::Result<()>;

/// `attnstore_prefill` and `attnstore_append`: `store` (the engine's prefill or append) of
/// `tokens` tokens' keys and values checked against the context's shape.
fn ingest(
    engine: *const AttnstoreEngine,
    ctx: u64,
    layer: usize,
    k: *const f32,
    v: *const f32,
    tokens: usize,
    store: Store,
) -> AttnstoreStatus {
    guarded(|| {
        let Some(e) = self::engine(engine) else { return fail(AttnstoreStatus::NullArgument, "engine is null") };
        match kv(e, ctx, k, v, tokens) {
            Ok((k, v)) => store(e, ContextId(ctx), layer, k, v).map_or_else(engine_error, |()| AttnstoreStatus::Ok),
            Err(status) => status,
        }
    })
}

/// Stores a layer's prompt KV: `k` and `v` hold `kv_heads × tokens × head_dim` f32 each
/// (post-RoPE keys). A layer is prefilled once.
///
/// # Safety
/// `engine` is a live handle; `k` and `v` each point at `kv_heads × tokens × head_dim`
/// readable f32 values.
#[no_mangle]
pub unsafe extern "C" fn attnstore_prefill(
    engine: *const AttnstoreEngine,
    ctx: u64,
    layer: usize,
    k: *const f32,
    v: *const f32,
    tokens: usize,
) -> AttnstoreStatus {
    ingest(engine, ctx, layer, k, v, tokens, Engine::prefill)
}

/// Appends decode tokens' KV to a layer (layout as `attnstore_prefill`).
///
/// # Safety
/// As `attnstore_prefill`.
#[no_mangle]
pub unsafe extern "C" fn attnstore_append(
    engine: *const AttnstoreEngine,
    ctx: u64,
    layer: usize,
    k: *const f32,
    v: *const f32,
    tokens: usize,
) -> AttnstoreStatus {
    ingest(engine, ctx, layer, k, v, tokens, Engine::append)
}

/// The plan of one query over a layer: exact when `exact` is non-zero, else the default
/// sparse budget.
fn plan_one(
    e: &Engine,
    ctx: u64,
    layer: usize,
    q: *const f32,
    q_len: usize,
    exact: i32,
) -> Result<attnstore::Plan, AttnstoreStatus> {
    let Some(q) = slice(q, q_len) else { return Err(fail(AttnstoreStatus::NullArgument, "q is null")) };
    let budget = if exact != 0 { Budget::full() } else { Budget::default() };
    e.plan(&[Request::new(ContextId(ctx), layer, q.to_vec())], &budget).map_err(engine_error)
}

/// Attention of query `q` (`q_len` = `q_heads × head_dim` f32) over a layer, written to
/// `out` (`out_len` = `q_heads × head_dim` f32): exact when `exact` is non-zero, else the
/// default sparse plan.
///
/// # Safety
/// `engine` is a live handle; `q` points at `q_len` readable f32; `out` at `out_len`
/// writable f32 not aliasing `q`.
#[no_mangle]
pub unsafe extern "C" fn attnstore_attend(
    engine: *const AttnstoreEngine,
    ctx: u64,
    layer: usize,
    q: *const f32,
    q_len: usize,
    exact: i32,
    out: *mut f32,
    out_len: usize,
) -> AttnstoreStatus {
    guarded(|| {
        let Some(e) = self::engine(engine) else { return fail(AttnstoreStatus::NullArgument, "engine is null") };
        let plan = match plan_one(e, ctx, layer, q, q_len, exact) {
            Ok(p) => p,
            Err(status) => return status,
        };
        let mut outputs = match e.execute(&plan) {
            Ok(o) => o,
            Err(err) => return engine_error(err),
        };
        let got = outputs.remove(0);
        if got.len() != out_len {
            return fail(
                AttnstoreStatus::Shape,
                format!("out holds {out_len} floats; the output has {} (q_heads × head_dim)", got.len()),
            );
        }
        let Some(out) = slice_mut(out, out_len) else { return fail(AttnstoreStatus::NullArgument, "out is null") };
        out.copy_from_slice(&got);
        AttnstoreStatus::Ok
    })
}

/// Element type of a query and output in device memory (`attnstore_attend_device`).
#[cfg(feature = "cuda")]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnstoreElement {
    /// 32-bit floats.
    F32 = 0,
    /// IEEE half precision.
    F16 = 1,
    /// bfloat16.
    Bf16 = 2,
}

/// Attention of a query in GPU memory over a layer, written to GPU memory (GPU 0, the
/// device's primary context, e.g. a CUDA runtime's or torch's): `q` and `out` hold
/// `q_heads × head_dim` C-contiguous elements of type `dtype` (an `AttnstoreElement`
/// value); exact when `exact` is non-zero, else the default sparse plan, which runs
/// entirely on the GPU when the engine homes the layer's rows (`attnstore_engine_open_buffered`).
/// The query is read after the work queued on `stream` (a `CUstream`; null for the legacy
/// default stream) so far; the output is written when this returns. A non-finite query
/// element is `ATTNSTORE_STATUS_SHAPE` and leaves `out` as it was.
///
/// # Safety
/// `engine` is a live handle; `q` is the device address of `q_heads × head_dim` readable
/// elements of `dtype` and `out` of as many writable ones, valid for the call; `stream` is
/// null or a stream of the primary context of GPU 0.
#[cfg(feature = "cuda")]
#[no_mangle]
#[allow(clippy::too_many_arguments, reason = "a C signature: the call's arguments, flat")]
pub unsafe extern "C" fn attnstore_attend_device(
    engine: *const AttnstoreEngine,
    ctx: u64,
    layer: usize,
    q: *const std::ffi::c_void,
    out: *mut std::ffi::c_void,
    dtype: i32,
    exact: i32,
    stream: *mut std::ffi::c_void,
) -> AttnstoreStatus {
    guarded(|| {
        let Some(e) = self::engine(engine) else { return fail(AttnstoreStatus::NullArgument, "engine is null") };
        if q.is_null() || out.is_null() {
            return fail(AttnstoreStatus::NullArgument, "q and out must be non-null device addresses");
        }
        let dtype = match dtype {
            0 => attnstore::IoDType::F32,
            1 => attnstore::IoDType::F16,
            2 => attnstore::IoDType::Bf16,
            other => {
                return fail(
                    AttnstoreStatus::InvalidArgument,
                    format!("dtype {other}: expected 0 (f32), 1 (f16) or 2 (bf16), an AttnstoreElement"),
                )
            }
        };
        let budget = if exact != 0 { Budget::full() } else { Budget::default() };
        let request =
            attnstore::DeviceRequest { context: ContextId(ctx), layer, query: q as u64, output: out as u64, dtype };
        // SAFETY: `q` and `out` name device tensors of the context's shape and `dtype`, and
        // `stream` a stream of the primary context (the caller's contract).
        match unsafe { e.attend_device(&[request], &budget, stream as u64) } {
            Ok(_) => AttnstoreStatus::Ok,
            Err(err) => engine_error(err),
        }
    })
}

/// EXPLAIN of the plan `attnstore_attend` would run, as a NUL-terminated string in `buf`
/// (`buf_len` bytes). `*needed` (when non-null) gets the bytes the text needs with its NUL;
/// a `buf` too small (or null) returns `ATTNSTORE_STATUS_BUFFER_TOO_SMALL` and writes nothing.
///
/// # Safety
/// `engine` is a live handle; `q` points at `q_len` readable f32; `buf` is null or points at
/// `buf_len` writable bytes; `needed` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn attnstore_explain(
    engine: *const AttnstoreEngine,
    ctx: u64,
    layer: usize,
    q: *const f32,
    q_len: usize,
    exact: i32,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> AttnstoreStatus {
    guarded(|| {
        let Some(e) = self::engine(engine) else { return fail(AttnstoreStatus::NullArgument, "engine is null") };
        let plan = match plan_one(e, ctx, layer, q, q_len, exact) {
            Ok(p) => p,
            Err(status) => return status,
        };
        let text = plan.explain();
        let size = text.len() + 1;
        if !needed.is_null() {
            // SAFETY: `needed` is non-null and writable (the caller's contract).
            unsafe { needed.write(size) };
        }
        if buf.is_null() || buf_len < size {
            return fail(
                AttnstoreStatus::BufferTooSmall,
                format!("the explanation needs {size} bytes; buf holds {buf_len}"),
            );
        }
        // SAFETY: `buf` points at `buf_len ≥ size` writable bytes (checked above; the
        // caller's contract) and does not overlap `text`, which this function owns.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), text.len());
            buf.add(text.len()).write(0);
        }
        AttnstoreStatus::Ok
    })
}

/// The message of this thread's last failed call ("" after a success), valid until the
/// thread's next attnstore call.
#[no_mangle]
pub extern "C" fn attnstore_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        // SAFETY: the pointer is this thread's last-error string, valid until the next call.
        unsafe { CStr::from_ptr(attnstore_last_error()) }.to_string_lossy().into_owned()
    }

    /// The pointer helpers alone (no engine, no threads): runs under miri.
    #[test]
    fn pointer_helpers_refuse_null_and_read_exactly_what_they_are_given() {
        let data = [1.0f32, 2.0, 3.0];
        assert_eq!(slice(data.as_ptr(), 3), Some(&data[..]));
        assert_eq!(slice(std::ptr::null(), 3), None);
        assert_eq!(slice(std::ptr::null(), 0), Some(&[][..]), "an empty array may be null");
        let mut out = [0f32; 2];
        slice_mut(out.as_mut_ptr(), 2).unwrap().copy_from_slice(&data[..2]);
        assert_eq!(out, [1.0, 2.0]);
        assert!(slice_mut(std::ptr::null_mut(), 1).is_none());
        assert_eq!(c_str(c"wave".as_ptr()), Some("wave"));
        assert_eq!(c_str(std::ptr::null()), None);
        let bad = [0xffu8 as c_char, 0];
        assert_eq!(c_str(bad.as_ptr()), None, "not UTF-8");
        assert!(engine(std::ptr::null()).is_none());
        assert_eq!(fail(AttnstoreStatus::Shape, "a\0b"), AttnstoreStatus::Shape);
        // SAFETY: the last-error pointer is valid until this thread's next call.
        assert_eq!(unsafe { CStr::from_ptr(attnstore_last_error()) }.to_str().unwrap(), "a b");
    }

    #[test]
    fn rust_side_round_trip_and_typed_failures() {
        let mut handle = std::ptr::null_mut();
        // SAFETY: valid arguments per the documented contracts throughout.
        unsafe {
            assert_eq!(attnstore_engine_open(std::ptr::null(), &mut handle), AttnstoreStatus::Ok);
            let mut ctx = 0u64;
            let f32s = c"f32".as_ptr();
            let flat = c"flat".as_ptr();
            assert_eq!(attnstore_context_create(handle, 4, 2, 8, 1, f32s, flat, &mut ctx), AttnstoreStatus::Ok);
            let tokens = 10;
            let k: Vec<f32> = (0..2 * tokens * 8).map(|i| (i % 7) as f32 * 0.1).collect();
            let v: Vec<f32> = (0..2 * tokens * 8).map(|i| (i % 5) as f32).collect();
            assert_eq!(attnstore_prefill(handle, ctx, 0, k.as_ptr(), v.as_ptr(), tokens), AttnstoreStatus::Ok);
            let q = [0.5f32; 4 * 8];
            let mut out = vec![0f32; 4 * 8];
            let s = attnstore_attend(handle, ctx, 0, q.as_ptr(), q.len(), 1, out.as_mut_ptr(), out.len());
            assert_eq!(s, AttnstoreStatus::Ok, "{}", last_error());
            assert!(out.iter().all(|x| x.is_finite()) && out.iter().any(|&x| x != 0.0));
            // Wrong sizes, unknown contexts, nulls, bad strings: typed, with a message.
            let s = attnstore_attend(handle, ctx, 0, q.as_ptr(), 3, 1, out.as_mut_ptr(), out.len());
            assert_eq!(s, AttnstoreStatus::Shape);
            assert!(!last_error().is_empty());
            let s = attnstore_attend(handle, ctx + 9, 0, q.as_ptr(), q.len(), 1, out.as_mut_ptr(), out.len());
            assert_eq!(s, AttnstoreStatus::UnknownContext, "{}", last_error());
            let s = attnstore_attend(handle, ctx, 0, q.as_ptr(), q.len(), 1, out.as_mut_ptr(), 5);
            assert_eq!(s, AttnstoreStatus::Shape, "{}", last_error());
            assert_eq!(
                attnstore_prefill(std::ptr::null(), ctx, 0, k.as_ptr(), v.as_ptr(), tokens),
                AttnstoreStatus::NullArgument
            );
            let btree = c"btree".as_ptr();
            assert_eq!(
                attnstore_context_create(handle, 4, 2, 8, 1, f32s, btree, &mut ctx),
                AttnstoreStatus::InvalidArgument
            );
            assert!(last_error().contains("btree"));
            let mut needed = 0usize;
            let s = attnstore_explain(handle, ctx, 0, q.as_ptr(), q.len(), 1, std::ptr::null_mut(), 0, &mut needed);
            assert_eq!(s, AttnstoreStatus::BufferTooSmall);
            let mut buf = vec![0 as c_char; needed];
            let s = attnstore_explain(handle, ctx, 0, q.as_ptr(), q.len(), 1, buf.as_mut_ptr(), buf.len(), &mut needed);
            assert_eq!(s, AttnstoreStatus::Ok);
            assert!(CStr::from_ptr(buf.as_ptr()).to_str().unwrap().starts_with("EXPLAIN"));
            attnstore_engine_free(handle);
        }
    }
}
