//! Streamed reads of the Disk tier: every read is delivered exactly once with its own bytes,
//! whatever the order of completions, the number of files, the number of staging slots or
//! the number of threads; bad reads fail alone with typed errors.

use attnstore_buffer::disk::{
    DiskTier, IoBackend, PreadIo, StagingBuffer, StreamRead, UringIo, DIRECT_IO_ALIGN, MAX_THREAD_RINGS,
};
use attnstore_buffer::{BlockId, DiskConfig, Error};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Duration;

fn tempdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("attnstore-stream-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The byte at `offset` of file `file`: every 512-byte sector differs from every other.
fn byte(file: usize, offset: u64) -> u8 {
    (file as u64 * 97 + offset / 512 * 31 + offset % 251) as u8
}

/// `n` files of `sectors` sectors each, filled by [`byte`].
fn files(dir: &std::path::Path, n: usize, sectors: u64) -> Vec<File> {
    (0..n)
        .map(|f| {
            let path = dir.join(format!("f{f}"));
            let bytes: Vec<u8> = (0..sectors * 512).map(|o| byte(f, o)).collect();
            std::fs::write(&path, bytes).unwrap();
            File::open(path).unwrap()
        })
        .collect()
}

fn backends() -> Vec<Box<dyn IoBackend>> {
    vec![Box::new(PreadIo), Box::new(UringIo::with_depth(8).expect("io_uring on this kernel"))]
}

#[test]
fn every_read_is_delivered_once_with_its_own_bytes_across_files_and_few_slots() {
    let dir = tempdir("once");
    let files = files(&dir, 3, 64);
    let refs: Vec<&File> = files.iter().collect();
    // 300 reads of one or two sectors, hopping between files, through the four 1 KiB slots of
    // a one-page buffer: each slot is reused ~75 times, and the window (8) exceeds the slots.
    let mut seed = 7u64;
    let reads: Vec<StreamRead> = (0..300)
        .map(|i| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let sectors = 1 + (seed >> 60) % 2;
            StreamRead {
                file: (seed >> 33) as usize % 3,
                offset: (seed >> 40) % 63 * 512,
                len: sectors as usize * 512,
                block: Some(BlockId::from_raw(i)),
            }
        })
        .collect();
    for backend in backends() {
        let mut seen = vec![0u32; reads.len()];
        let staging = StagingBuffer::new(4096).unwrap();
        let staging = backend.read_stream(&refs, &reads, staging, Duration::from_secs(5), &mut |i, bytes| {
            seen[i] += 1;
            let r = &reads[i];
            let bytes = bytes.unwrap_or_else(|e| panic!("{} read {i}: {e}", backend.name()));
            assert_eq!(bytes.len(), r.len);
            for (k, &b) in bytes.iter().enumerate() {
                assert_eq!(b, byte(r.file, r.offset + k as u64), "{} read {i} byte {k}", backend.name());
            }
        });
        assert!(staging.is_some(), "{}: nothing timed out, the buffer comes back", backend.name());
        assert!(seen.iter().all(|&n| n == 1), "{}: each read delivered once: {seen:?}", backend.name());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_reads_fail_alone_and_a_staging_buffer_without_room_fails_all() {
    let dir = tempdir("bad");
    let files = files(&dir, 1, 8);
    let refs: Vec<&File> = files.iter().collect();
    let read = |file, offset, len| StreamRead { file, offset, len, block: None };
    let reads = [read(0, 512, 512), read(0, 100, 512), read(5, 0, 512), read(0, 0, 700), read(0, 3584, 512)];
    for backend in backends() {
        let mut got: Vec<Option<Result<Vec<u8>, Error>>> = vec![None; reads.len()];
        let staging = StagingBuffer::new(4096).unwrap();
        let staging = backend.read_stream(&refs, &reads, staging, Duration::from_secs(5), &mut |i, bytes| {
            assert!(got[i].is_none(), "read {i} delivered twice");
            got[i] = Some(bytes.map(<[u8]>::to_vec));
        });
        assert!(staging.is_some());
        let name = backend.name();
        assert_eq!(got[0], Some(Ok((512..1024).map(|o| byte(0, o)).collect())), "{name}");
        assert_eq!(got[1], Some(Err(Error::Unaligned { what: "offset", expected_multiple: 512, got: 100 })), "{name}");
        assert!(matches!(got[2], Some(Err(Error::BadConfig { got: 5, .. }))), "{name}: {:?}", got[2]);
        assert_eq!(got[3], Some(Err(Error::Unaligned { what: "length", expected_multiple: 512, got: 700 })), "{name}");
        assert_eq!(got[4], Some(Ok((3584..4096).map(|o| byte(0, o)).collect())), "{name}");

        // The longest read (rounded to a sector) must fit the buffer once.
        let long = [read(0, 0, 512), read(0, 0, 3 * DIRECT_IO_ALIGN * 4096)];
        let mut errors = Vec::new();
        let staging = StagingBuffer::new(4096).unwrap();
        let back = backend.read_stream(&refs, &long, staging, Duration::from_secs(5), &mut |i, bytes| {
            errors.push((i, bytes.err()));
        });
        assert!(back.is_some());
        let expected = Error::WrongLength { expected: 4096, got: 3 * 512 * 4096 };
        assert_eq!(errors, vec![(0, Some(expected.clone())), (1, Some(expected))], "{name}");
        // No reads: nothing delivered, the buffer comes back.
        let back =
            backend.read_stream(&refs, &[], StagingBuffer::new(4096).unwrap(), Duration::from_secs(1), &mut |_, _| {
                panic!("nothing to deliver")
            });
        assert!(back.is_some());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn threads_beyond_the_own_ring_limit_read_byte_exact_through_one_disk_tier() {
    let dir = tempdir("threads");
    let mut config = DiskConfig::new(dir.join("tier"));
    config.capacity_blocks = 4096;
    config.segment_blocks = 512; // eight segment files
    config.batch_blocks = 96;
    let disk = DiskTier::open(config, 2048).unwrap();
    assert_eq!(disk.backend_name(), "io_uring");
    let slots: Vec<u32> = (0..4096).map(|_| disk.alloc_slot().unwrap()).collect();
    let payload = |slot: u32| -> Vec<u8> { (0..2048).map(|k| (slot as usize * 13 + k * 3 + (k >> 9)) as u8).collect() };
    for chunk in slots.chunks(256) {
        let bytes: Vec<Vec<u8>> = chunk.iter().map(|&s| payload(s)).collect();
        let items: Vec<_> =
            chunk.iter().zip(&bytes).map(|(&s, b)| (s, BlockId::from_raw(u64::from(s) + 1), &b[..])).collect();
        assert!(disk.write_blocks(&items).iter().all(Result::is_ok));
    }
    // More threads than get a ring of their own: the later ones share one.
    let threads = MAX_THREAD_RINGS + 4;
    std::thread::scope(|scope| {
        for t in 0..threads {
            let (disk, slots) = (&disk, &slots);
            scope.spawn(move || {
                for round in 0..3 {
                    // Each thread reads a different, strided order over all segments.
                    let order: Vec<u32> =
                        (0..slots.len()).map(|k| slots[(k * (2 * t + 1) + round * 977) % slots.len()]).collect();
                    let items: Vec<_> = order.iter().map(|&s| (s, BlockId::from_raw(u64::from(s) + 1))).collect();
                    let mut delivered = vec![false; items.len()];
                    let results = disk.read_blocks(&items, |i, bytes| {
                        assert!(!delivered[i], "thread {t}: item {i} delivered twice");
                        delivered[i] = true;
                        assert_eq!(bytes, &payload(items[i].0)[..], "thread {t}: slot {}", items[i].0);
                    });
                    assert!(results.iter().all(Result::is_ok), "thread {t}: {:?}", results.iter().find(|r| r.is_err()));
                    assert!(delivered.iter().all(|&d| d), "thread {t}: every item delivered");
                }
            });
        }
    });
    // A block whose bytes changed on disk is refused in a long stream, its neighbours are not.
    let (path, offset) = disk.slot_location(slots[1000]);
    let file = File::options().write(true).open(path).unwrap();
    file.write_all_at(&[0xAB; 8], offset + 100).unwrap();
    drop(file);
    let items: Vec<_> = slots.iter().map(|&s| (s, BlockId::from_raw(u64::from(s) + 1))).collect();
    let results = disk.read_blocks(&items, |i, bytes| assert_eq!(bytes, &payload(items[i].0)[..]));
    for (i, result) in results.iter().enumerate() {
        match (i, result) {
            (1000, Err(Error::Corrupt { block, .. })) => assert_eq!(*block, items[1000].1),
            (1000, other) => panic!("the changed block must be refused, got {other:?}"),
            (_, other) => assert_eq!(other, &Ok(()), "item {i}"),
        }
    }
    drop(disk);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_read_that_never_completes_times_out_and_the_next_call_gets_a_fresh_ring() {
    let dir = tempdir("timeout");
    let files = files(&dir, 1, 8);
    // A pipe nobody writes to: a read of it stays in flight until the timeout.
    let (reader, _writer) = std::io::pipe().unwrap();
    let pipe = File::from(std::os::fd::OwnedFd::from(reader));
    let refs: Vec<&File> = vec![&files[0], &pipe];
    let reads = [
        StreamRead { file: 0, offset: 0, len: 512, block: None },
        StreamRead { file: 1, offset: 0, len: 512, block: Some(BlockId::from_raw(9)) },
        StreamRead { file: 0, offset: 1024, len: 512, block: None },
    ];
    let backend = UringIo::with_depth(4).unwrap();
    let started = std::time::Instant::now();
    let mut got: Vec<Option<Result<(), Error>>> = vec![None; 3];
    let staging = StagingBuffer::new(4096).unwrap();
    let back = backend.read_stream(&refs, &reads, staging, Duration::from_millis(200), &mut |i, bytes| {
        assert!(got[i].is_none(), "read {i} delivered twice");
        got[i] =
            Some(bytes.map(|b| assert_eq!(b, &(0..512).map(|o| byte(0, reads[i].offset + o)).collect::<Vec<_>>()[..])));
    });
    assert!(back.is_none(), "a read may still complete into the buffer: the backend keeps it");
    assert!(started.elapsed() < Duration::from_secs(5), "the wait is bounded by the timeout");
    assert_eq!(got[0], Some(Ok(())));
    assert_eq!(got[1], Some(Err(Error::Timeout { op: "io_uring read", limit_ms: 200 })));
    assert_eq!(got[2], Some(Ok(())));

    // The same for a batch, then both kinds of call work again on this thread.
    let request = |offset| StreamRead { offset, ..reads[0] }.request(offset as usize);
    let pipe_request = reads[1].request(0);
    let (back, results) =
        backend.submit(&pipe, &[pipe_request], StagingBuffer::new(4096).unwrap(), Duration::from_millis(100));
    assert!(back.is_none());
    assert_eq!(results, vec![Err(Error::Timeout { op: "io_uring batch", limit_ms: 100 })]);
    let (back, results) = backend.submit(
        &files[0],
        &[request(0), request(512)],
        StagingBuffer::new(4096).unwrap(),
        Duration::from_secs(5),
    );
    assert_eq!(results, vec![Ok(()), Ok(())]);
    assert_eq!(&back.unwrap().bytes()[..1024], &(0..1024).map(|o| byte(0, o)).collect::<Vec<_>>()[..]);
    let mut delivered = 0;
    let back = backend.read_stream(
        &refs[..1],
        &reads[..1],
        StagingBuffer::new(4096).unwrap(),
        Duration::from_secs(5),
        &mut |_, bytes| {
            assert!(bytes.is_ok());
            delivered += 1;
        },
    );
    assert!(back.is_some());
    assert_eq!(delivered, 1);
    std::fs::remove_dir_all(&dir).unwrap();
}
