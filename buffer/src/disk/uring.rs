//! The io_uring backend: a batch of reads or writes is pushed to one submission queue and
//! submitted with a single system call; completions are awaited with a kernel timeout
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
    /// A ring, or the error that says io_uring is unavailable (old kernel, seccomp, sysctl).
    pub fn new() -> std::io::Result<Self> {
        let ring = IoUring::new(RING_ENTRIES)?;
        Ok(Self { ring: Mutex::new(Ring { ring, quarantine: Vec::new(), broken: false }) })
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
        for chunk in valid.chunks(RING_ENTRIES as usize) {
            for &i in chunk {
                let r = &requests[i];
                let ptr = base.wrapping_add(r.buffer_offset);
                let entry = match r.kind {
                    IoKind::Read => opcode::Read::new(fd, ptr, r.len as u32).offset(r.offset).build(),
                    IoKind::Write => opcode::Write::new(fd, ptr, r.len as u32).offset(r.offset).build(),
                }
                .user_data(i as u64);
                // SAFETY: `ptr..ptr+len` lies inside `staging` (checked by `check_aligned`), which
                // outlives the operation: it is returned only after every completion of this
                // batch was reaped, or kept in the quarantine forever after a timeout. The file
                // descriptor is borrowed for the call and io_uring holds its own file reference.
                // The chunk is at most the ring's size, and the queue is empty between batches.
                let pushed = unsafe { ring.ring.submission().push(&entry) };
                pushed.expect("a chunk of at most RING_ENTRIES fits an empty submission queue");
            }
            let mut outstanding = chunk.len();
            while outstanding > 0 {
                let left = deadline.saturating_duration_since(Instant::now());
                let ts = types::Timespec::new().sec(left.as_secs()).nsec(left.subsec_nanos());
                let args = types::SubmitArgs::new().timespec(&ts);
                match ring.ring.submitter().submit_with_args(1, &args) {
                    Ok(_) => {}
                    Err(e) if e.raw_os_error() == Some(libc::EINTR) || e.raw_os_error() == Some(libc::EBUSY) => {}
                    Err(e) if e.raw_os_error() == Some(libc::ETIME) => {}
                    Err(e) => {
                        // Submission itself failed: nothing of this chunk is in flight unless some
                        // entries were consumed; treat the ring as unusable to be safe.
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
                    outstanding -= 1;
                }
                if outstanding > 0 && Instant::now() >= deadline {
                    ring.broken = true;
                    ring.quarantine.push(staging);
                    // Unreaped and unsubmitted requests keep their "timed out" result.
                    return (None, results);
                }
            }
        }
        (Some(staging), results)
    }
}
