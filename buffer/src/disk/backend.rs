//! I/O backends of the Disk tier: one trait, with `pread`/`pwrite` ([`PreadIo`]), io_uring
//! (`UringIo`, Linux) and a fault injector ([`FaultyIo`]) that fails chosen operations, so
//! failed writes, failed reads and timeouts are testable without a broken disk.
//!
//! Requests move bytes between a file and a [`StagingBuffer`] the backend takes by value: a
//! backend that gives up on a request still in flight (a timeout) keeps the buffer, so the
//! kernel can never write into memory that was handed back.

use crate::{BlockId, Error, Result};
use memmap2::MmapMut;
use parking_lot::Mutex;
use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Alignment of offsets, lengths and buffer addresses for `O_DIRECT` (the logical sector).
pub const DIRECT_IO_ALIGN: usize = 512;

/// Page-aligned memory for direct I/O (anonymous mapping: aligned without `unsafe`).
pub struct StagingBuffer {
    map: MmapMut,
}

impl StagingBuffer {
    /// A zeroed buffer of `bytes` (rounded up to a page).
    pub fn new(bytes: usize) -> Result<Self> {
        let map = MmapMut::map_anon(bytes.max(1)).map_err(|e| Error::io("staging alloc", None, &e))?;
        Ok(Self { map })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the buffer has no bytes (never: at least one page).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }
}

/// Read or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    /// File → staging buffer.
    Read,
    /// Staging buffer → file.
    Write,
}

/// One request: `len` bytes between `file` at `offset` and the staging buffer at `buffer_offset`.
#[derive(Debug, Clone, Copy)]
pub struct IoRequest {
    /// Direction.
    pub kind: IoKind,
    /// Byte offset in the file.
    pub offset: u64,
    /// Byte offset in the staging buffer.
    pub buffer_offset: usize,
    /// Bytes.
    pub len: usize,
    /// The block moved (for error messages and targeted fault injection).
    pub block: Option<BlockId>,
}

/// What a backend returns: the staging buffer when it is safe to reuse (`None`: kept by the
/// backend because a request may still be in flight) and one result per request, in order.
pub type IoOutcome = (Option<StagingBuffer>, Vec<Result<()>>);

/// A way to move bytes between segment files and staging buffers.
///
/// Contract: `submit` returns within about `timeout` (a request not finished by then gets
/// [`Error::Timeout`]); it checks every request with [`check_aligned`] first (an unaligned
/// request fails alone with [`Error::Unaligned`]); a short read or write is an error.
pub trait IoBackend: Send + Sync {
    /// Name for logs and stats (`pread`, `io_uring`, `faulty(..)`).
    fn name(&self) -> &'static str;
    /// Carries out `requests` on `file` (all with the same staging buffer), as one batch.
    fn submit(&self, file: &File, requests: &[IoRequest], staging: StagingBuffer, timeout: Duration) -> IoOutcome;

    /// Reads `reads` (each from `files[read.file]`) and calls `done(i, bytes)` once per read,
    /// as each one completes, in no fixed order. The backend places reads in slots of
    /// `staging` (of the longest read's length), so a call of any length needs only a few
    /// slots, and `done` may run while later reads are in flight.
    ///
    /// Returns the staging buffer when it is safe to reuse (`None`: kept by the backend,
    /// see [`IoOutcome`]). A read still pending when no read has completed for `timeout` gets
    /// [`Error::Timeout`]; an unaligned read fails alone with [`Error::Unaligned`]; a staging
    /// buffer too small for one slot fails every read with [`Error::WrongLength`].
    ///
    /// The default carries out consecutive reads of one file as one [`submit`](Self::submit)
    /// of up to one staging buffer's worth of slots.
    fn read_stream(
        &self,
        files: &[&File],
        reads: &[StreamRead],
        staging: StagingBuffer,
        timeout: Duration,
        done: &mut dyn FnMut(usize, Result<&[u8]>),
    ) -> Option<StagingBuffer> {
        let Some(slot) = stream_slot(reads, &staging, done) else { return Some(staging) };
        let slots = staging.len() / slot;
        let mut staging = Some(staging);
        let mut start = 0;
        while start < reads.len() {
            let file = reads[start].file;
            if file >= files.len() {
                done(start, Err(no_such_file(file)));
                start += 1;
                continue;
            }
            let end = start + reads[start..].iter().take(slots).take_while(|r| r.file == file).count();
            let Some(buffer) = staging.take() else {
                let error = Error::Timeout { op: "disk read (staging kept after a timeout)", limit_ms: 0 };
                (start..reads.len()).for_each(|i| done(i, Err(error.clone())));
                return None;
            };
            let requests: Vec<IoRequest> =
                reads[start..end].iter().enumerate().map(|(k, r)| r.request(k * slot)).collect();
            let (buffer, results) = self.submit(files[file], &requests, buffer, timeout);
            for ((k, request), result) in requests.iter().enumerate().zip(results) {
                let bytes = result.and_then(|()| {
                    let buffer = buffer
                        .as_ref()
                        .ok_or(Error::Timeout { op: "disk read batch", limit_ms: timeout.as_millis() as u64 })?;
                    Ok(&buffer.bytes()[request.buffer_offset..][..request.len])
                });
                done(start + k, bytes);
            }
            staging = buffer;
            start = end;
        }
        staging
    }
}

/// One read of [`IoBackend::read_stream`]: `len` bytes of `files[file]` at `offset`.
#[derive(Debug, Clone, Copy)]
pub struct StreamRead {
    /// Index into the call's files.
    pub file: usize,
    /// Byte offset in the file.
    pub offset: u64,
    /// Bytes.
    pub len: usize,
    /// The block read (for error messages and targeted fault injection).
    pub block: Option<BlockId>,
}

impl StreamRead {
    /// The same read as an [`IoRequest`] into the staging buffer at `buffer_offset`.
    pub fn request(&self, buffer_offset: usize) -> IoRequest {
        IoRequest { kind: IoKind::Read, offset: self.offset, buffer_offset, len: self.len, block: self.block }
    }
}

/// The error of a [`StreamRead`] naming a file the call was not given.
pub(super) fn no_such_file(file: usize) -> Error {
    Error::BadConfig {
        what: "a stream read's file index",
        expected: "below the number of files given",
        got: file as u64,
    }
}

/// The slot size of a [`IoBackend::read_stream`] call: the longest read, rounded up to
/// [`DIRECT_IO_ALIGN`]. `None` (after failing every read through `done`) when there is nothing
/// to read or `staging` has no room for one slot.
pub(super) fn stream_slot(
    reads: &[StreamRead],
    staging: &StagingBuffer,
    done: &mut dyn FnMut(usize, Result<&[u8]>),
) -> Option<usize> {
    let slot = reads.iter().map(|r| r.len).max()?.next_multiple_of(DIRECT_IO_ALIGN).max(DIRECT_IO_ALIGN);
    if slot > staging.len() {
        let error = Error::WrongLength { expected: staging.len(), got: slot };
        (0..reads.len()).for_each(|i| done(i, Err(error.clone())));
        return None;
    }
    Some(slot)
}

/// Checks a request against `O_DIRECT`'s rules and the staging buffer's bounds.
pub fn check_aligned(request: &IoRequest, staging: &StagingBuffer) -> Result<()> {
    let address = staging.bytes().as_ptr() as usize + request.buffer_offset;
    for (what, got) in [("offset", request.offset as usize), ("length", request.len), ("buffer address", address)] {
        if !got.is_multiple_of(DIRECT_IO_ALIGN) {
            return Err(Error::Unaligned { what, expected_multiple: DIRECT_IO_ALIGN, got });
        }
    }
    if request.buffer_offset.checked_add(request.len).is_none_or(|end| end > staging.len()) {
        return Err(Error::WrongLength { expected: staging.len(), got: request.buffer_offset + request.len });
    }
    Ok(())
}

/// Plain positioned reads and writes (the fallback when io_uring is unavailable). A blocking
/// system call cannot be interrupted, so its bound is the device's own timeout.
#[derive(Debug, Default)]
pub struct PreadIo;

impl IoBackend for PreadIo {
    fn name(&self) -> &'static str {
        "pread"
    }

    fn submit(&self, file: &File, requests: &[IoRequest], mut staging: StagingBuffer, _timeout: Duration) -> IoOutcome {
        let results = requests
            .iter()
            .map(|r| {
                check_aligned(r, &staging)?;
                let range = r.buffer_offset..r.buffer_offset + r.len;
                match r.kind {
                    IoKind::Read => file.read_exact_at(&mut staging.bytes_mut()[range], r.offset),
                    IoKind::Write => file.write_all_at(&staging.bytes()[range], r.offset),
                }
                .map_err(|e| Error::io(if r.kind == IoKind::Read { "read" } else { "write" }, r.block, &e))
            })
            .collect();
        (Some(staging), results)
    }
}

/// Which operations [`FaultyIo`] fails.
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    /// Fail every operation after this many have succeeded.
    pub fail_after_ops: Option<u64>,
    /// Fail every operation on these blocks.
    pub fail_blocks: HashSet<BlockId>,
    /// Only fail reads (writes pass), or only writes (`Some(IoKind::Write)`).
    pub only: Option<IoKind>,
    /// Report injected failures as timeouts instead of I/O errors.
    pub as_timeout: bool,
}

/// A backend that fails on demand (see [`FaultPlan`]) and passes everything else to `inner`.
/// A failed write writes nothing.
pub struct FaultyIo {
    inner: Box<dyn IoBackend>,
    plan: Mutex<FaultPlan>,
    ops: AtomicU64,
    injected: AtomicU64,
}

impl FaultyIo {
    /// Wraps `inner` with `plan`.
    pub fn new(inner: Box<dyn IoBackend>, plan: FaultPlan) -> Self {
        Self { inner, plan: Mutex::new(plan), ops: AtomicU64::new(0), injected: AtomicU64::new(0) }
    }

    /// Replaces the plan (and restarts the operation count).
    pub fn set_plan(&self, plan: FaultPlan) {
        *self.plan.lock() = plan;
        self.ops.store(0, Ordering::Relaxed);
    }

    /// Failures injected so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    fn should_fail(&self, plan: &FaultPlan, request: &IoRequest) -> bool {
        if plan.only.is_some_and(|kind| kind != request.kind) {
            return false;
        }
        // Relaxed: a counter; batches are serialized by the Disk tier's staging anyway.
        let n = self.ops.fetch_add(1, Ordering::Relaxed);
        plan.fail_after_ops.is_some_and(|after| n >= after)
            || request.block.is_some_and(|b| plan.fail_blocks.contains(&b))
    }
}

impl IoBackend for FaultyIo {
    fn name(&self) -> &'static str {
        "faulty"
    }

    fn submit(&self, file: &File, requests: &[IoRequest], staging: StagingBuffer, timeout: Duration) -> IoOutcome {
        let plan = self.plan.lock().clone();
        let fail: Vec<bool> = requests.iter().map(|r| self.should_fail(&plan, r)).collect();
        let passing: Vec<IoRequest> = requests.iter().zip(&fail).filter(|(_, f)| !**f).map(|(r, _)| *r).collect();
        let (staging, inner_results) = self.inner.submit(file, &passing, staging, timeout);
        let mut inner_results = inner_results.into_iter();
        let results = requests
            .iter()
            .zip(fail)
            .map(|(r, fail)| {
                if !fail {
                    return inner_results.next().expect("one result per passing request");
                }
                self.injected.fetch_add(1, Ordering::Relaxed);
                if plan.as_timeout {
                    Err(Error::Timeout { op: "injected I/O", limit_ms: timeout.as_millis() as u64 })
                } else {
                    let op = if r.kind == IoKind::Read { "read" } else { "write" };
                    Err(Error::Io {
                        op,
                        block: r.block,
                        kind: std::io::ErrorKind::Other,
                        message: "injected fault".into(),
                    })
                }
            })
            .collect();
        (staging, results)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unaligned_requests_fail_alone_with_a_typed_error() {
        let dir = std::env::temp_dir().join(format!("attnstore-backend-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = File::options().read(true).write(true).create(true).truncate(true).open(dir.join("f")).unwrap();
        file.set_len(8192).unwrap();
        let staging = StagingBuffer::new(8192).unwrap();
        let req =
            |offset, buffer_offset, len| IoRequest { kind: IoKind::Read, offset, buffer_offset, len, block: None };
        let (staging, results) = PreadIo.submit(
            &file,
            &[req(100, 0, 512), req(0, 0, 700), req(0, 8, 512), req(0, 0, 512), req(0, 8192, 512)],
            staging,
            Duration::from_secs(1),
        );
        assert!(staging.is_some());
        assert_eq!(results[0], Err(Error::Unaligned { what: "offset", expected_multiple: 512, got: 100 }));
        assert_eq!(results[1], Err(Error::Unaligned { what: "length", expected_multiple: 512, got: 700 }));
        assert!(matches!(results[2], Err(Error::Unaligned { what: "buffer address", .. })));
        assert_eq!(results[3], Ok(()));
        assert_eq!(results[4], Err(Error::WrongLength { expected: 8192, got: 8704 }));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
