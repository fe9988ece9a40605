//! Tensors through DLPack (`__dlpack__`, e.g. torch or JAX tensors): a CPU tensor of
//! float32, float16, bfloat16 or float64, contiguous or strided, read as f32. The capsule is
//! not consumed: the producer's destructor frees the tensor when the capsule goes, after the
//! copy. A tensor on a device (CUDA) is copied to host memory by its producer, on request
//! (`__dlpack__(dl_device=(1, 0), copy=True)`), ordered after the work queued on its stream;
//! reading CUDA queries in place, without that copy, is not done yet.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyCapsuleMethods};
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

/// `obj`'s elements as f32 in C order and its shape, when `obj` has `__dlpack__`; `None`
/// when it has not.
pub(crate) fn floats(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<Option<(Vec<f32>, Vec<usize>)>> {
    if !obj.hasattr("__dlpack__")? {
        return Ok(None);
    }
    let first = obj.call_method0("__dlpack__")?;
    let on_device = &tensor(what, &first)?.device;
    let (device_type, device_id) = (on_device.device_type, on_device.device_id);
    let capsule = if device_type == CPU {
        first
    } else {
        // A device tensor (CUDA, ROCm, ...): its producer copies it to host memory, ordered
        // after the work queued on its current stream (DLPack's `dl_device` / `copy`
        // request, array API 2023.12; torch ≥ 2.6 honours it).
        drop(first);
        let kwargs = pyo3::types::PyDict::new(obj.py());
        kwargs.set_item("dl_device", (CPU, 0))?;
        kwargs.set_item("copy", true)?;
        let copied = obj.call_method("__dlpack__", (), Some(&kwargs)).map_err(|e| {
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
        copied
    };
    let t = tensor(what, &capsule)?;
    let kind = match (t.dtype.code, t.dtype.bits, t.dtype.lanes) {
        (2, 32, 1) => Kind::F32,
        (2, 16, 1) => Kind::F16,
        (4, 16, 1) => Kind::Bf16,
        (2, 64, 1) => Kind::F64,
        (code, bits, lanes) => {
            return Err(PyTypeError::new_err(format!(
                "{what} has DLPack dtype code {code}, {bits} bits, {lanes} lanes; expected float32, float16, bfloat16 or float64"
            )))
        }
    };
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
    let count: usize = shape.iter().product();
    let mut out = Vec::with_capacity(count);
    let contiguous = (0..ndim).all(|i| strides[i] == shape[i + 1..].iter().product::<usize>() as i64);
    if count > 0 && contiguous {
        // SAFETY: a C-contiguous tensor's `count` elements follow `data + byte_offset`.
        let base = unsafe { t.data.cast::<u8>().add(t.byte_offset as usize) };
        let size = usize::from(t.dtype.bits / 8);
        // SAFETY: `i < count` elements of `size` bytes from `base`, as above.
        out.extend((0..count).map(|i| read(unsafe { base.add(i * size) }, kind)));
    } else if count > 0 {
        // SAFETY: `data + byte_offset` is the tensor's first element (DLPack's layout).
        let base = unsafe { t.data.cast::<u8>().add(t.byte_offset as usize) };
        let size = usize::from(t.dtype.bits / 8) as isize;
        let mut index = vec![0usize; ndim];
        for _ in 0..count {
            let offset: i64 = index.iter().zip(&strides).map(|(&i, &s)| i as i64 * s).sum();
            // SAFETY: every index is within `shape`, so `offset` names an element of the
            // tensor the producer laid out with these strides; reads are unaligned-safe.
            let at = unsafe { base.offset(offset as isize * size) };
            out.push(read(at, kind));
            for d in (0..ndim).rev() {
                index[d] += 1;
                if index[d] < shape[d] {
                    break;
                }
                index[d] = 0;
            }
        }
    }
    Ok(Some((out, shape)))
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
