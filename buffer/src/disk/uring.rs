//! The io_uring backend.
//!
//! - **A ring per calling thread** (up to [`MAX_THREAD_RINGS`]), set up for a single issuer
//!   with deferred task work (`IORING_SETUP_SINGLE_ISSUER | DEFER_TASKRUN | COOP_TASKRUN`):
//!   completions are processed when the thread waits for them, not by interrupting it, which
//!   is how fio sets up its rings. Threads beyond the limit, or every thread on a kernel that
//!   refuses those flags, share one plain ring under its mutex.
//! - **A sliding window**: up to `depth` requests in flight, refilled as completions arrive,
//!   submitted and reaped in groups of a quarter of the depth (one system call per group).
//! - **Streamed reads** ([`IoBackend::read_stream`]): each completion is handed to the caller
//!   (who checks and copies it) after the window was refilled, so the device stays busy while
//!   the caller works, and a call of any length needs only a window's worth of slots.
//! - **Bounded waits**: completions are awaited with a kernel timeout (`IORING_ENTER_EXT_ARG`).
//!   If a call times out, its staging buffer stays with the ring (quarantined, never reused or
//!   freed: the kernel may still write into it) and the ring is replaced by a fresh one.

#![allow(unsafe_code)] // pushing submission entries that point at the staging buffer

use super::backend::{
    check_aligned, no_such_file, stream_slot, IoBackend, IoKind, IoOutcome, IoRequest, StagingBuffer, StreamRead,
};
use crate::{BlockId, Error, Result};
use io_uring::{opcode, squeue, types, IoUring};
use parking_lot::Mutex;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::ThreadId;
use std::time::{Duration, Instant};

const RING_ENTRIES: u32 = 256;

/// Most threads that get a ring of their own; later threads share one. A ring stays with
/// the backend after its thread exits (thread ids are never reused), so a pool that keeps
/// replacing its threads ends up on the shared ring: slower, never wrong.
pub const MAX_THREAD_RINGS: usize = 16;

/// io_uring with a ring per calling thread (see the module docs).
pub struct UringIo {
    rings: Mutex<Vec<OwnedRing>>,
    /// False once the kernel refused a single-issuer ring: every thread shares then, and no
    /// call tries again.
    own_rings: AtomicBool,
    depth: usize,
}

/// `(Some(thread), ring)` for a thread's own ring, `(None, ring)` for the shared one.
type OwnedRing = (Option<ThreadId>, Arc<Mutex<Ring>>);

struct Ring {
    ring: IoUring,
    /// Buffers of timed-out calls: the kernel may still write into them, so they are kept.
    quarantine: Vec<StagingBuffer>,
    /// A ring whose call timed out has completions outstanding that would be mistaken for a
    /// later call's: it is replaced before the next call.
    broken: bool,
}

impl Drop for Ring {
    fn drop(&mut self) {
        // Closing the ring does not wait for requests still in flight: their buffers are
        // leaked, never unmapped, so the kernel can never write into reused memory.
        self.quarantine.drain(..).for_each(std::mem::forget);
    }
}

impl Ring {
    fn new(own: bool) -> std::io::Result<Self> {
        let ring = if own {
            IoUring::builder().setup_coop_taskrun().setup_single_issuer().setup_defer_taskrun().build(RING_ENTRIES)?
        } else {
            IoUring::new(RING_ENTRIES)?
        };
        Ok(Self { ring, quarantine: Vec::new(), broken: false })
    }

    /// Submits what is queued and waits for `want` completions, at most until `deadline`.
    /// Interruptions and the kernel's timeout are not errors (the caller looks at the clock).
    fn wait(&mut self, want: usize, deadline: Instant) -> std::io::Result<()> {
        let left = deadline.saturating_duration_since(Instant::now());
        let ts = types::Timespec::new().sec(left.as_secs()).nsec(left.subsec_nanos());
        let args = types::SubmitArgs::new().timespec(&ts);
        match self.ring.submitter().submit_with_args(want.max(1), &args) {
            Err(e) if !matches!(e.raw_os_error(), Some(libc::EINTR | libc::EBUSY | libc::ETIME)) => Err(e),
            _ => Ok(()),
        }
    }

    /// Queues `entry` (reading or writing `ptr..ptr + len`).
    ///
    /// # Safety
    /// The memory `entry` points at must stay valid and untouched by the caller until its
    /// completion is reaped, or forever (quarantine) if it never is.
    unsafe fn push(&mut self, entry: &squeue::Entry) {
        // SAFETY: the caller keeps the memory valid (above). Callers keep at most
        // `depth <= RING_ENTRIES` entries queued or in flight, so the queue has room.
        let pushed = unsafe { self.ring.submission().push(entry) };
        pushed.expect("at most RING_ENTRIES requests in flight fit the submission queue");
    }

    /// Gives up on the call after a failed submission or a timeout: keeps its buffer and
    /// marks the ring for replacement.
    fn abandon(&mut self, staging: StagingBuffer) {
        self.broken = true;
        self.quarantine.push(staging);
    }

    /// One batch of reads and writes into one staging buffer (see [`IoBackend::submit`]).
    fn submit(
        &mut self,
        depth: usize,
        file: &File,
        requests: &[IoRequest],
        mut staging: StagingBuffer,
        timeout: Duration,
    ) -> IoOutcome {
        let pending = Error::Timeout { op: "io_uring batch", limit_ms: timeout.as_millis() as u64 };
        // Until its completion is reaped, a valid request's result is "timed out".
        let mut results: Vec<Result<()>> =
            requests.iter().map(|r| check_aligned(r, &staging).and(Err(pending.clone()))).collect();
        let valid: Vec<usize> =
            requests.iter().enumerate().filter(|(_, r)| check_aligned(r, &staging).is_ok()).map(|(i, _)| i).collect();
        let deadline = Instant::now() + timeout;
        let fd = types::Fd(file.as_raw_fd());
        let base = staging.bytes_mut().as_mut_ptr();
        let group = (depth / 4).max(1);
        let (mut next, mut in_flight) = (0, 0);
        while next < valid.len() || in_flight > 0 {
            while next < valid.len() && in_flight < depth {
                let i = valid[next];
                let r = &requests[i];
                let ptr = base.wrapping_add(r.buffer_offset);
                let entry = match r.kind {
                    IoKind::Read => opcode::Read::new(fd, ptr, r.len as u32).offset(r.offset).build(),
                    IoKind::Write => opcode::Write::new(fd, ptr, r.len as u32).offset(r.offset).build(),
                }
                .user_data(i as u64);
                // SAFETY: `ptr..ptr+len` lies inside `staging` (checked by `check_aligned`), which
                // outlives the operation: it is returned only after every completion of this call
                // was reaped, or quarantined after a timeout. The file descriptor is borrowed for
                // the call and io_uring holds its own file reference.
                unsafe { self.push(&entry) };
                next += 1;
                in_flight += 1;
            }
            if let Err(e) = self.wait(group.min(in_flight), deadline) {
                // The kernel refused the submission: whatever is in flight may still complete
                // into the buffer, so keep it.
                self.abandon(staging);
                let err = Error::io("io_uring submit", None, &e);
                for &i in &valid {
                    if results[i] == Err(pending.clone()) {
                        results[i] = Err(err.clone());
                    }
                }
                return (None, results);
            }
            for cqe in self.ring.completion() {
                let i = cqe.user_data() as usize;
                let r = &requests[i];
                results[i] = completion(r.kind, r.block, r.len, cqe.result());
                in_flight -= 1;
            }
            if in_flight > 0 && Instant::now() >= deadline {
                self.abandon(staging);
                // Unreaped and unsubmitted requests keep their "timed out" result.
                return (None, results);
            }
        }
        (Some(staging), results)
    }

    /// Streamed reads (see [`IoBackend::read_stream`]).
    fn read_stream(
        &mut self,
        depth: usize,
        files: &[&File],
        reads: &[StreamRead],
        mut staging: StagingBuffer,
        timeout: Duration,
        done: &mut dyn FnMut(usize, Result<&[u8]>),
    ) -> Option<StagingBuffer> {
        let Some(slot_bytes) = stream_slot(reads, &staging, done) else { return Some(staging) };
        // Twice the window is enough slots (a window in flight, a window waiting for `done`),
        // and a short call needs no more slots than reads: small calls set up little.
        let slots = (staging.len() / slot_bytes).min(2 * depth).min(reads.len());
        let mut stream = Stream {
            files,
            reads,
            base: staging.bytes_mut().as_mut_ptr(),
            slot_bytes,
            // Slots beyond the window hold completions waiting for `done` while the refilled
            // window keeps the device busy.
            window: depth.min(slots),
            free: (0..slots).rev().collect(),
            slot_of: vec![usize::MAX; reads.len()],
            next: 0,
            in_flight: 0,
        };
        let mut ready: Vec<(usize, i32)> = Vec::with_capacity(stream.window);
        let group = (depth / 4).max(1);
        let mut deadline = Instant::now() + timeout;
        loop {
            stream.fill(self, &staging, done);
            if stream.in_flight == 0 {
                // Every read was delivered (`ready` is emptied below), and none is left.
                return Some(staging);
            }
            let waited = self.wait(group.min(stream.in_flight), deadline);
            ready.extend(self.ring.completion().map(|cqe| (cqe.user_data() as usize, cqe.result())));
            stream.in_flight -= ready.len();
            if !ready.is_empty() && waited.is_ok() {
                deadline = Instant::now() + timeout;
                // Refill before delivering, so the device works while `done` does. (After a
                // refused submission nothing more is queued: the ring is given up below.)
                stream.fill(self, &staging, done);
                let _ = self.ring.submit(); // a refused submission shows up at the next wait
            }
            for (i, result) in ready.drain(..) {
                stream.deliver(i, result, done);
            }
            let failure = match waited {
                Err(e) => Some(Error::io("io_uring submit", None, &e)),
                Ok(()) if stream.in_flight > 0 && Instant::now() >= deadline => {
                    Some(Error::Timeout { op: "io_uring read", limit_ms: timeout.as_millis() as u64 })
                }
                Ok(()) => None,
            };
            if let Some(error) = failure {
                // Reads in flight may still complete into the buffer: keep it.
                self.abandon(staging);
                let in_flight = (0..stream.next).filter(|&i| stream.slot_of[i] != usize::MAX);
                in_flight.chain(stream.next..reads.len()).for_each(|i| done(i, Err(error.clone())));
                return None;
            }
        }
    }
}

/// The state of one [`Ring::read_stream`] call.
struct Stream<'a> {
    files: &'a [&'a File],
    reads: &'a [StreamRead],
    /// Start of the staging buffer (its slots are `slot_bytes` apart).
    base: *mut u8,
    slot_bytes: usize,
    /// Most reads in flight.
    window: usize,
    /// Slots neither in flight nor waiting for delivery.
    free: Vec<usize>,
    /// The slot of each read in flight or waiting for delivery (`usize::MAX`: neither).
    slot_of: Vec<usize>,
    /// The first read not yet queued.
    next: usize,
    in_flight: usize,
}

impl Stream<'_> {
    /// Queues reads until the window or the free slots run out; a read that cannot be
    /// queued (unaligned, unknown file) fails alone at once.
    fn fill(&mut self, ring: &mut Ring, staging: &StagingBuffer, done: &mut dyn FnMut(usize, Result<&[u8]>)) {
        while self.next < self.reads.len() && self.in_flight < self.window {
            let Some(&slot) = self.free.last() else { break };
            let (i, read) = (self.next, &self.reads[self.next]);
            self.next += 1;
            let request = read.request(slot * self.slot_bytes);
            let Some(file) = self.files.get(read.file) else {
                done(i, Err(no_such_file(read.file)));
                continue;
            };
            if let Err(e) = check_aligned(&request, staging) {
                done(i, Err(e));
                continue;
            }
            self.free.pop();
            self.slot_of[i] = slot;
            let ptr = self.base.wrapping_add(request.buffer_offset);
            let entry = opcode::Read::new(types::Fd(file.as_raw_fd()), ptr, read.len as u32)
                .offset(read.offset)
                .build()
                .user_data(i as u64);
            // SAFETY: the slot lies inside `staging` (checked above) and no other read in
            // flight or awaiting delivery uses it. `staging` outlives the read: it is returned
            // only after every read of the call was reaped, or quarantined. The file is
            // borrowed for the call and io_uring holds its own reference while reading.
            unsafe { ring.push(&entry) };
            self.in_flight += 1;
        }
    }

    /// Hands read `i`'s bytes (or its error) to `done` and frees its slot.
    fn deliver(&mut self, i: usize, result: i32, done: &mut dyn FnMut(usize, Result<&[u8]>)) {
        let read = &self.reads[i];
        let slot = std::mem::replace(&mut self.slot_of[i], usize::MAX);
        let bytes = completion(IoKind::Read, read.block, read.len, result).map(|()| {
            // SAFETY: read `i` completed (its completion was reaped), so the kernel no longer
            // writes its slot, and the slot is not queued again before `done` returns (it goes
            // back to `free` after). Slots are disjoint ranges inside the staging buffer.
            unsafe { std::slice::from_raw_parts(self.base.wrapping_add(slot * self.slot_bytes).cast_const(), read.len) }
        });
        done(i, bytes);
        self.free.push(slot);
    }
}

/// The result of a completed request of `len` bytes from the kernel's `result`.
fn completion(kind: IoKind, block: Option<BlockId>, len: usize, result: i32) -> Result<()> {
    let op = if kind == IoKind::Read { "read" } else { "write" };
    match result {
        n if n >= 0 && n as usize == len => Ok(()),
        n if n >= 0 => Err(Error::Io {
            op,
            block,
            kind: std::io::ErrorKind::UnexpectedEof,
            message: format!("short {op}: {n} of {len} bytes"),
        }),
        n => Err(Error::io(op, block, &std::io::Error::from_raw_os_error(-n))),
    }
}

/// The error of a call that found the shared ring broken by another thread's timeout, while
/// that thread still held it.
fn abandoned() -> Error {
    Error::Timeout { op: "io_uring call (the shared ring was abandoned after a timeout)", limit_ms: 0 }
}

impl UringIo {
    /// A backend keeping up to 64 requests in flight, or the error that says io_uring is
    /// unavailable (old kernel, seccomp, sysctl).
    pub fn new() -> std::io::Result<Self> {
        Self::with_depth(64)
    }

    /// A backend keeping up to `depth` requests in flight (clamped to 1..=256).
    pub fn with_depth(depth: usize) -> std::io::Result<Self> {
        let shared = Ring::new(false)?; // proves io_uring is usable here
        let depth = depth.clamp(1, RING_ENTRIES as usize);
        Ok(Self {
            rings: Mutex::new(vec![(None, Arc::new(Mutex::new(shared)))]),
            own_rings: AtomicBool::new(true),
            depth,
        })
    }

    /// The calling thread's ring: its own (made on first use) or the shared one. A ring left
    /// broken by a timeout is replaced first.
    fn ring(&self) -> std::io::Result<Arc<Mutex<Ring>>> {
        let me = std::thread::current().id();
        let mut rings = self.rings.lock();
        let position = match rings.iter().position(|(owner, _)| *owner == Some(me)) {
            Some(position) => Some(position),
            // Relaxed: a hint read and written under the `rings` lock.
            None if rings.len() <= MAX_THREAD_RINGS && self.own_rings.load(Ordering::Relaxed) => {
                match Ring::new(true) {
                    Ok(ring) => {
                        rings.push((Some(me), Arc::new(Mutex::new(ring))));
                        Some(rings.len() - 1)
                    }
                    Err(_) => {
                        // An older kernel refuses single-issuer rings: every thread shares.
                        self.own_rings.store(false, Ordering::Relaxed);
                        None
                    }
                }
            }
            None => None,
        };
        let position = position.unwrap_or(0);
        let (owner, ring) = &mut rings[position];
        // A thread's own ring is locked by that thread alone, so this never waits for it; the
        // shared ring is replaced only when no call holds it.
        if ring.try_lock().is_some_and(|r| r.broken) {
            *ring = Arc::new(Mutex::new(Ring::new(owner.is_some())?));
        }
        Ok(Arc::clone(ring))
    }
}

impl IoBackend for UringIo {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn submit(&self, file: &File, requests: &[IoRequest], staging: StagingBuffer, timeout: Duration) -> IoOutcome {
        match self.ring() {
            Ok(ring) => match ring.lock() {
                ring if ring.broken => (Some(staging), requests.iter().map(|_| Err(abandoned())).collect()),
                mut ring => ring.submit(self.depth, file, requests, staging, timeout),
            },
            Err(e) => (Some(staging), requests.iter().map(|r| Err(Error::io("io_uring setup", r.block, &e))).collect()),
        }
    }

    fn read_stream(
        &self,
        files: &[&File],
        reads: &[StreamRead],
        staging: StagingBuffer,
        timeout: Duration,
        done: &mut dyn FnMut(usize, Result<&[u8]>),
    ) -> Option<StagingBuffer> {
        match self.ring() {
            Ok(ring) => match ring.lock() {
                ring if ring.broken => {
                    (0..reads.len()).for_each(|i| done(i, Err(abandoned())));
                    Some(staging)
                }
                mut ring => ring.read_stream(self.depth, files, reads, staging, timeout, done),
            },
            Err(e) => {
                reads.iter().enumerate().for_each(|(i, r)| done(i, Err(Error::io("io_uring setup", r.block, &e))));
                Some(staging)
            }
        }
    }
}
