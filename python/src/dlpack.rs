//! Tensors through DLPack (`__dlpack__`, e.g. torch or JAX tensors): a CPU tensor of
//! float32, float16, bfloat16 or float64, contiguous or strided, read as f32. The capsule is
//! not consumed: the producer's destructor frees the tensor when the capsule goes, after the
//! copy. A tensor on a device (CUDA) is copied to host memory by its producer, on request
//! (`__dlpack__(dl_device=(1, 0), copy=True)`), ordered after the work queued on its stream —
//! except on a GPU engine, whose steps read CUDA queries and write CUDA outputs in place
//! ([`cuda_tensor`]). A plain torch CPU tensor skips torch's Python-level `Tensor.__dlpack__`
//! (microseconds a call, most of what a torch query added to a decode step) for the C
//! function behind it ([`torch_capsule`]).

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCapsule, PyCapsuleMethods, PyType};
use std::ffi::c_void;

/// DLPack's `DLDevice`.
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// DLPack's `DLDataType`.
#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// DLPack's `DLTensor`, the first field of the `DLManagedTensor` a "dltensor" capsule holds.
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

const CPU: i32 = 1;
/// DLPack's `kDLCUDA`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "CUDA tensors are read in place by the cuda build"))]
const CUDA: i32 = 2;

/// The DLTensor in a `__dlpack__` capsule, borrowed for as long as the capsule.
fn tensor<'a>(what: &str, capsule: &'a Bound<'_, PyAny>) -> PyResult<&'a DlTensor> {
    let capsule = capsule
        .cast::<PyCapsule>()
        .map_err(|_| PyTypeError::new_err(format!("{what}.__dlpack__() did not return a capsule")))?;
    let ptr = capsule.pointer_checked(Some(c"dltensor"))?;
    // SAFETY: a capsule named "dltensor" holds a DLManagedTensor (DLPack's protocol), whose
    // first field is the DLTensor; it stays valid while the capsule lives, and the returned
    // borrow cannot outlive `capsule` (nothing here consumes or renames it).
    Ok(unsafe { &*ptr.as_ptr().cast::<DlTensor>() })
}

/// The element types read, and how one becomes an f32.
#[derive(Clone, Copy)]
enum Kind {
    F32,
    F16,
    Bf16,
    F64,
}

/// `torch.Tensor` and `torch.utils.dlpack.to_dlpack`, looked up once torch is imported.
static TORCH: PyOnceLock<(Py<PyType>, Py<PyAny>)> = PyOnceLock::new();

/// `torch.utils.dlpack.to_dlpack` when `obj` is a plain `torch.Tensor`: not a subclass,
/// whose `__torch_function__` may override `__dlpack__` and the rest. Nothing is imported:
/// torch is, if `obj` is one of its tensors.
fn plain_torch<'a>(obj: &Bound<'a, PyAny>) -> PyResult<Option<&'a Bound<'a, PyAny>>> {
    let py = obj.py();
    let ty = obj.get_type();
    let (tensor_type, to_dlpack) = match TORCH.get(py) {
        Some(t) => t,
        None if ty.module().is_ok_and(|m| m == "torch") => TORCH.get_or_try_init(py, || {
            let torch = py.import("torch")?;
            let to_dlpack = torch.getattr("utils")?.getattr("dlpack")?.getattr("to_dlpack")?;
            PyResult::Ok((torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind(), to_dlpack.unbind()))
        })?,
        None => return Ok(None),
    };
    Ok(ty.is(tensor_type.bind(py)).then(|| to_dlpack.bind(py)))
}

/// A capsule of `obj` made by `torch.utils.dlpack.to_dlpack` (the C function behind
/// `Tensor.__dlpack__`, a fraction of a microsecond) for a plain torch tensor that does not
/// require grad, when the capsule is a CPU tensor of a dtype read here; `None` sends `obj`
/// the generic way (`__dlpack__`), so whatever `Tensor.__dlpack__` refuses (requires grad,
/// the conjugate bit, a sparse layout, ...) still raises its own error.
fn torch_capsule<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
    let Some(capsule) = plain_capsule(obj)? else { return Ok(None) };
    let readable =
        tensor("tensor", &capsule).is_ok_and(|t| t.device.device_type == CPU && kind_of("tensor", t).is_ok());
    Ok(readable.then_some(capsule))
}

/// A capsule of `obj` made by `torch.utils.dlpack.to_dlpack` (C; it orders no stream) when
/// `obj` is a plain torch tensor that does not require grad and the export succeeds; `None`
/// otherwise, for the caller to take the generic way (`__dlpack__`).
fn plain_capsule<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
    let Some(to_dlpack) = plain_torch(obj)? else { return Ok(None) };
    if obj.getattr(intern!(obj.py(), "requires_grad"))?.is_truthy()? {
        return Ok(None);
    }
    Ok(to_dlpack.call1((obj,)).ok())
}

/// `obj`'s elements as f32 in C order, written over `out`, and its shape, when `obj` has
/// `__dlpack__`; `None` (and `out` untouched) when it has not.
pub(crate) fn floats_into(what: &str, obj: &Bound<'_, PyAny>, out: &mut Vec<f32>) -> PyResult<Option<Vec<usize>>> {
    let capsule = match torch_capsule(obj)? {
        Some(capsule) => capsule,
        None => match host_capsule(what, obj)? {
            Some(capsule) => capsule,
            None => return Ok(None),
        },
    };
    let t = tensor(what, &capsule)?;
    let kind = kind_of(what, t)?;
    let (shape, strides, contiguous) = layout(what, t)?;
    let count: usize = shape.iter().product();
    out.clear();
    out.reserve(count);
    if count > 0 && contiguous {
        // SAFETY: a C-contiguous tensor's `count` elements follow `data + byte_offset`.
        let base = unsafe { t.data.cast::<u8>().add(t.byte_offset as usize) };
        // SAFETY: as above, `count` elements of `kind` from `base`, alive with the capsule.
        unsafe { read_run(base, count, kind, out) };
    } else if count > 0 {
        // SAFETY: `data + byte_offset` is the tensor's first element (DLPack's layout).
        let base = unsafe { t.data.cast::<u8>().add(t.byte_offset as usize) };
        let size = usize::from(t.dtype.bits / 8) as isize;
        let mut index = vec![0usize; shape.len()];
        for _ in 0..count {
            let offset: i64 = index.iter().zip(&strides).map(|(&i, &s)| i as i64 * s).sum();
            // SAFETY: every index is within `shape`, so `offset` names an element of the
            // tensor the producer laid out with these strides; reads are unaligned-safe.
            let at = unsafe { base.offset(offset as isize * size) };
            out.push(read(at, kind));
            for d in (0..shape.len()).rev() {
                index[d] += 1;
                if index[d] < shape[d] {
                    break;
                }
                index[d] = 0;
            }
        }
    }
    Ok(Some(shape))
}

/// `obj.__dlpack__()` as a capsule of host memory (a device tensor copied by its producer),
/// or `None` when `obj` has no `__dlpack__`.
fn host_capsule<'py>(what: &str, obj: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
    let py = obj.py();
    if !obj.hasattr(intern!(py, "__dlpack__"))? {
        return Ok(None);
    }
    let first = obj.call_method0(intern!(py, "__dlpack__"))?;
    let on_device = &tensor(what, &first)?.device;
    let (device_type, device_id) = (on_device.device_type, on_device.device_id);
    if device_type == CPU {
        return Ok(Some(first));
    }
    // A device tensor (CUDA, ROCm, ...): its producer copies it to host memory, ordered
    // after the work queued on its current stream (DLPack's `dl_device` / `copy` request,
    // array API 2023.12; torch ≥ 2.6 honours it).
    drop(first);
    let kwargs = pyo3::types::PyDict::new(py);
    kwargs.set_item("dl_device", (CPU, 0))?;
    kwargs.set_item("copy", true)?;
    let copied = obj.call_method(intern!(py, "__dlpack__"), (), Some(&kwargs)).map_err(|e| {
        PyValueError::new_err(format!(
            "{what} is on DLPack device type {device_type} (id {device_id}) and its producer could not copy it to the CPU \
             (__dlpack__(dl_device=(1, 0), copy=True) failed: {e}); pass a CPU tensor"
        ))
    })?;
    let copied_to = tensor(what, &copied)?.device.device_type;
    if copied_to != CPU {
        return Err(PyValueError::new_err(format!(
            "{what}: its producer was asked for a CPU copy and gave device type {copied_to}"
        )));
    }
    Ok(Some(copied))
}

/// Appends `count` elements of `kind` from `base` to `out` as f32, the type matched once
/// for the run (so each arm's loop is a plain copy or conversion the compiler vectorizes).
///
/// # Safety
/// `base` points at `count` consecutive elements of `kind`, readable for this call.
unsafe fn read_run(base: *const u8, count: usize, kind: Kind, out: &mut Vec<f32>) {
    // SAFETY (each arm): element `i < count` lies within the run the caller guarantees;
    // read unaligned, as DLPack does not promise alignment.
    unsafe {
        match kind {
            Kind::F32 => out.extend((0..count).map(|i| base.cast::<f32>().add(i).read_unaligned())),
            Kind::F16 => out
                .extend((0..count).map(|i| half::f16::from_bits(base.cast::<u16>().add(i).read_unaligned()).to_f32())),
            Kind::Bf16 => out
                .extend((0..count).map(|i| half::bf16::from_bits(base.cast::<u16>().add(i).read_unaligned()).to_f32())),
            Kind::F64 => out.extend((0..count).map(|i| base.cast::<f64>().add(i).read_unaligned() as f32)),
        }
    }
}

/// The element type of `t`, or a `TypeError` naming those read.
fn kind_of(what: &str, t: &DlTensor) -> PyResult<Kind> {
    Ok(match (t.dtype.code, t.dtype.bits, t.dtype.lanes) {
        (2, 32, 1) => Kind::F32,
        (2, 16, 1) => Kind::F16,
        (4, 16, 1) => Kind::Bf16,
        (2, 64, 1) => Kind::F64,
        (code, bits, lanes) => {
            return Err(PyTypeError::new_err(format!(
                "{what} has DLPack dtype code {code}, {bits} bits, {lanes} lanes; expected float32, float16, bfloat16 or float64"
            )))
        }
    })
}

/// `t`'s shape, its strides in elements (C order when DLPack gives none) and whether it is
/// C-contiguous.
fn layout(what: &str, t: &DlTensor) -> PyResult<(Vec<usize>, Vec<i64>, bool)> {
    let ndim = usize::try_from(t.ndim).map_err(|_| PyValueError::new_err(format!("{what}: negative ndim")))?;
    let dims = |p: *const i64| -> Vec<i64> {
        if ndim == 0 || p.is_null() {
            return Vec::new();
        }
        // SAFETY: DLPack's shape (and a non-null strides) array has `ndim` entries, valid
        // while the capsule lives.
        unsafe { std::slice::from_raw_parts(p, ndim) }.to_vec()
    };
    let shape = dims(t.shape);
    if shape.len() != ndim || shape.iter().any(|&s| s < 0) {
        return Err(PyValueError::new_err(format!("{what}: bad DLPack shape {shape:?}")));
    }
    let shape: Vec<usize> = shape.iter().map(|&s| s as usize).collect();
    // Strides in elements; null means C-contiguous.
    let strides: Vec<i64> = match dims(t.strides) {
        s if s.len() == ndim => s,
        _ => {
            let mut s = vec![1i64; ndim];
            for i in (0..ndim.saturating_sub(1)).rev() {
                s[i] = s[i + 1] * shape[i + 1] as i64;
            }
            s
        }
    };
    // A dimension of length 1 may carry any stride.
    let contiguous = (0..ndim).all(|i| shape[i] == 1 || strides[i] == shape[i + 1..].iter().product::<usize>() as i64);
    Ok((shape, strides, contiguous))
}

/// Whether `obj` is a DLPack tensor on a CUDA device (`__dlpack_device__()`).
pub(crate) fn on_cuda(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    // A plain torch tensor says where it is through a C getter; torch's `__dlpack_device__` is
    // Python, microseconds a call.
    if plain_torch(obj)?.is_some() {
        return obj.getattr(intern!(obj.py(), "is_cuda"))?.is_truthy();
    }
    if !obj.hasattr("__dlpack_device__")? {
        return Ok(false);
    }
    let (device_type, _): (i32, i32) = obj.call_method0("__dlpack_device__")?.extract()?;
    Ok(device_type == CUDA)
}

/// A C-contiguous tensor in CUDA memory, read and written in place; its capsule is kept
/// (the producer frees the tensor only when the capsule goes).
#[cfg(feature = "cuda")]
pub(crate) struct CudaTensor<'py> {
    _capsule: Bound<'py, PyAny>,
    /// Device address of the first element.
    pub(crate) address: u64,
    pub(crate) dtype: attnstore::IoDType,
    pub(crate) shape: Vec<usize>,
    /// The CUDA device's ordinal.
    pub(crate) device: i32,
}

/// `obj`, a DLPack tensor on a CUDA device, in place: float32, float16 or bfloat16 and
/// C-contiguous, else a `TypeError` / `ValueError` naming what is expected. The capsule is
/// asked for with `stream=-1` (no synchronization): the engine orders its reads after the
/// caller's stream itself.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_tensor<'py>(what: &str, obj: &Bound<'py, PyAny>) -> PyResult<CudaTensor<'py>> {
    // A plain torch tensor that does not require grad: `to_dlpack` (C; it orders nothing, as
    // `stream=-1` asks), else `__dlpack__` (Python), which also raises what it refuses.
    let capsule = match plain_capsule(obj)? {
        Some(capsule) => capsule,
        None => {
            let kwargs = pyo3::types::PyDict::new(obj.py());
            kwargs.set_item("stream", -1)?;
            obj.call_method("__dlpack__", (), Some(&kwargs))?
        }
    };
    let t = tensor(what, &capsule)?;
    if t.device.device_type != CUDA {
        return Err(PyValueError::new_err(format!(
            "{what} is on DLPack device type {}; expected a CUDA tensor (type {CUDA})",
            t.device.device_type
        )));
    }
    let dtype = match kind_of(what, t)? {
        Kind::F32 => attnstore::IoDType::F32,
        Kind::F16 => attnstore::IoDType::F16,
        Kind::Bf16 => attnstore::IoDType::Bf16,
        Kind::F64 => {
            return Err(PyTypeError::new_err(format!(
                "{what} is a CUDA float64 tensor; CUDA tensors must be float32, float16 or bfloat16"
            )))
        }
    };
    let (shape, _, contiguous) = layout(what, t)?;
    if !contiguous {
        return Err(PyValueError::new_err(format!(
            "{what} is a non-contiguous CUDA tensor (shape {shape:?}); pass a contiguous one (.contiguous())"
        )));
    }
    let address = t.data as u64 + t.byte_offset;
    let device = t.device.device_id;
    Ok(CudaTensor { _capsule: capsule, address, dtype, shape, device })
}

/// The stream the caller's work on `obj` is queued on: torch's current stream of its
/// device for a torch tensor, else 0 (the legacy default stream).
#[cfg(feature = "cuda")]
pub(crate) fn current_stream(obj: &Bound<'_, PyAny>, device: i32) -> PyResult<u64> {
    let py = obj.py();
    if plain_torch(obj)?.is_some() {
        // torch's C getter of the raw stream (`torch.cuda.current_stream` builds a Python
        // Stream object first, microseconds a call), looked up once.
        static RAW: PyOnceLock<Option<Py<PyAny>>> = PyOnceLock::new();
        let raw = RAW.get_or_try_init(py, || {
            PyResult::Ok(
                py.import("torch")?.getattr("_C")?.getattr("_cuda_getCurrentRawStream").ok().map(Bound::unbind),
            )
        })?;
        if let Some(f) = raw {
            return f.bind(py).call1((device,))?.extract();
        }
    }
    let module: String = obj.get_type().getattr("__module__")?.extract()?;
    if !module.starts_with("torch") {
        return Ok(0);
    }
    let stream = py.import("torch")?.getattr("cuda")?.call_method1("current_stream", (device,))?;
    stream.getattr("cuda_stream")?.extract()
}

/// One element at `at` as f32.
fn read(at: *const u8, kind: Kind) -> f32 {
    // SAFETY: `at` points at one element of `kind` (the caller's offset computation); read
    // unaligned, as a strided view need not keep alignment.
    unsafe {
        match kind {
            Kind::F32 => at.cast::<f32>().read_unaligned(),
            Kind::F16 => half::f16::from_bits(at.cast::<u16>().read_unaligned()).to_f32(),
            Kind::Bf16 => half::bf16::from_bits(at.cast::<u16>().read_unaligned()).to_f32(),
            Kind::F64 => at.cast::<f64>().read_unaligned() as f32,
        }
    }
}
