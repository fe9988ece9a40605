//! The io_uring backend: the requests of a call are kept in flight in a sliding window of up
//! to `depth` (one system call submits new ones and waits for the next completion); completions are awaited with a kernel timeout
//! (`IORING_ENTER_EXT_ARG`), so no wait is unbounded. If a batch times out, the staging
//! buffer stays with the ring (quarantined, never reused or freed) because the kernel may
//! still write into it.

#![allow(unsafe_code)] // pushing submission entries that point at the staging buffer

use super::backend::{check_aligned, IoBackend, IoKind, IoOutcome, IoRequest, StagingBuffer};
use crate::{Error, Result};
use io_uring::{opcode, types, IoUring};
use parking_lot::Mutex;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

const RING_ENTRIES: u32 = 256;

/// io_uring with one ring shared under a mutex (a batch holds it from submit to last completion).
pub struct UringIo {
    ring: Mutex<Ring>,
    depth: usize,
}

struct Ring {
    ring: IoUring,
    /// Buffers of timed-out batches: the kernel may still write into them, so they are kept.
    quarantine: Vec<StagingBuffer>,
    /// A ring whose batch timed out has completions outstanding that would be mistaken for a
    /// later batch's: it is not used again (later batches fail fast with a typed error).
    broken: bool,
}

impl UringIo {
    /// A ring keeping up to 64 requests in flight, or the error that says io_uring is
    /// unavailable (old kernel, seccomp, sysctl).
    pub fn new() -> std::io::Result<Self> {
        Self::with_depth(64)
    }

    /// A ring keeping up to `depth` requests in flight (clamped to 1..=256).
    pub fn with_depth(depth: usize) -> std::io::Result<Self> {
        let ring = IoUring::new(RING_ENTRIES)?;
        let depth = depth.clamp(1, RING_ENTRIES as usize);
        Ok(Self { ring: Mutex::new(Ring { ring, quarantine: Vec::new(), broken: false }), depth })
    }
}

impl IoBackend for UringIo {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn submit(&self, file: &File, requests: &[IoRequest], mut staging: StagingBuffer, timeout: Duration) -> IoOutcome {
        let pending = Error::Timeout { op: "io_uring batch", limit_ms: timeout.as_millis() as u64 };
        // Until its completion is reaped, a valid request's result is "timed out".
        let mut results: Vec<Result<()>> =
            requests.iter().map(|r| check_aligned(r, &staging).and(Err(pending.clone()))).collect();
        let valid: Vec<usize> =
            requests.iter().enumerate().filter(|(_, r)| check_aligned(r, &staging).is_ok()).map(|(i, _)| i).collect();
        let mut ring = self.ring.lock();
        if ring.broken {
            let err = Err(Error::Timeout { op: "io_uring batch (ring abandoned after a timeout)", limit_ms: 0 });
            return (Some(staging), requests.iter().map(|_| err.clone()).collect());
        }
        let deadline = Instant::now() + timeout;
        let fd = types::Fd(file.as_raw_fd());
        let base = staging.bytes_mut().as_mut_ptr();
        // A sliding window: keep up to `depth` requests in flight, refilling as completions
        // arrive, so the device queue never drains between groups of requests.
        // Refill and reap in groups of a quarter of the window: one system call per group
        // instead of one per request, while the device still sees 3/4 of the depth or more.
        let group = (self.depth / 4).max(1);
        let mut next = 0;
        let mut in_flight = 0;
        while next < valid.len() || in_flight > 0 {
            while next < valid.len() && in_flight < self.depth {
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
                // was reaped, or kept in the quarantine forever after a timeout. The file
                // descriptor is borrowed for the call and io_uring holds its own file reference.
                // At most `depth <= RING_ENTRIES` entries are queued or in flight, so it fits.
                let pushed = unsafe { ring.ring.submission().push(&entry) };
                pushed.expect("at most RING_ENTRIES requests in flight fit the submission queue");
                next += 1;
                in_flight += 1;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let ts = types::Timespec::new().sec(left.as_secs()).nsec(left.subsec_nanos());
            let args = types::SubmitArgs::new().timespec(&ts);
            let want = group.min(in_flight);
            match ring.ring.submitter().submit_with_args(want.max(1), &args) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EBUSY | libc::ETIME)) => {}
                Err(e) => {
                    // The kernel refused the submission: whatever is in flight may still complete
                    // into the buffer, so keep it and stop using the ring.
                    ring.broken = true;
                    ring.quarantine.push(staging);
                    let err = Error::io("io_uring submit", None, &e);
                    for &i in &valid {
                        if results[i] == Err(pending.clone()) {
                            results[i] = Err(err.clone());
                        }
                    }
                    return (None, results);
                }
            }
            for cqe in ring.ring.completion() {
                let i = cqe.user_data() as usize;
                let r = &requests[i];
                let op = if r.kind == IoKind::Read { "read" } else { "write" };
                results[i] = match cqe.result() {
                    n if n >= 0 && n as usize == r.len => Ok(()),
                    n if n >= 0 => Err(Error::Io {
                        op,
                        block: r.block,
                        kind: std::io::ErrorKind::UnexpectedEof,
                        message: format!("short {op}: {n} of {} bytes", r.len),
                    }),
                    n => Err(Error::io(op, r.block, &std::io::Error::from_raw_os_error(-n))),
                };
                in_flight -= 1;
            }
            if in_flight > 0 && Instant::now() >= deadline {
                ring.broken = true;
                ring.quarantine.push(staging);
                // Unreaped and unsubmitted requests keep their "timed out" result.
                return (None, results);
            }
        }
        (Some(staging), results)
    }
}
