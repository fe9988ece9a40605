//! Attaching: the longest published prefix of a token sequence, read from the store, every
//! value checked, built into a new context of the engine with the published layouts.

use super::keys::{chain, KeySpace, ModelId};
use super::value::{decode_layout, decode_list, decode_rows, Expect, Fault, Rows};
use super::{stats, LayerKv, RemoteTier, Shared};
use crate::catalog::Batch;
use crate::context::ContextId;
use crate::engine::Engine;
use crate::error::Result;
use crate::spec::{ContextSpec, LayerKind};
use attnstore_index::{IndexLayout, WaveLayout};
use rayon::prelude::*;
use std::collections::HashMap;

/// A context built from a published prefix.
#[derive(Debug)]
pub struct Attached {
    /// The new context; it holds the first [`Attached::tokens`] tokens.
    pub context: ContextId,
    /// Tokens reused: a whole number of chunks.
    pub tokens: usize,
    /// Per layer, the KV stored in the context (`kv_heads × rows × head_dim` f32: every
    /// token for a global layer, the last `min(W, tokens)` for a sliding-window layer), for
    /// a runtime that continues the prompt from it.
    pub kv: Vec<LayerKv>,
    /// Layers restored from a published index layout (the others were indexed from their
    /// rows: clustered, or PQ codebooks trained in the background; a layout that does not
    /// fit the rows is reported in the log and the layer indexed likewise).
    pub layouts_used: usize,
    /// Time spent finding the prefix and reading and checking its values and layouts.
    pub fetch_time: std::time::Duration,
    /// Time spent building the context from them (restoring indexes).
    pub build_time: std::time::Duration,
}

/// What one attach read: decoded rows by (chunk index, layer), and values known unusable.
struct Fetched<'a> {
    shared: &'a Shared,
    spec: &'a ContextSpec,
    keys: KeySpace,
    chain: Vec<[u8; 32]>,
    rows: HashMap<(usize, usize), Rows>,
    bad: HashMap<(usize, usize), Fault>,
}

impl Fetched<'_> {
    fn expect<'h>(&self, hash: &'h [u8; 32], layer: usize) -> Expect<'h> {
        let s = &self.spec.shape;
        Expect { hash, layer, kv_heads: s.kv_heads, head_dim: s.head_dim, dtype: self.spec.dtype }
    }

    /// Reads the rows of `(chunk, layer)` pairs not read yet, in order; false when a call
    /// failed. With `stop_at_fault`, reading stops after the call that found the first
    /// missing or corrupt value (a prefix ends there). One thread fetches while this one
    /// checks and widens the previous call's values (in parallel), so decoding overlaps the
    /// store's I/O.
    fn read(&mut self, wanted: &[(usize, usize)], stop_at_fault: bool) -> bool {
        let todo: Vec<(usize, usize)> =
            wanted.iter().copied().filter(|p| !self.rows.contains_key(p) && !self.bad.contains_key(p)).collect();
        let dtype = self.spec.dtype.name();
        let keys: Vec<String> =
            todo.iter().map(|&(k, l)| self.keys.chunk(&self.chain[k], l, self.spec.layers[l], dtype)).collect();
        let per_call = self.shared.config.values_per_call;
        let shared = self.shared;
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            let (tx, rx) = std::sync::mpsc::sync_channel::<(usize, Vec<Option<Vec<u8>>>)>(1);
            let (keys, stop) = (&keys, &stop);
            let fetcher = scope.spawn(move || {
                for (i, part) in keys.chunks(per_call).enumerate() {
                    if stop.load(std::sync::atomic::Ordering::SeqCst) {
                        break;
                    }
                    let Ok(mut values) = shared.call("get", |s| s.get_many(part)) else { return false };
                    values.resize(part.len(), None);
                    if tx.send((i, values)).is_err() {
                        break;
                    }
                }
                true
            });
            for (i, values) in rx {
                let part = &todo[i * per_call..(i * per_call + values.len()).min(todo.len())];
                let bytes: usize = values.iter().flatten().map(Vec::len).sum();
                let decoded: Vec<std::result::Result<Rows, Fault>> = part
                    .par_iter()
                    .zip(values.into_par_iter())
                    .map(|(&(k, l), value)| match value {
                        None => Err(Fault::Missing),
                        Some(v) => decode_rows(v, &self.expect(&self.chain[k], l), shared.config.chunk_tokens),
                    })
                    .collect();
                for (&(k, l), decoded) in part.iter().zip(decoded) {
                    match decoded {
                        Ok(r) => {
                            shared.counters.hits(1);
                            self.rows.insert((k, l), r);
                        }
                        Err(f) => {
                            shared.counters.fault(f);
                            self.bad.insert((k, l), f);
                            if stop_at_fault {
                                stop.store(true, std::sync::atomic::Ordering::SeqCst);
                            }
                        }
                    }
                }
                shared.counters.read(bytes as u64);
            }
            fetcher.join().unwrap_or(false)
        })
    }

    /// Whether chunk `k` of layer `l` holds rows `from..` of the chunk through its end.
    fn covers(&self, k: usize, l: usize, from: usize) -> bool {
        self.rows.get(&(k, l)).is_some_and(|r| r.first <= from && r.first + r.rows == self.shared.config.chunk_tokens)
    }

    /// The chunks (0-based) and first row of each a window of `w` tokens ending at chunk
    /// `m` (1-based count) needs.
    fn window_needs(&self, m: usize, w: usize) -> Vec<(usize, usize)> {
        let c = self.shared.config.chunk_tokens;
        let end = m * c;
        let lo = end - w.min(end);
        (lo / c..m).map(|k| (k, if k == lo / c { lo - k * c } else { 0 })).collect()
    }

    /// Rows `lo..hi` (token positions) of layer `l` from the fetched chunks, as
    /// `kv_heads × (hi - lo) × head_dim` keys and values, widened head by head in parallel.
    fn assemble(&self, l: usize, lo: usize, hi: usize) -> (Vec<f32>, Vec<f32>) {
        let (h, c) = (self.spec.shape.kv_heads, self.shared.config.chunk_tokens);
        let head_rows = |values: bool, head: usize| {
            let mut out = Vec::with_capacity((hi - lo) * self.spec.shape.head_dim);
            let mut pos = lo;
            while pos < hi {
                let k = pos / c;
                let r = &self.rows[&(k, l)];
                let (from, to) = (pos - k * c - r.first, (hi.min((k + 1) * c)) - k * c - r.first);
                r.widen_into(values, head, from, to, &mut out);
                pos = (k + 1) * c;
            }
            out
        };
        let (keys, values): (Vec<Vec<f32>>, Vec<Vec<f32>>) =
            (0..h).into_par_iter().map(|head| (head_rows(false, head), head_rows(true, head))).unzip();
        (keys.concat(), values.concat())
    }
}

impl RemoteTier {
    /// Builds a new context of `spec` in `engine` from the longest prefix of `tokens`
    /// published under `model` (whole chunks), restoring each layer's index from its
    /// published layout where one fits. `Ok(None)` when not even one chunk is usable (then
    /// nothing was created). Store failures and unusable values shorten the prefix and are
    /// counted ([`RemoteTier::stats`]), never returned: the caller prefills what was not
    /// attached. Errors are the engine's own (a bad spec, out of memory). A runtime that
    /// needs the logits of the last prompt token passes the prompt without it.
    pub fn attach(
        &self,
        engine: &Engine,
        spec: ContextSpec,
        model: &ModelId,
        tokens: &[u32],
    ) -> Result<Option<Attached>> {
        spec.validate()?;
        let shared = &*self.shared;
        let c = shared.config.chunk_tokens;
        stats::add(&shared.counters.attaches, 1);
        stats::add(&shared.counters.attach_tokens_asked, (tokens.len() / c * c) as u64);
        let mut f = Fetched {
            shared,
            spec: &spec,
            keys: KeySpace::new(&shared.config.namespace, model),
            chain: chain(model, c, tokens),
            rows: HashMap::new(),
            bad: HashMap::new(),
        };
        let fetching = std::time::Instant::now();
        let m = prefix_chunks(&mut f);
        metrics::histogram!("attnstore_remote_prefix_tokens").record((m * c) as f64);
        if m == 0 {
            return Ok(None);
        }
        let layouts = layouts(&f, m);
        let fetch_time = fetching.elapsed();
        let building = std::time::Instant::now();
        let p = m * c;
        let id = engine.create_context(spec.clone())?;
        let built = build(engine, id, &f, p, &layouts);
        let (kv, layouts_used) = match built {
            Ok(x) => x,
            Err(e) => {
                let _ = engine.drop_context(id);
                return Err(e);
            }
        };
        stats::add(&shared.counters.attach_tokens_reused, p as u64);
        stats::add(&shared.counters.layouts_used, layouts_used as u64);
        Ok(Some(Attached { context: id, tokens: p, kv, layouts_used, fetch_time, build_time: building.elapsed() }))
    }
}

/// The number of whole chunks every layer can be attached for: the global layers' rows up
/// to the first unusable value, then, shortened while needed, the rows of the window each
/// sliding-window layer needs.
fn prefix_chunks(f: &mut Fetched<'_>) -> usize {
    let total = f.chain.len();
    let layers = f.spec.layers.clone();
    let global: Vec<usize> = (0..layers.len()).filter(|&l| layers[l] == LayerKind::Global).collect();
    let mut m = if global.is_empty() {
        total
    } else {
        let wanted: Vec<(usize, usize)> = (0..total).flat_map(|k| global.iter().map(move |&l| (k, l))).collect();
        f.read(&wanted, true);
        (0..total).take_while(|&k| global.iter().all(|&l| f.covers(k, l, 0))).count()
    };
    let windows: Vec<(usize, usize)> = layers
        .iter()
        .enumerate()
        .filter_map(|(l, k)| match k {
            LayerKind::SlidingWindow(w) => Some((l, *w)),
            LayerKind::Global => None,
        })
        .collect();
    // A shorter prefix needs earlier window rows, which a publisher holding only its last
    // window rarely published: try a few, then give up.
    let mut tries = 0;
    while m > 0 && !windows.is_empty() {
        let needs: Vec<(usize, usize, usize)> = windows
            .iter()
            .flat_map(|&(l, w)| f.window_needs(m, w).into_iter().map(move |(k, from)| (k, l, from)))
            .collect();
        let wanted: Vec<(usize, usize)> = needs.iter().map(|&(k, l, _)| (k, l)).collect();
        if !f.read(&wanted, false) {
            return 0;
        }
        if needs.iter().all(|&(k, l, from)| f.covers(k, l, from)) {
            break;
        }
        m -= 1;
        tries += 1;
        if tries > 4 {
            return 0;
        }
    }
    m
}

/// Per global layer, the layout to restore it from at a prefix of `m` chunks: the published
/// wave pieces that tile from the sink on, joined (their segments end by the prefix's end),
/// or the latest PQ snapshot within it.
fn layouts(f: &Fetched<'_>, m: usize) -> HashMap<usize, IndexLayout> {
    let shared = f.shared;
    let c = shared.config.chunk_tokens;
    let list_keys: Vec<String> = (0..m).map(|k| f.keys.layouts(&f.chain[k])).collect();
    let mut listed: Vec<Vec<usize>> = vec![Vec::new(); m];
    for (part, keys) in list_keys.chunks(shared.config.values_per_call).enumerate() {
        let Ok(values) = shared.call("get", |s| s.get_many(keys)) else { return HashMap::new() };
        for (i, v) in values.into_iter().enumerate() {
            let k = part * shared.config.values_per_call + i;
            if let Some(v) = v {
                match decode_list(&v, &f.expect(&f.chain[k], 0)) {
                    Ok(layers) => listed[k] = layers,
                    Err(fault) => shared.counters.fault(fault),
                }
            }
        }
    }
    let method = f.spec.method.name();
    let wanted: Vec<(usize, usize)> = listed
        .iter()
        .enumerate()
        .flat_map(|(k, layers)| {
            layers
                .iter()
                .filter(|&&l| l < f.spec.layers.len() && f.spec.layers[l] == LayerKind::Global)
                .map(move |&l| (k, l))
        })
        .collect();
    let mut pieces: HashMap<(usize, usize), IndexLayout> = HashMap::new();
    for part in wanted.chunks(shared.config.values_per_call) {
        let keys: Vec<String> = part.iter().map(|&(k, l)| f.keys.layout(&f.chain[k], l, method)).collect();
        let Ok(values) = shared.call("get", |s| s.get_many(&keys)) else { break };
        for (&(k, l), v) in part.iter().zip(values) {
            let decoded = match v {
                None => Err(Fault::Missing),
                Some(v) => {
                    shared.counters.read(v.len() as u64);
                    decode_layout(&v, &f.expect(&f.chain[k], l), (k + 1) * c, method)
                }
            };
            match decoded {
                Ok(layout) => {
                    shared.counters.hits(1);
                    pieces.insert((k, l), layout);
                }
                Err(fault) => shared.counters.fault(fault),
            }
        }
    }
    let mut out = HashMap::new();
    for l in (0..f.spec.layers.len()).filter(|&l| f.spec.layers[l] == LayerKind::Global) {
        let mine: Vec<(usize, &IndexLayout)> = (0..m).filter_map(|k| pieces.get(&(k, l)).map(|p| (k, p))).collect();
        match method {
            "wave" => {
                let mut joined: Option<WaveLayout> = None;
                for (_, piece) in mine {
                    let IndexLayout::Wave(p) = piece else { break };
                    let next = joined.as_ref().map_or(p.sink_len, |j| j.tail_start);
                    if p.segments.first().map(|s| s.first) != Some(next)
                        || joined.as_ref().is_some_and(|j| j.sink_len != p.sink_len)
                    {
                        break; // another publisher's segmentation: keep what tiles
                    }
                    let j = joined.get_or_insert_with(|| WaveLayout { sink_len: p.sink_len, ..Default::default() });
                    j.segments.extend(p.segments.iter().cloned());
                    j.tail_start = p.tail_start;
                }
                if let (Some(j), crate::spec::Method::Wave(params)) = (joined, &f.spec.method) {
                    let p = m * c;
                    // The last `local` tokens stay in the steady zone, as a prefill leaves them.
                    let cut = p.saturating_sub(params.local_tokens).max(j.sink_len as usize) as u64;
                    out.insert(l, IndexLayout::Wave(cut_wave(j, p as u64, cut)));
                }
            }
            _ => {
                if let Some((_, p)) = mine.last() {
                    out.insert(l, (*p).clone());
                }
            }
        }
    }
    out
}

/// Fills context `id` with the first `p` tokens from `f`, restoring layers from `layouts`;
/// returns the KV stored per layer and how many layers had a layout.
fn build(
    engine: &Engine,
    id: ContextId,
    f: &Fetched<'_>,
    p: usize,
    layouts: &HashMap<usize, IndexLayout>,
) -> Result<(Vec<LayerKv>, usize)> {
    let (h, d) = (f.spec.shape.kv_heads, f.spec.shape.head_dim);
    let mut kv = Vec::with_capacity(f.spec.layers.len());
    let mut used = 0;
    for (l, &kind) in f.spec.layers.iter().enumerate() {
        let lo = match kind {
            LayerKind::Global => 0,
            LayerKind::SlidingWindow(w) => p - w.min(p),
        };
        let (keys, values) = f.assemble(l, lo, p);
        match layouts.get(&l) {
            Some(layout) => {
                // The layout's tokens are restored with it; any after (a PQ index's decode
                // tokens) are appended, and encoded with the restored codebooks.
                let t = (layout.tokens() as usize).min(p);
                let split = |x: &[f32]| -> (Vec<f32>, Vec<f32>) {
                    let (mut a, mut b) = (Vec::with_capacity(h * t * d), Vec::with_capacity(h * (p - t) * d));
                    for head in 0..h {
                        a.extend_from_slice(&x[(head * p) * d..(head * p + t) * d]);
                        b.extend_from_slice(&x[(head * p + t) * d..(head * p + p) * d]);
                    }
                    (a, b)
                };
                // A layout of every token (a wave layout always) takes the rows as they are.
                let parts = (t < p).then(|| (split(&keys), split(&values)));
                let (k0, v0): (&[f32], &[f32]) = match &parts {
                    Some(((k0, _), (v0, _))) => (k0, v0),
                    None => (&keys, &values),
                };
                let batch = Batch { keys: k0, values: v0, prefill: true, layout: Some(layout) };
                engine.ingest_with(id, l, batch, true)?;
                // A layout that did not fit was reported and the rows indexed instead: count
                // only layers whose index is the layout.
                let ctx = engine.context(id)?;
                let restored =
                    crate::catalog::layer_of(&ctx, id, l)?.read().method.snapshots().and_then(|s| s.layout());
                if restored.as_ref() == Some(layout) {
                    used += 1;
                }
                if let Some(((_, k1), (_, v1))) = &parts {
                    engine.append(id, l, k1, v1)?;
                }
            }
            None => engine.prefill(id, l, &keys, &values)?,
        }
        kv.push((keys, values));
    }
    Ok((kv, used))
}

/// `layout` over a prefix of `tokens` tokens, its segments cut at token `cut`: segments
/// starting at or after it are dropped, one straddling it keeps its tokens before it in
/// their clusters (clusters left empty dropped). The cut index is a valid layout of the
/// prefix; its centroids are the means of the kept rows, computed on restore.
pub(crate) fn cut_wave(mut layout: WaveLayout, tokens: u64, cut: u64) -> WaveLayout {
    layout.segments.retain(|s| s.first < cut);
    for seg in &mut layout.segments {
        if seg.first + seg.len <= cut {
            continue;
        }
        for head in &mut seg.heads {
            let (mut sizes, mut positions) = (Vec::new(), Vec::new());
            let mut at = 0;
            for &size in &head.sizes {
                let cluster = &head.positions[at..at + size as usize];
                at += size as usize;
                let before = positions.len();
                positions.extend(cluster.iter().copied().filter(|&p| u64::from(p) < cut));
                if positions.len() > before {
                    sizes.push((positions.len() - before) as u32);
                }
            }
            (head.sizes, head.positions) = (sizes, positions);
        }
        seg.len = cut - seg.first;
    }
    layout.tail_start = layout.segments.last().map_or(layout.sink_len, |s| s.first + s.len);
    layout.tokens = tokens;
    layout
}
