//! The Host arena in pinned, device-mapped memory: with the `cuda` feature and a GPU
//! (`ATTNSTORE_GPU=1`, run on the GPU machine through `../shared/gpu/stage`), the device reads
//! every block in place at `device_base + slot × block_bytes`, and sees rewrites. Without a
//! GPU the arena is anonymous memory.

use attnstore_buffer::{BufferConfig, BufferManager, ClusterKey, HostMemoryKind};

fn key(cluster: u32) -> ClusterKey {
    ClusterKey { context: 1, layer: 0, head: 0, cluster }
}

fn gpu_wanted() -> bool {
    std::env::var("ATTNSTORE_GPU").as_deref() == Ok("1")
}

#[test]
fn without_a_gpu_the_arena_is_anonymous_memory() {
    if cfg!(feature = "cuda") && gpu_wanted() {
        eprintln!("skipped: a GPU is expected here (see the pinned test)");
        return;
    }
    let buffers = BufferManager::new(BufferConfig::new(8, 0)).unwrap();
    assert_eq!(buffers.host_memory(), HostMemoryKind::Anonymous);
    buffers.store_cluster(key(0), &[7; 100]).unwrap();
    assert_eq!(
        buffers.reader().pin(&buffers.reader().cluster(&key(0)).unwrap().first().unwrap()).unwrap()[..100],
        [7; 100]
    );
}

#[cfg(feature = "cuda")]
#[test]
#[allow(unsafe_code, reason = "one raw device-to-host copy from the mapped arena, to check what the GPU sees")]
fn the_gpu_reads_pinned_blocks_in_place() {
    use cudarc::driver::{result, CudaContext};
    if !gpu_wanted() {
        eprintln!("skipped: set ATTNSTORE_GPU=1 on a machine with a GPU to run the pinned-memory test");
        return;
    }
    let buffers = BufferManager::new(BufferConfig::new(256, 0)).unwrap();
    let HostMemoryKind::Pinned { device_base } = buffers.host_memory() else {
        panic!("ATTNSTORE_GPU=1 but the Host arena is not pinned: {:?}", buffers.host_memory());
    };
    let block = buffers.layout().block_bytes();
    let ctx = CudaContext::new(0).unwrap();
    ctx.bind_to_thread().unwrap();
    let read_on_gpu = |cluster: u32| -> Vec<u8> {
        let location = buffers.reader().cluster(&key(cluster)).unwrap().first().unwrap();
        let slot = buffers.host_slot(location.block()).unwrap().expect("homed on Host");
        let mut out = vec![0u8; block];
        // SAFETY: the address lies inside the live pinned arena (slot < capacity), mapped into
        // this context by DEVICEMAP; `out` has room for one block.
        unsafe { result::memcpy_dtoh_sync(&mut out, device_base + (slot as usize * block) as u64) }.unwrap();
        out
    };
    for c in 0..200u32 {
        let bytes: Vec<u8> = (0..block).map(|i| (i as u32 * 31 + c * 7) as u8).collect();
        buffers.store_cluster(key(c), &bytes).unwrap();
    }
    for c in 0..200u32 {
        let want: Vec<u8> = (0..block).map(|i| (i as u32 * 31 + c * 7) as u8).collect();
        assert_eq!(read_on_gpu(c), want, "cluster {c}");
    }
    // A rewrite through the buffer manager is what the device sees next (no copy to refresh).
    let id = buffers.reader().cluster(&key(5)).unwrap().first().unwrap().block();
    buffers.write(id, &vec![0xAB; block]).unwrap();
    assert_eq!(read_on_gpu(5), vec![0xAB; block]);
    println!("pinned arena: 256 blocks at device address {device_base:#x}; 200 blocks read in place by the GPU");
}

#[cfg(feature = "cuda")]
#[test]
#[allow(unsafe_code, reason = "raw device-to-host copies from the Gpu tier's device slots, to check them")]
fn the_gpu_tier_lives_in_device_memory_and_admissions_write_it_before_publishing() {
    use cudarc::driver::{result, CudaContext};
    if !gpu_wanted() {
        eprintln!("skipped: set ATTNSTORE_GPU=1 on a machine with a GPU to run the device-tier test");
        return;
    }
    let buffers = BufferManager::new(BufferConfig::new(64, 8)).unwrap();
    let base = buffers.gpu_device_base().expect("ATTNSTORE_GPU=1 but the Gpu tier is not in device memory");
    assert!(buffers.stats().gpu_on_device);
    let block = buffers.layout().block_bytes();
    let ctx = CudaContext::new(0).unwrap();
    ctx.bind_to_thread().unwrap();
    let content = |c: u32| -> Vec<u8> { (0..block).map(|i| (i as u32 * 13 + c * 101) as u8).collect() };
    for c in 0..40u32 {
        buffers.store_cluster(key(c), &content(c)).unwrap();
    }
    // 40 admissions through 8 slots: each slot is rewritten several times, and every time
    // the device copy is the admitted block's bytes as soon as the slot is published.
    for c in 0..40u32 {
        let id = buffers.reader().cluster(&key(c)).unwrap().first().unwrap().block();
        let slot = buffers.admit(id).unwrap();
        let location = buffers.reader().cluster(&key(c)).unwrap().first().unwrap();
        assert_eq!(location.gpu_slot(), Some(slot));
        let mut on_device = vec![0u8; block];
        // SAFETY: slot < 8 lies inside the device pool of 8 blocks; `on_device` holds one block.
        unsafe { result::memcpy_dtoh_sync(&mut on_device, base + (slot as usize * block) as u64) }.unwrap();
        assert_eq!(on_device, content(c), "cluster {c} in slot {slot}");
        // CPU readers still get the right bytes (from the tier's host side).
        let pin = buffers.reader().pin(&location).unwrap();
        assert_eq!(&pin[..], &content(c)[..]);
    }
    println!("gpu tier: 8 device slots at {base:#x}; 40 admissions verified on the device");
}
