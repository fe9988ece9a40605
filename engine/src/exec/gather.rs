//! Gathering rows homed in the buffer manager: pinning the blocks of clusters (as a plan
//! recorded them, or as the mapping table has them now) and the value blocks of 2-bit
//! segments, then attending them in place.

use super::home::{missing, BlockStore};
use super::meter::ZoneMeter;
use crate::error::Result;
use attnstore_buffer::{BlockLocation, Locations, PinGuard, Reader};
use attnstore_index::{HomedClusters, HomedGroups};
use attnstore_kernels::cpu::attention::Scratch;
use attnstore_kernels::{Backend, BlockRows, CpuBackend, Element, HackView, Partial};
use std::ops::Range;

/// Rows `rows` of one cluster, whose blocks are `locations`.
pub(crate) struct ClusterRows<'l> {
    pub locations: ClusterBlocks<'l>,
    pub rows: Range<usize>,
}

/// A cluster's blocks: as a plan recorded them, or as a lookup finds them now.
#[derive(Clone, Copy)]
pub(crate) enum ClusterBlocks<'l> {
    /// Recorded at planning time (EXPLAIN showed these tiers).
    Recorded(&'l [BlockLocation]),
    /// From the mapping table, each Gpu slot read when the block is pinned.
    Live(Locations<'l>),
}

impl ClusterBlocks<'_> {
    fn len(&self) -> usize {
        match self {
            Self::Recorded(l) => l.len(),
            Self::Live(l) => l.len(),
        }
    }

    fn get(&self, i: usize) -> Option<BlockLocation> {
        match self {
            Self::Recorded(l) => l.get(i).copied(),
            Self::Live(l) => l.get(i),
        }
    }
}

/// How a gather reads: `scan` pins without logging accesses (an exact plan or the steady
/// zone: they must not flush the Gpu tier, whose blocks sparse plans re-read); `meter`
/// counts rows and pinned blocks for EXPLAIN ANALYZE.
#[derive(Clone, Copy)]
pub(crate) struct Read<'m> {
    pub scan: bool,
    pub meter: Option<&'m ZoneMeter>,
}

/// A pinned block and the rows of it to attend.
struct Held<'a> {
    block: PinGuard<'a>,
    rows: Range<usize>,
}

/// Attends the rows of `clusters` (pinned through `reader`, Disk reads batched) into `parts`,
/// counting them into `meter` when given.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_clusters<E: Element>(
    reader: &Reader<'_>,
    per_block: usize,
    q: &[f32],
    scale: f32,
    clusters: &[ClusterRows<'_>],
    meter: Option<&ZoneMeter>,
    parts: &mut [Partial],
    scratch: &mut Scratch,
) -> Result<()> {
    let mut wanted = Vec::new();
    let mut rows = Vec::new();
    for c in clusters {
        let last = c.rows.end.div_ceil(per_block).min(c.locations.len());
        for b in c.rows.start / per_block..last {
            let lo = c.rows.start.max(b * per_block) - b * per_block;
            let hi = c.rows.end.min((b + 1) * per_block) - b * per_block;
            wanted.extend(c.locations.get(b));
            rows.push(lo..hi);
        }
    }
    let mut held = Vec::with_capacity(rows.len());
    for (pin, r) in reader.pin_all(&wanted).into_iter().zip(rows) {
        held.push(Held { block: pin?, rows: r });
    }
    if let Some(m) = meter {
        for h in &held {
            m.pinned(h.block.tier(), h.block.len());
            m.block_rows(h.rows.len());
        }
    }
    // Disk reads are private staged copies that need not be aligned for `E`: copy those.
    let copies: Vec<Vec<E>> = held
        .iter()
        .filter(|h| bytemuck::try_cast_slice::<u8, E>(&h.block).is_err())
        .map(|h| aligned_copy(&h.block))
        .collect();
    let mut copied = copies.iter();
    let blocks: Vec<BlockRows<&[E]>> = held
        .iter()
        .map(|h| {
            let block: &[E] = match bytemuck::try_cast_slice(&h.block) {
                Ok(all) => all,
                Err(_) => copied.next().expect("one copy per unaligned block"),
            };
            BlockRows { block, rows: h.rows.clone() }
        })
        .collect();
    CpuBackend::<E>::new(scratch).attend_blocks(q, scale, per_block, std::slice::from_ref(&blocks), parts)?;
    Ok(())
}

fn aligned_copy<E: Element>(bytes: &[u8]) -> Vec<E> {
    let n = bytes.len() / E::DTYPE.size_bytes();
    let mut out = vec![E::default(); n];
    bytemuck::cast_slice_mut::<E, u8>(&mut out).copy_from_slice(&bytes[..n * E::DTYPE.size_bytes()]);
    out
}

/// Attends segment rows `ranges` of plain rows homed per cluster, looked up now and pinned
/// only where a range has rows, as `read` says (a sparse plan's retrieved rows, a PQ
/// index's tokens, log their accesses).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_homed<E: Element>(
    store: &BlockStore,
    head: usize,
    homed: &HomedClusters<'_>,
    ranges: &[Range<usize>],
    read: Read<'_>,
    q: &[f32],
    scale: f32,
    parts: &mut [Partial],
    scratch: &mut Scratch,
) -> Result<()> {
    let d = q.len() / parts.len().max(1);
    let mut keys = Vec::new();
    let mut rows = Vec::new();
    for r in ranges.iter().filter(|r| !r.is_empty()) {
        for (id, within) in homed.clusters_of(r.clone()) {
            keys.push(store.key(head, id));
            rows.push(within);
        }
    }
    let reader = if read.scan { store.buffers().scan_reader() } else { store.buffers().reader() };
    let mut found = Vec::with_capacity(keys.len());
    reader.clusters(&keys, &mut found);
    let clusters = found
        .into_iter()
        .zip(&keys)
        .zip(rows)
        .map(|((f, k), rows)| Ok(ClusterRows { locations: ClusterBlocks::Live(f.ok_or_else(|| missing(k))?), rows }))
        .collect::<Result<Vec<_>>>()?;
    let per_block = store.rows_per_block(d * E::DTYPE.size_bytes())?;
    attend_clusters::<E>(&reader, per_block, q, scale, &clusters, read.meter, parts, scratch)
}

/// Attends segment rows `ranges` of 2-bit rows homed as value blocks: each value block the
/// ranges touch is copied out of its pinned blocks and attended with the step's queries
/// quantized once, pinned as `read` says.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_groups(
    store: &BlockStore,
    head: usize,
    g: &HomedGroups,
    ranges: &[Range<usize>],
    read: Read<'_>,
    q: &[f32],
    scale: f32,
    parts: &mut [Partial],
    scratch: &mut Scratch,
) -> Result<()> {
    // Each value block the ranges touch, its rows local to the block.
    let p = g.params.partition;
    let mut wanted: Vec<(usize, Vec<Range<usize>>)> = Vec::new();
    let mut sorted: Vec<Range<usize>> = ranges.iter().filter(|r| !r.is_empty()).cloned().collect();
    sorted.sort_unstable_by_key(|r| r.start);
    for r in sorted {
        for block in r.start / p..r.end.div_ceil(p) {
            let local = r.start.max(block * p) - block * p..r.end.min((block + 1) * p) - block * p;
            match wanted.last_mut() {
                Some((b, runs)) if *b == block => runs.push(local),
                _ => wanted.push((block, vec![local])),
            }
        }
    }
    if wanted.is_empty() {
        return Ok(());
    }
    // A scan (an exact plan) must not flush what sparse plans keep re-reading.
    let reader = if read.scan { store.buffers().scan_reader() } else { store.buffers().reader() };
    let blocks: Vec<usize> = wanted.iter().map(|(b, _)| *b).collect();
    let buffers = read_groups(&reader, store, head, g, &blocks, read.meter)?;
    if let Some(m) = read.meter {
        m.block_rows(wanted.iter().flat_map(|(_, runs)| runs).map(|r| r.len()).sum());
    }
    let views = blocks
        .iter()
        .zip(&buffers)
        .map(|(&b, buf)| {
            HackView::from_group(g.head_dim, g.params, g.rows_in(b), bytemuck::cast_slice(buf))
                .map_err(crate::Error::from)
        })
        .collect::<Result<Vec<_>>>()?;
    // The step's queries are quantized once for every block.
    views[0].quantize_queries(q, parts.len(), &mut scratch.hack);
    for (view, (_, runs)) in views.iter().zip(&wanted) {
        view.attend_quantized(scale, runs, parts, &mut scratch.hack);
    }
    Ok(())
}

/// Value blocks `blocks` of `g`, each copied out of its pinned buffer-manager blocks into a
/// 2-byte aligned buffer (a block of Π rows spans several 2 KiB blocks, which need not be
/// adjacent).
fn read_groups(
    reader: &Reader<'_>,
    store: &BlockStore,
    head: usize,
    g: &HomedGroups,
    blocks: &[usize],
    meter: Option<&ZoneMeter>,
) -> Result<Vec<Vec<u16>>> {
    let keys: Vec<_> = blocks.iter().map(|&b| store.key(head, g.first + b as u32)).collect();
    let (locations, counts) = store.lookup_counted(&keys)?;
    let mut pins = reader.pin_all(&locations).into_iter();
    let mut out = Vec::with_capacity(blocks.len());
    for (&b, &n) in blocks.iter().zip(&counts) {
        let len = g.len_of(b);
        let mut buf = vec![0u16; len.div_ceil(2)];
        let bytes = &mut bytemuck::cast_slice_mut::<u16, u8>(&mut buf)[..len];
        let mut at = 0;
        for _ in 0..n {
            let pin = pins.next().expect("one pin per location")?;
            if let Some(m) = meter {
                m.pinned(pin.tier(), pin.len());
            }
            let take = (len - at).min(pin.len());
            bytes[at..at + take].copy_from_slice(&pin[..take]);
            at += take;
        }
        if at < len {
            return Err(crate::Error::Index(attnstore_index::Error::MissingRows(format!(
                "value block {b} of head {head}: {at} of its {len} bytes are in the buffer manager"
            ))));
        }
        out.push(buf);
    }
    Ok(out)
}
