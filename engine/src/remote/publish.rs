//! Publishing: [`RemoteTier::publish`] checks a context's KV against the engine and queues
//! it with the context's index layouts; the background writer (`run`) cuts it into chunk
//! values, asks the store which it already holds, and writes the others, then the layouts
//! and the lists naming them. A failed call ends that publish (what was written stays
//! usable: every value is checked on its own when attached).

use super::keys::{chain, KeySpace, ModelId};
use super::value::{encode_layout, encode_list, encode_row_parts, Expect};
use super::{stats, LayerKv, RemoteTier, Shared};
use crate::catalog::layer_of;
use crate::context::ContextId;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::spec::LayerKind;
use attnstore_index::{IndexLayout, WaveLayout};
use attnstore_kernels::DType;
use rayon::prelude::*;
use std::collections::BTreeMap;

/// One layer's rows to publish: token positions `start..start + rows`.
struct LayerRows {
    layer: usize,
    kind: LayerKind,
    start: usize,
    rows: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
}

/// A layout piece: stored at chunk `point` (it covers chunks `..=point`).
struct Piece {
    point: usize,
    layer: usize,
    layout: IndexLayout,
}

/// A queued publish.
pub(crate) struct Job {
    keys: KeySpace,
    chain: Vec<[u8; 32]>,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    layers: Vec<LayerRows>,
    pieces: Vec<Piece>,
}

impl RemoteTier {
    /// Queues context `id` for publishing under `model`'s identity: `tokens` are the token
    /// ids whose KV it holds, `kv` its layers' KV as given to [`Engine::prefill`] and
    /// [`Engine::append`] (`kv_heads × tokens × head_dim` f32; for a sliding-window layer the
    /// last `r` tokens for any `min(W, tokens) ≤ r ≤ tokens`: older rows than the context
    /// keeps let prefixes that end before its window be attached). The whole chunks of `tokens` are published, with the
    /// layers' index layouts (wave segments, PQ codebooks and codes) as they are now. Returns
    /// once the publish is queued: the store is written by the tier's background thread
    /// ([`RemoteTier::flush`] waits for it). A `kv` that does not fit the context is a typed
    /// error.
    pub fn publish(
        &self,
        engine: &Engine,
        id: ContextId,
        model: &ModelId,
        tokens: &[u32],
        kv: Vec<LayerKv>,
    ) -> Result<()> {
        let spec = engine.spec(id)?;
        if kv.len() != spec.layers.len() {
            return Err(Error::ShapeMismatch {
                what: "published KV (one (keys, values) pair per layer)",
                expected: spec.layers.len(),
                got: kv.len(),
            });
        }
        let (h, d) = (spec.shape.kv_heads, spec.shape.head_dim);
        let c = self.shared.config.chunk_tokens;
        let n = tokens.len();
        let ctx = engine.context(id)?;
        let mut layers = Vec::with_capacity(kv.len());
        let mut pieces = Vec::new();
        for (layer, ((keys, values), &kind)) in kv.into_iter().zip(&spec.layers).enumerate() {
            // A window layer gives at least its window, and may give older rows (a runtime
            // that kept them), so that prefixes ending before its window find theirs.
            let given = keys.len() / (h * d).max(1);
            let expected = match kind {
                LayerKind::Global => n,
                LayerKind::SlidingWindow(w) => given.clamp(w.min(n), n),
            };
            if kind == LayerKind::Global {
                let guard = layer_of(&ctx, id, layer)?.read();
                let held = guard.method.stats().tokens;
                if held != n {
                    return Err(Error::InvalidSpec(format!(
                        "publish: layer {layer} of context {id} holds {held} tokens, {n} token ids were given"
                    )));
                }
                if let Some(layout) = guard.method.snapshots().and_then(|s| s.layout()) {
                    pieces.extend(pieces_of(layer, layout, c, n / c));
                }
            }
            if keys.len() != h * expected * d || values.len() != keys.len() {
                return Err(Error::ShapeMismatch {
                    what: "published keys/values of a layer (kv_heads × tokens × head_dim, the window's tokens for a sliding-window layer)",
                    expected: h * expected * d,
                    got: keys.len().max(values.len()),
                });
            }
            layers.push(LayerRows { layer, kind, start: n - expected, rows: expected, keys, values });
        }
        let job = Job {
            keys: KeySpace::new(&self.shared.config.namespace, model),
            chain: chain(model, c, tokens),
            kv_heads: h,
            head_dim: d,
            dtype: spec.dtype,
            layers,
            pieces,
        };
        self.enqueue(job);
        Ok(())
    }
}

/// The pieces a layout is published in, at chunks up to `chunks`. A wave layout is cut at
/// the first chunk boundary after each segment (a piece holds the segments ending in its
/// chunk), so a prefix that diverges later still finds every segment before it; segments
/// that end past the last whole chunk but start before it go into the last piece (an
/// attach cuts them at its prefix). A PQ snapshot is one piece at the chunk where its base
/// region ends.
fn pieces_of(layer: usize, layout: IndexLayout, c: usize, chunks: usize) -> Vec<Piece> {
    match layout {
        IndexLayout::Wave(l) => {
            let mut groups: BTreeMap<usize, Vec<attnstore_index::SegmentLayout>> = BTreeMap::new();
            for seg in l.segments {
                let point = ((seg.first + seg.len) as usize).div_ceil(c).min(chunks);
                if (seg.first as usize) < point * c {
                    groups.entry(point).or_default().push(seg);
                }
            }
            groups
                .into_iter()
                .map(|(point, segments)| {
                    let tail_start = segments.last().map_or(l.sink_len, |s| s.first + s.len);
                    let layout = WaveLayout { tokens: (point * c) as u64, sink_len: l.sink_len, tail_start, segments };
                    Piece { point, layer, layout: IndexLayout::Wave(layout) }
                })
                .collect()
        }
        IndexLayout::Pq(s) => {
            let point = (s.tokens as usize).div_ceil(c).max(1);
            if point > chunks {
                return Vec::new();
            }
            vec![Piece { point, layer, layout: IndexLayout::Pq(s) }]
        }
    }
}

/// The background writer: publishes queued jobs until the tier is dropped.
pub(crate) fn run(shared: &Shared) {
    loop {
        let job = {
            let mut q = shared.queue.lock();
            loop {
                if shared.stopping() {
                    return;
                }
                if let Some(job) = q.0.pop_front() {
                    q.1 = true;
                    break job;
                }
                q.1 = false;
                shared.changed.notify_all();
                shared.changed.wait(&mut q);
            }
        };
        let ok = write(shared, &job);
        stats::add(if ok { &shared.counters.publishes_done } else { &shared.counters.publishes_failed }, 1);
        let mut q = shared.queue.lock();
        q.1 = false;
        shared.changed.notify_all();
    }
}

/// A value to write, made only if the store does not hold it.
type Pending<'a> = (String, Box<dyn Fn() -> Vec<u8> + Send + Sync + 'a>);

/// Writes one job; false when a store call failed (or the tier is stopping).
fn write(shared: &Shared, job: &Job) -> bool {
    let c = shared.config.chunk_tokens;
    let (h, d) = (job.kv_heads, job.head_dim);
    let mut items: Vec<Pending<'_>> = Vec::new();
    // Rows: chunk by chunk, every layer holding rows of it.
    for (k, hash) in job.chain.iter().enumerate() {
        for l in &job.layers {
            let (lo, hi) = ((k * c).max(l.start), ((k + 1) * c).min(l.start + l.rows));
            if lo >= hi {
                continue;
            }
            let key = job.keys.chunk(hash, l.layer, l.kind, job.dtype.name());
            let make = move || {
                let e = Expect { hash, layer: l.layer, kv_heads: h, head_dim: d, dtype: job.dtype };
                let rows = |head: usize| (head * l.rows + lo - l.start) * d..(head * l.rows + hi - l.start) * d;
                let keys: Vec<&[f32]> = (0..h).map(|head| &l.keys[rows(head)]).collect();
                let values: Vec<&[f32]> = (0..h).map(|head| &l.values[rows(head)]).collect();
                encode_row_parts(&e, lo - k * c, hi - lo, &keys, &values)
            };
            items.push((key, Box::new(make)));
        }
    }
    // Layouts, then (once they are stored) the lists naming them per chunk.
    let mut lists: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for p in &job.pieces {
        let hash = &job.chain[p.point - 1];
        let key = job.keys.layout(hash, p.layer, p.layout.method());
        let make = move || {
            let e = Expect { hash, layer: p.layer, kv_heads: h, head_dim: d, dtype: job.dtype };
            encode_layout(&e, p.point * c, &p.layout)
        };
        items.push((key, Box::new(make)));
        lists.entry(p.point).or_default().push(p.layer);
    }
    if !send_all(shared, &items) {
        return false;
    }
    let lists: Vec<Pending<'_>> = lists
        .into_iter()
        .map(|(point, layers)| {
            let hash = &job.chain[point - 1];
            let make = move || {
                let e = Expect { hash, layer: 0, kv_heads: h, head_dim: d, dtype: job.dtype };
                encode_list(&e, &layers)
            };
            (job.keys.layouts(hash), Box::new(make) as Box<dyn Fn() -> Vec<u8> + Send + Sync>)
        })
        .collect();
    send_all(shared, &lists)
}

/// Writes the values of `items` the store does not hold yet, `values_per_call` at a time.
/// Which are missing is asked first, for all of them (a store takes one call at a time, so
/// asking between sends would stall the encoder behind every send); then this thread
/// encodes each batch (in parallel) while a second one sends the previous batch, so
/// encoding overlaps the store's I/O.
fn send_all(shared: &Shared, items: &[Pending<'_>]) -> bool {
    let per_call = shared.config.values_per_call;
    let mut present = Vec::with_capacity(items.len());
    for part in items.chunks(per_call) {
        if shared.stopping() {
            return false;
        }
        let keys: Vec<String> = part.iter().map(|(k, _)| k.clone()).collect();
        match shared.call("exists", |s| s.exists_many(&keys)) {
            Ok(p) if p.len() == keys.len() => present.extend(p),
            _ => return false,
        }
    }
    let there = present.iter().filter(|&&p| p).count();
    stats::add(&shared.counters.values_present, there as u64);
    let missing: Vec<&Pending<'_>> = items.iter().zip(present).filter(|(_, p)| !p).map(|(i, _)| i).collect();
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<(String, Vec<u8>)>>(1);
        let sender = scope.spawn(move || {
            for entries in rx {
                let bytes: usize = entries.iter().map(|(_, v)| v.len()).sum();
                if shared.call("set", |s| s.set_many(&entries)).is_err() {
                    return false;
                }
                shared.counters.written(entries.len() as u64, bytes as u64);
            }
            true
        });
        for part in missing.chunks(per_call) {
            if shared.stopping() {
                return false;
            }
            // Narrowing, copies and checksums are most of a publish's CPU.
            let entries: Vec<(String, Vec<u8>)> = part.par_iter().map(|(key, make)| (key.clone(), make())).collect();
            if tx.send(entries).is_err() {
                break; // the sender stopped on a failed call
            }
        }
        drop(tx);
        sender.join().unwrap_or(false)
    })
}
