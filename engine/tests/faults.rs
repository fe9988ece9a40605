//! Fault matrix: a durable directory with every kind of context (wave f16, flat f16, wave
//! `hack2`, PQ `hack2`, two layers each), checkpointed and then appended to, so it holds
//! every kind of file (identity, lock, manifest, log, data, layout, codebooks, 2-bit home
//! and segments). For every file, each fault is applied to a copy of the directory: a byte
//! flipped in each region, truncation at several points, deletion, a directory, a dangling
//! link, a link to `/dev/null` and to `/dev/zero`, and a swap with another file of the same
//! size. Then `check` and `Engine::open` run on the copy, and the outcome must be one of:
//! - a typed error that names the damaged file (never a panic, never an unbounded read);
//! - an engine holding every acknowledged batch, whose attention equals that of an engine
//!   that never saw the fault.
//!
//! Never an acknowledged batch silently missing, never wrong bytes served. Open and check
//! must also agree: a directory that `check` passes clean opens.

mod common;
use common::copy_dir;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use attnstore::durable::{check, DATA_DIR, WAL_DIR};
use attnstore::{
    AttnShape, Budget, Codec, ContextId, ContextSpec, DurableConfig, Engine, EngineConfig, HackParams, Method,
    PqParams, Request, WaveParams,
};
use attnstore_kernels::random::SplitMix64;
use attnstore_wal::{SyncPolicy, WriterConfig};

const KINDS: usize = 4;
const LAYERS: usize = 2;
/// Batches appended before the checkpoint, and after it (those live in the log only).
const BEFORE: usize = 12;
const AFTER: usize = 5;

fn shape() -> AttnShape {
    AttnShape::new(4, 2, 16).unwrap()
}

/// Context kind `t`: wave f16, flat f16, wave hack2, PQ hack2.
fn spec(t: usize) -> ContextSpec {
    let wave = WaveParams { segment_tokens: 128, decode_segment_tokens: 32, local_tokens: 8, ..WaveParams::default() };
    let pq = PqParams { min_build_tokens: 64, local_tokens: 8, ..PqParams::default() };
    let method = match t {
        0 | 2 => Method::Wave(wave),
        1 => Method::Flat,
        _ => Method::Pq(pq),
    };
    let spec = ContextSpec::new(shape(), LAYERS).with_method(method);
    match t {
        2 | 3 => spec.with_codec(Codec::Hack2(HackParams::new(16).unwrap())),
        _ => spec,
    }
}

/// Batch `i` of layer `layer`: the same sizes for every context (so f16 data files of
/// different contexts have the same size and can be swapped), different values.
fn batch(t: usize, layer: usize, i: usize) -> (Vec<f32>, Vec<f32>) {
    let tokens = if i == 0 { 160 } else { 1 + (i * 7) % 9 };
    let mut rng = SplitMix64::fork((t * 31 + layer) as u64, i as u64);
    let n = shape().kv_len(tokens);
    ((0..n).map(|_| rng.normal()).collect(), (0..n).map(|_| rng.normal()).collect())
}

fn ingest(engine: &Engine, ctx: ContextId, t: usize, i: usize) {
    for layer in 0..LAYERS {
        let (k, v) = batch(t, layer, i);
        match i {
            0 => engine.prefill(ctx, layer, &k, &v).unwrap(),
            _ => engine.append(ctx, layer, &k, &v).unwrap(),
        }
    }
}

fn durable_config() -> DurableConfig {
    // Small log files keep the preallocated tails (and the matrix) quick.
    DurableConfig {
        wal: WriterConfig { policy: SyncPolicy::EveryBatch, max_file_bytes: 64 << 10 },
        ..DurableConfig::default()
    }
}

/// Attention of every layer of `ctx`, exact and sparse, for a fixed query.
fn attention(engine: &Engine, ctx: ContextId) -> Vec<Vec<f32>> {
    let mut rng = SplitMix64::new(99);
    let q: Vec<f32> = (0..shape().query_len()).map(|_| rng.normal()).collect();
    let mut out = Vec::new();
    for layer in 0..LAYERS {
        assert!(engine.wait_index(ctx, layer, Duration::from_secs(60)).unwrap(), "no index");
        for budget in [Budget::full(), Budget::default().with_retrieve_floor(8).with_retrieve(0.2)] {
            let plan = engine.plan(&[Request::new(ctx, layer, q.clone())], &budget).unwrap();
            out.push(engine.execute(&plan).unwrap().remove(0));
        }
    }
    out
}

/// The directory every case starts from, and what a fault-free engine answers.
struct Fixture {
    _root: tempfile::TempDir,
    dir: PathBuf,
    contexts: Vec<ContextId>,
    tokens: Vec<usize>,
    expected: Vec<Vec<Vec<f32>>>,
}

fn fixture() -> Fixture {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("engine");
    let engine = Engine::open_with(&dir, EngineConfig::default(), durable_config()).unwrap();
    let contexts: Vec<ContextId> = (0..KINDS).map(|t| engine.create_context(spec(t)).unwrap()).collect();
    for i in 0..BEFORE {
        for (t, &ctx) in contexts.iter().enumerate() {
            ingest(&engine, ctx, t, i);
        }
    }
    for &ctx in &contexts {
        for layer in 0..LAYERS {
            assert!(engine.wait_index(ctx, layer, Duration::from_secs(60)).unwrap());
        }
    }
    let report = engine.checkpoint().unwrap();
    assert!(report.homes_written >= 2 * LAYERS && report.layouts_written >= 2, "{report:?}");
    for i in BEFORE..BEFORE + AFTER {
        for (t, &ctx) in contexts.iter().enumerate() {
            ingest(&engine, ctx, t, i);
        }
    }
    let tokens = contexts.iter().map(|&c| engine.stats(c, 0).unwrap().tokens).collect();
    drop(engine);
    // What the directory answers as it is (its reopen is the reference for every case).
    let clean = Engine::open_with(&dir, EngineConfig::default(), durable_config()).unwrap();
    let expected = contexts.iter().map(|&c| attention(&clean, c)).collect();
    drop(clean);
    Fixture { _root: root, dir, contexts, tokens, expected }
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    Flip(usize),
    Truncate(usize),
    Delete,
    Directory,
    DanglingLink,
    LinkTo(&'static str),
    SwapWith,
}

/// Every file of `dir` (relative paths), in a stable order.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for sub in ["", WAL_DIR, DATA_DIR, "index"] {
        let mut names: Vec<_> = std::fs::read_dir(dir.join(sub))
            .unwrap()
            .map(|e| e.unwrap())
            .filter(|e| e.file_type().unwrap().is_file())
            .map(|e| Path::new(sub).join(e.file_name()))
            .collect();
        names.sort();
        out.extend(names);
    }
    out
}

/// The faults for a file: flips in its header, early body, middle, its last written bytes
/// (a log's last record, before its zero-filled rest) and its end; truncations there; and
/// the replacements.
fn faults(bytes: &[u8]) -> Vec<Fault> {
    let len = bytes.len();
    let last_written = bytes.iter().rposition(|&b| b != 0).unwrap_or(0);
    let mut out = Vec::new();
    for at in [0, 9, 30, 45, 60, len / 2, last_written.saturating_sub(20), last_written, len.saturating_sub(1)] {
        if at < len && !out.iter().any(|f| matches!(f, Fault::Flip(a) if *a == at)) {
            out.push(Fault::Flip(at));
        }
    }
    for cut in [0, 20, 47, len / 2, last_written.saturating_sub(20), last_written + 1, len.saturating_sub(1)] {
        if cut < len {
            out.push(Fault::Truncate(cut));
        }
    }
    out.extend([
        Fault::Delete,
        Fault::Directory,
        Fault::DanglingLink,
        Fault::LinkTo("/dev/null"),
        Fault::LinkTo("/dev/zero"),
        Fault::SwapWith,
    ]);
    out
}

/// Applies `fault` to `dir/file`; returns the names of the files it damaged (the file, and
/// for a swap the other one too), empty when it does not apply (no file to swap with).
fn apply(dir: &Path, file: &Path, fault: Fault) -> Vec<String> {
    let name = |p: &Path| p.file_name().unwrap().to_string_lossy().into_owned();
    let path = dir.join(file);
    match fault {
        Fault::Flip(at) => {
            let mut bytes = std::fs::read(&path).unwrap();
            bytes[at] ^= 0x10;
            std::fs::write(&path, bytes).unwrap();
        }
        Fault::Truncate(cut) => {
            std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(cut as u64).unwrap()
        }
        Fault::Delete => std::fs::remove_file(&path).unwrap(),
        Fault::Directory => {
            std::fs::remove_file(&path).unwrap();
            std::fs::create_dir(&path).unwrap();
        }
        Fault::DanglingLink => {
            std::fs::remove_file(&path).unwrap();
            std::os::unix::fs::symlink(dir.join("nothing-here"), &path).unwrap();
        }
        Fault::LinkTo(target) => {
            std::fs::remove_file(&path).unwrap();
            std::os::unix::fs::symlink(target, &path).unwrap();
        }
        Fault::SwapWith => {
            let len = std::fs::metadata(&path).unwrap().len();
            let parent = path.parent().unwrap();
            let mut others: Vec<PathBuf> = std::fs::read_dir(parent)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p != &path && std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.len() == len))
                .collect();
            others.sort();
            let Some(other) = others.first() else { return Vec::new() };
            let (a, b) = (std::fs::read(&path).unwrap(), std::fs::read(other).unwrap());
            if a == b {
                return Vec::new();
            }
            std::fs::write(&path, b).unwrap();
            std::fs::write(other, a).unwrap();
            return vec![name(&path), name(other)];
        }
    }
    vec![name(&path)]
}

/// What one case came to, for the summary.
#[derive(Debug, Default)]
struct Tally {
    cases: usize,
    errors: usize,
    recovered: usize,
    by_file_kind: BTreeMap<String, (usize, usize)>,
}

fn file_kind(file: &Path) -> String {
    let name = file.file_name().unwrap().to_string_lossy().into_owned();
    let kind = match () {
        _ if name.starts_with("wal-") => "log",
        _ if name.ends_with(".kv") => "data",
        _ if name.ends_with(".layout") => "wave layout",
        _ if name.ends_with(".pq") => "pq codebooks",
        _ if name.ends_with(".h2") && name.contains("seg-") => "2-bit segment",
        _ if name.ends_with(".h2") || name.contains("home") => "2-bit home",
        _ => &name,
    };
    kind.to_string()
}

#[test]
fn every_fault_of_every_file_is_a_typed_error_naming_it_or_a_recovery_that_loses_nothing() {
    let fx = fixture();
    let all = files(&fx.dir);
    let kinds: std::collections::BTreeSet<String> = all.iter().map(|f| file_kind(f)).collect();
    for expected in
        ["IDENTITY", "LOCK", "MANIFEST", "log", "data", "wave layout", "pq codebooks", "2-bit home", "2-bit segment"]
    {
        assert!(kinds.contains(expected), "the fixture has no {expected} file: {all:?}");
    }
    let root = tempfile::tempdir().unwrap();
    let mut tally = Tally::default();
    let mut failures = Vec::new();
    for file in &all {
        let bytes = std::fs::read(fx.dir.join(file)).unwrap();
        for fault in faults(&bytes) {
            let copy = root.path().join(format!("case-{}", tally.cases));
            copy_dir(&fx.dir, &copy);
            let damaged = apply(&copy, file, fault);
            if damaged.is_empty() {
                let _ = std::fs::remove_dir_all(&copy);
                continue;
            }
            tally.cases += 1;
            let case = format!("{} {fault:?}", file.display());
            let checked = check(&copy);
            let opened = Engine::open_with(&copy, EngineConfig::default(), durable_config());
            let entry = tally.by_file_kind.entry(file_kind(file)).or_default();
            match opened {
                Err(error) => {
                    if std::env::var_os("ATTNSTORE_FAULTS_VERBOSE").is_some() {
                        eprintln!("{case}: {error}");
                    }
                    tally.errors += 1;
                    entry.0 += 1;
                    let message = error.to_string();
                    if !damaged.iter().any(|name| message.contains(name)) {
                        failures.push(format!("{case}: the error does not name the file: {message}"));
                    }
                    if message.contains("Some(") || message.contains(" {") {
                        failures.push(format!("{case}: debug output in the message: {message}"));
                    }
                    if checked.as_ref().is_ok_and(|r| r.is_clean()) {
                        failures.push(format!("{case}: check passed clean but open failed: {message}"));
                    }
                }
                Ok(engine) => {
                    if std::env::var_os("ATTNSTORE_FAULTS_VERBOSE").is_some() {
                        eprintln!("{case}: recovered, nothing lost");
                    }
                    tally.recovered += 1;
                    entry.1 += 1;
                    for (t, &ctx) in fx.contexts.iter().enumerate() {
                        let tokens = engine.stats(ctx, 0).map(|s| s.tokens);
                        if tokens.as_ref().ok() != Some(&fx.tokens[t]) {
                            failures.push(format!(
                                "{case}: context {t} holds {tokens:?} tokens, {} acknowledged",
                                fx.tokens[t]
                            ));
                            continue;
                        }
                        if attention(&engine, ctx) != fx.expected[t] {
                            failures.push(format!("{case}: context {t} answers differently after recovery"));
                        }
                    }
                }
            }
            let _ = std::fs::remove_dir_all(&copy);
        }
    }
    eprintln!(
        "fault matrix: {} files, {} cases: {} typed errors, {} recoveries with nothing lost",
        all.len(),
        tally.cases,
        tally.errors,
        tally.recovered
    );
    for (kind, (errors, recovered)) in &tally.by_file_kind {
        eprintln!("  {kind}: {errors} errors, {recovered} recoveries");
    }
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), tally.cases, failures.join("\n"));
}

#[test]
fn a_data_file_swapped_with_another_contexts_is_refused_by_open_and_check() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("engine");
    let engine = Engine::open(&dir, EngineConfig::default()).unwrap();
    // Two flat contexts with batches of the same sizes: their data files have one layout.
    let contexts: Vec<_> = (0..2).map(|_| engine.create_context(spec(1)).unwrap()).collect();
    for (t, &ctx) in contexts.iter().enumerate() {
        for i in 0..3 {
            ingest(&engine, ctx, t, i);
        }
    }
    drop(engine);
    let data = dir.join(DATA_DIR);
    let mut names: Vec<_> = std::fs::read_dir(&data).unwrap().map(|e| e.unwrap().path()).collect();
    names.sort();
    let (a, b) = (std::fs::read(&names[0]).unwrap(), std::fs::read(&names[2]).unwrap());
    assert_eq!(a.len(), b.len(), "the two contexts' layer-0 files have the same size");
    std::fs::write(&names[0], &b).unwrap();
    std::fs::write(&names[2], &a).unwrap();
    let error = Engine::open(&dir, EngineConfig::default()).err().expect("the swap is refused");
    assert!(error.to_string().contains("belongs to context"), "{error}");
    assert!(check(&dir).is_err());
}
