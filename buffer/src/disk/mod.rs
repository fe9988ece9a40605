//! The Disk tier: block slots in segment files, read and written in batches through an
//! [`IoBackend`] (io_uring by default, `pread`/`pwrite` when io_uring is unavailable) with
//! `O_DIRECT` and page-aligned staging buffers.
//!
//! Every block written carries a crc32c (kept per slot with the id of the block written);
//! a read whose bytes do not match is [`Error::Corrupt`] and its bytes are never handed out.

mod backend;
#[cfg(target_os = "linux")]
mod uring;

pub use backend::{
    check_aligned, FaultPlan, FaultyIo, IoBackend, IoKind, IoOutcome, IoRequest, PreadIo, StagingBuffer, StreamRead,
    DIRECT_IO_ALIGN,
};
#[cfg(target_os = "linux")]
pub use uring::{UringIo, MAX_THREAD_RINGS};

use crate::{BlockId, Error, Result, Tier};
use parking_lot::{Mutex, RwLock};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Which I/O backend the Disk tier uses.
#[derive(Clone, Default)]
pub enum IoChoice {
    /// io_uring if it can be set up, else `pread`/`pwrite` (said once on stderr).
    #[default]
    Auto,
    /// `pread`/`pwrite` only.
    Pread,
    /// A backend given by the caller (tests: [`FaultyIo`]).
    Custom(Arc<dyn IoBackend>),
}

impl std::fmt::Debug for IoChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IoChoice::Auto => f.write_str("Auto"),
            IoChoice::Pread => f.write_str("Pread"),
            IoChoice::Custom(b) => write!(f, "Custom({})", b.name()),
        }
    }
}

/// Settings of the Disk tier.
#[derive(Debug, Clone)]
pub struct DiskConfig {
    /// Folder of the segment files (created if missing).
    pub dir: PathBuf,
    /// Most blocks the tier holds.
    pub capacity_blocks: usize,
    /// Block slots per segment file.
    pub segment_blocks: usize,
    /// Blocks per staging buffer: most blocks of one write batch (one backend call), and the
    /// slots a read call cycles through (at least `queue_depth` of them keep the queue full
    /// while completed blocks are checked and delivered).
    pub batch_blocks: usize,
    /// Requests kept in flight (io_uring backend).
    pub queue_depth: usize,
    /// Bound on one batch.
    pub timeout: Duration,
    /// Open segments with `O_DIRECT` (falls back to buffered I/O, said once, if refused).
    pub direct: bool,
    /// The backend.
    pub io: IoChoice,
    /// Delete the segment files when the tier is dropped (spill files of a non-durable engine).
    pub remove_on_drop: bool,
}

impl DiskConfig {
    /// Defaults for `dir`: 1 Mi blocks, 16 Ki blocks per segment, batches of up to 512 blocks
    /// with 64 in flight, 5 s bound,
    /// `O_DIRECT`, automatic backend, files removed on drop.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            capacity_blocks: 1 << 20,
            segment_blocks: 1 << 14,
            batch_blocks: 512,
            queue_depth: 64,
            timeout: Duration::from_secs(5),
            direct: true,
            io: IoChoice::Auto,
            remove_on_drop: true,
        }
    }
}

struct SlotAllocator {
    free: Vec<u32>,
    next_fresh: u32,
}

/// Block slots in segment files (see the module docs).
pub struct DiskTier {
    config: DiskConfig,
    block_bytes: usize,
    slot_bytes: usize,
    segments: RwLock<Vec<(Arc<File>, PathBuf)>>,
    slots: Mutex<SlotAllocator>,
    used: AtomicU64,
    crcs: Box<[AtomicU32]>,
    owners: Box<[AtomicU64]>,
    backend: Arc<dyn IoBackend>,
    staging: Mutex<Vec<StagingBuffer>>,
    direct: std::sync::atomic::AtomicBool,
}

fn say_once(once: &'static std::sync::Once, message: impl FnOnce() -> String) {
    once.call_once(|| eprintln!("attnstore-buffer: {}", message()));
}

impl DiskTier {
    /// A Disk tier for blocks of `block_bytes` (rounded up to [`DIRECT_IO_ALIGN`] per slot).
    pub fn open(config: DiskConfig, block_bytes: usize) -> Result<Self> {
        for (what, got) in
            [("disk capacity_blocks", config.capacity_blocks), ("disk segment_blocks", config.segment_blocks)]
        {
            if got == 0 || got >= u32::MAX as usize {
                return Err(Error::BadConfig { what, expected: "in 1..2^32-1", got: got as u64 });
            }
        }
        if config.batch_blocks == 0 || config.batch_blocks > 4096 {
            return Err(Error::BadConfig {
                what: "disk batch_blocks",
                expected: "in 1..=4096",
                got: config.batch_blocks as u64,
            });
        }
        std::fs::create_dir_all(&config.dir).map_err(|e| Error::io("create dir", None, &e))?;
        let backend: Arc<dyn IoBackend> = match &config.io {
            IoChoice::Custom(backend) => Arc::clone(backend),
            IoChoice::Pread => Arc::new(PreadIo),
            IoChoice::Auto => auto_backend(config.queue_depth),
        };
        let slot_bytes = block_bytes.next_multiple_of(DIRECT_IO_ALIGN);
        let capacity = config.capacity_blocks;
        Ok(Self {
            block_bytes,
            slot_bytes,
            segments: RwLock::new(Vec::new()),
            slots: Mutex::new(SlotAllocator { free: Vec::new(), next_fresh: 0 }),
            used: AtomicU64::new(0),
            crcs: (0..capacity).map(|_| AtomicU32::new(0)).collect(),
            owners: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
            backend,
            staging: Mutex::new(Vec::new()),
            direct: std::sync::atomic::AtomicBool::new(config.direct),
            config,
        })
    }

    /// The backend's name (`io_uring`, `pread`, ...).
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// Whether segment files are opened with `O_DIRECT`.
    pub fn is_direct(&self) -> bool {
        self.direct.load(Ordering::Relaxed)
    }

    /// Capacity in blocks.
    pub fn capacity_blocks(&self) -> usize {
        self.config.capacity_blocks
    }

    /// Slots in use.
    pub fn used_blocks(&self) -> usize {
        self.used.load(Ordering::Relaxed) as usize
    }

    /// Bytes a slot takes in a segment file.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// A free slot, or [`Error::TierFull`].
    pub fn alloc_slot(&self) -> Result<u32> {
        let mut slots = self.slots.lock();
        let slot = match slots.free.pop() {
            Some(slot) => slot,
            None if (slots.next_fresh as usize) < self.config.capacity_blocks => {
                let slot = slots.next_fresh;
                self.ensure_segment(slot as usize / self.config.segment_blocks)?;
                slots.next_fresh += 1;
                slot
            }
            None => return Err(Error::TierFull { tier: Tier::Disk, capacity_blocks: self.config.capacity_blocks }),
        };
        self.used.fetch_add(1, Ordering::Relaxed);
        Ok(slot)
    }

    /// Returns `slot` to the free list; its bytes are no longer served.
    pub fn free_slot(&self, slot: u32) {
        self.owners[slot as usize].store(0, Ordering::Relaxed);
        self.slots.lock().free.push(slot);
        self.used.fetch_sub(1, Ordering::Relaxed);
    }

    /// Segment file and byte offset of `slot` (for tools and corruption tests).
    pub fn slot_location(&self, slot: u32) -> (PathBuf, u64) {
        let (segment, offset) = self.place(slot);
        (self.segments.read()[segment].1.clone(), offset)
    }

    /// The segment index and byte offset in it of `slot`.
    fn place(&self, slot: u32) -> (usize, u64) {
        let segment_blocks = self.config.segment_blocks;
        (slot as usize / segment_blocks, ((slot as usize % segment_blocks) * self.slot_bytes) as u64)
    }

    fn ensure_segment(&self, segment: usize) -> Result<()> {
        let mut segments = self.segments.write();
        while segments.len() <= segment {
            let path = self.config.dir.join(format!("segment-{:05}.blocks", segments.len()));
            let file = self.open_segment(&path)?;
            file.set_len((self.config.segment_blocks * self.slot_bytes) as u64)
                .map_err(|e| Error::io("size segment", None, &e))?;
            segments.push((Arc::new(file), path));
        }
        Ok(())
    }

    fn open_segment(&self, path: &Path) -> Result<File> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut options = File::options();
        options.read(true).write(true).create(true).truncate(true);
        if self.is_direct() {
            let mut direct = options.clone();
            direct.custom_flags(libc::O_DIRECT);
            match direct.open(path) {
                Ok(file) => return Ok(file),
                Err(e) => {
                    static ONCE: std::sync::Once = std::sync::Once::new();
                    say_once(&ONCE, || format!("O_DIRECT refused for {} ({e}); using buffered I/O", path.display()));
                    self.direct.store(false, Ordering::Relaxed);
                }
            }
        }
        options.open(path).map_err(|e| Error::io("open segment", None, &e))
    }

    fn staging(&self) -> Result<StagingBuffer> {
        match self.staging.lock().pop() {
            Some(buffer) => Ok(buffer),
            None => StagingBuffer::new(self.config.batch_blocks * self.slot_bytes),
        }
    }

    fn give_back(&self, staging: Option<StagingBuffer>) {
        if let Some(buffer) = staging {
            self.staging.lock().push(buffer);
        }
    }

    /// Groups `slots` (with their positions in the caller's list) per segment and batch.
    fn batches(&self, slots: impl Iterator<Item = u32>) -> Vec<(usize, Vec<(usize, u32)>)> {
        let mut by_segment: Vec<(usize, Vec<(usize, u32)>)> = Vec::new();
        for (i, slot) in slots.enumerate() {
            let (segment, _) = self.place(slot);
            match by_segment.iter_mut().find(|(s, items)| *s == segment && items.len() < self.config.batch_blocks) {
                Some((_, items)) => items.push((i, slot)),
                None => by_segment.push((segment, vec![(i, slot)])),
            }
        }
        by_segment
    }

    /// The write of `block` into `slot` from staging position `position`.
    fn write_request(&self, slot: u32, position: usize, block: BlockId) -> IoRequest {
        IoRequest {
            kind: IoKind::Write,
            offset: self.place(slot).1,
            buffer_offset: position * self.slot_bytes,
            len: self.slot_bytes,
            block: Some(block),
        }
    }

    /// Writes blocks (`slot`, `block`, payload of at most `block_bytes`, zero-padded) in batches;
    /// one result per item. A slot whose write failed serves nothing.
    pub fn write_blocks(&self, items: &[(u32, BlockId, &[u8])]) -> Vec<Result<()>> {
        let mut results: Vec<Result<()>> = vec![Ok(()); items.len()];
        for (segment, batch) in self.batches(items.iter().map(|i| i.0)) {
            let mut staging = match self.staging() {
                Ok(s) => s,
                Err(e) => {
                    batch.iter().for_each(|&(i, _)| results[i] = Err(e.clone()));
                    continue;
                }
            };
            let mut crcs = Vec::with_capacity(batch.len());
            let requests: Vec<IoRequest> = batch
                .iter()
                .enumerate()
                .map(|(position, &(i, slot))| {
                    let (_, block, payload) = items[i];
                    let out = &mut staging.bytes_mut()[position * self.slot_bytes..][..self.slot_bytes];
                    let n = payload.len().min(self.block_bytes);
                    out[..n].copy_from_slice(&payload[..n]);
                    out[n..].fill(0);
                    crcs.push(crc32c::crc32c(&out[..self.block_bytes]));
                    self.owners[slot as usize].store(0, Ordering::Relaxed); // not served while in flight
                    self.write_request(slot, position, block)
                })
                .collect();
            let segments = self.segments.read();
            let (staging, outcome) = self.backend.submit(&segments[segment].0, &requests, staging, self.config.timeout);
            drop(segments);
            self.give_back(staging);
            for ((&(i, slot), result), crc) in batch.iter().zip(outcome).zip(crcs) {
                if result.is_ok() {
                    self.crcs[slot as usize].store(crc, Ordering::Relaxed);
                    self.owners[slot as usize].store(items[i].1 .0, Ordering::Relaxed);
                }
                results[i] = result;
            }
        }
        results
    }

    /// Reads blocks (`slot`, `block`) and calls `deliver(i, bytes)` for each item whose bytes
    /// are intact, in completion order; returns one result per item (`Corrupt` on a checksum
    /// mismatch). All items go to the backend as one stream ([`IoBackend::read_stream`]), so
    /// the device stays busy while earlier blocks are checked and delivered.
    pub fn read_blocks(&self, items: &[(u32, BlockId)], mut deliver: impl FnMut(usize, &[u8])) -> Vec<Result<()>> {
        let mut results: Vec<Result<()>> = vec![Ok(()); items.len()];
        if items.is_empty() {
            return results;
        }
        let staging = match self.staging() {
            Ok(s) => s,
            Err(e) => return vec![Err(e); items.len()],
        };
        // The segment files are shared for the call, so no lock is held while reading.
        let files: Vec<Arc<File>> = self.segments.read().iter().map(|(file, _)| Arc::clone(file)).collect();
        let file_refs: Vec<&File> = files.iter().map(|f| &**f).collect();
        let reads: Vec<StreamRead> = items
            .iter()
            .map(|&(slot, block)| {
                let (file, offset) = self.place(slot);
                StreamRead { file, offset, len: self.slot_bytes, block: Some(block) }
            })
            .collect();
        let staging = self.backend.read_stream(&file_refs, &reads, staging, self.config.timeout, &mut |i, read| {
            let (slot, block) = items[i];
            results[i] = read.and_then(|bytes| {
                if self.owners[slot as usize].load(Ordering::Relaxed) != block.0 {
                    return Err(Error::Missing { block, reason: "its disk slot holds no intact copy" });
                }
                let bytes = &bytes[..self.block_bytes];
                let (expected_crc, got_crc) = (self.crcs[slot as usize].load(Ordering::Relaxed), crc32c::crc32c(bytes));
                if expected_crc != got_crc {
                    return Err(Error::Corrupt { block, expected_crc, got_crc });
                }
                deliver(i, bytes);
                Ok(())
            });
        });
        self.give_back(staging);
        results
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        if self.config.remove_on_drop {
            for (_, path) in self.segments.get_mut().drain(..) {
                // Best effort: a file left behind is garbage, not a correctness problem.
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

fn auto_backend(queue_depth: usize) -> Arc<dyn IoBackend> {
    #[cfg(target_os = "linux")]
    match UringIo::with_depth(queue_depth) {
        Ok(ring) => return Arc::new(ring),
        Err(e) => {
            static ONCE: std::sync::Once = std::sync::Once::new();
            say_once(&ONCE, || format!("io_uring unavailable ({e}); falling back to pread/pwrite"));
        }
    }
    Arc::new(PreadIo)
}
