//! Body of the `recovery_dir` fuzz target, kept in the crate so its corpus replays on stable
//! (`tests/fuzz_recover_replay.rs`) and libFuzzer runs it on nightly.
//!
//! A template engine directory (a wave f16, a flat f16 and a `hack2` wave context,
//! checkpointed, then appended to) is made once per process. Each input is decoded into a
//! few faults, applied to a copy of it: bytes set, files truncated, extended, deleted,
//! swapped or replaced by a directory or a link. `check` and `Engine::open` then run on the
//! copy and must not panic, and an engine that opens must hold every acknowledged batch and
//! answer exactly as the template does. Faults never zero bytes: a zeroed sector is what a
//! crash leaves, and the format takes it for one by design (`docs/wal-format.md`).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use attnstore_kernels::random::SplitMix64;
use attnstore_wal::{SyncPolicy, WriterConfig};

use super::DurableConfig;
use crate::{AttnShape, Budget, Codec, ContextId, ContextSpec, Engine, EngineConfig, HackParams, Method, Request};
use crate::{IndexRebuild, WaveParams};

struct Template {
    dir: PathBuf,
    files: Vec<PathBuf>,
    contexts: Vec<ContextId>,
    tokens: Vec<usize>,
    expected: Vec<Vec<f32>>,
}

fn shape() -> AttnShape {
    AttnShape::new(4, 2, 16).expect("a valid shape")
}

fn config() -> DurableConfig {
    DurableConfig {
        wal: WriterConfig { policy: SyncPolicy::EveryBatch, max_file_bytes: 16 << 10 },
        index_rebuild: IndexRebuild::Blocking,
        ..DurableConfig::default()
    }
}

fn spec(t: usize) -> ContextSpec {
    let wave = WaveParams { segment_tokens: 128, decode_segment_tokens: 32, local_tokens: 8, ..WaveParams::default() };
    let spec = ContextSpec::new(shape(), 1).with_method(if t == 1 { Method::Flat } else { Method::Wave(wave) });
    match t {
        2 => spec.with_codec(Codec::Hack2(HackParams::new(16).expect("valid parameters"))),
        _ => spec,
    }
}

fn exact(engine: &Engine, ctx: ContextId) -> Vec<f32> {
    let mut rng = SplitMix64::new(5);
    let q: Vec<f32> = (0..shape().query_len()).map(|_| rng.normal()).collect();
    let plan = engine.plan(&[Request::new(ctx, 0, q)], &Budget::full()).expect("a plan of a known context");
    engine.execute(&plan).expect("an exact plan executes").remove(0)
}

static COPIES: AtomicU64 = AtomicU64::new(0);

fn scratch(what: &str) -> PathBuf {
    let n = COPIES.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("attnstore-fuzz-recover-{}-{what}-{n}", std::process::id()))
}

fn template() -> &'static Template {
    static TEMPLATE: OnceLock<Template> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        remove_stale_scratch();
        let dir = scratch("template");
        let engine = Engine::open_with(&dir, EngineConfig::default(), config()).expect("a new engine directory");
        let contexts: Vec<ContextId> = (0..3).map(|t| engine.create_context(spec(t)).expect("a valid spec")).collect();
        for i in 0..14 {
            if i == 10 {
                engine.checkpoint().expect("a checkpoint");
            }
            for (t, &ctx) in contexts.iter().enumerate() {
                let tokens = if i == 0 { 160 } else { 1 + (i * 5) % 7 };
                let mut rng = SplitMix64::fork(t as u64, i as u64);
                let n = shape().kv_len(tokens);
                let (k, v): (Vec<f32>, Vec<f32>) = (0..n).map(|_| (rng.normal(), rng.normal())).unzip();
                match i {
                    0 => engine.prefill(ctx, 0, &k, &v),
                    _ => engine.append(ctx, 0, &k, &v),
                }
                .expect("an append to a healthy directory");
            }
        }
        let tokens = contexts.iter().map(|&c| engine.stats(c, 0).expect("a known context").tokens).collect();
        let expected = contexts.iter().map(|&c| exact(&engine, c)).collect();
        drop(engine);
        let mut files = Vec::new();
        collect_files(&dir, Path::new(""), &mut files);
        files.sort();
        Template { dir, files, contexts, tokens, expected }
    })
}

/// Removes the scratch directories of processes that are gone (a template lives as long as
/// its process and is never removed by it).
fn remove_stale_scratch() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("attnstore-fuzz-recover-") else { continue };
        let pid = rest.split('-').next().unwrap_or_default();
        if !Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

fn collect_files(root: &Path, rel: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(root.join(rel)) else { return };
    for entry in entries.flatten() {
        let path = rel.join(entry.file_name());
        match entry.file_type() {
            Ok(t) if t.is_dir() => collect_files(root, &path, out),
            Ok(t) if t.is_file() => out.push(path),
            _ => {}
        }
    }
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

/// Applies one fault, decoded from 4 bytes, to the copy `dir`; I/O errors (e.g. a file an
/// earlier fault deleted) just leave it as it is.
fn apply(dir: &Path, files: &[PathBuf], op: [u8; 4]) {
    let file = &files[op[0] as usize % files.len()];
    let path = dir.join(file);
    // An earlier fault may have put a link (to `/dev/zero`, say) or a directory here: the
    // harness itself reads only regular files.
    if !std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_file()) {
        return;
    }
    let Ok(mut bytes) = std::fs::read(&path) else { return };
    let at = |len: usize| if len == 0 { 0 } else { usize::from(u16::from_le_bytes([op[2], op[3]])) * len / 65536 };
    let value = op[3] | 1;
    let _ = match op[1] % 8 {
        // Set a byte (never to zero) near the start, where headers and early records are...
        0 if !bytes.is_empty() => {
            let i = usize::from(op[2]) % bytes.len();
            bytes[i] = value;
            std::fs::write(&path, &bytes)
        }
        // ...or anywhere.
        1 if !bytes.is_empty() => {
            let i = at(bytes.len());
            bytes[i] = if bytes[i] ^ op[2] == 0 { 0xff } else { bytes[i] ^ op[2] | 1 };
            std::fs::write(&path, &bytes)
        }
        2 => std::fs::OpenOptions::new().write(true).open(&path).and_then(|f| f.set_len(at(bytes.len()) as u64)),
        3 => {
            bytes.extend(std::iter::repeat_n(value, usize::from(op[2]) + 1));
            std::fs::write(&path, &bytes)
        }
        4 => std::fs::remove_file(&path),
        5 => {
            let other = dir.join(&files[op[2] as usize % files.len()]);
            if other == path || !std::fs::symlink_metadata(&other).is_ok_and(|m| m.file_type().is_file()) {
                return;
            }
            match std::fs::read(&other) {
                Ok(theirs) => std::fs::write(&path, theirs).and_then(|()| std::fs::write(&other, bytes)),
                _ => Ok(()),
            }
        }
        6 => std::fs::remove_file(&path).and_then(|()| std::fs::create_dir(&path)),
        7 => {
            let target = ["/dev/zero", "/dev/null", "/nonexistent-attnstore-target"][op[2] as usize % 3];
            std::fs::remove_file(&path).and_then(|()| std::os::unix::fs::symlink(target, &path))
        }
        _ => Ok(()),
    };
}

/// Body of the `recovery_dir` fuzz target: up to 4 faults (4 bytes each) on a copy of the
/// template directory; panics if `check` or `open` panics, or if an engine that opens has
/// lost an acknowledged batch or answers differently.
pub fn fuzz_recover(data: &[u8]) {
    let template = template();
    let copy = scratch("case");
    if copy_dir(&template.dir, &copy).is_err() {
        let _ = std::fs::remove_dir_all(&copy);
        return;
    }
    for op in data.chunks_exact(4).take(4) {
        apply(&copy, &template.files, [op[0], op[1], op[2], op[3]]);
    }
    let checked = super::check(&copy);
    let opened = Engine::open_with(&copy, EngineConfig::default(), DurableConfig { create: false, ..config() });
    match opened {
        Ok(engine) => {
            for (t, &ctx) in template.contexts.iter().enumerate() {
                let tokens = engine.stats(ctx, 0).map(|s| s.tokens).ok();
                assert_eq!(tokens, Some(template.tokens[t]), "context {t}: an acknowledged batch is missing");
                assert!(exact(&engine, ctx) == template.expected[t], "context {t}: recovered KV answers differently");
            }
        }
        Err(error) => {
            assert!(
                !checked.as_ref().is_ok_and(|r| r.is_clean()),
                "check passed a directory that open refuses: {error}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&copy);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seed_corpus_covers_every_fault_and_replays() {
        for input in seed_corpus() {
            fuzz_recover(&input);
        }
    }

    /// One input per fault kind, on several files.
    fn seed_corpus() -> Vec<Vec<u8>> {
        let files = template().files.len() as u8;
        let mut out = vec![Vec::new()];
        for op in 0..8u8 {
            for file in (0..files).step_by(3) {
                out.push(vec![file, op, 0x40 + file, 0x80]);
            }
        }
        out
    }

    #[test]
    #[ignore = "rewrites fuzz/corpus/recovery_dir; run by hand after a format change"]
    fn regenerate_seed_corpus() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/recovery_dir");
        std::fs::create_dir_all(&dir).unwrap();
        for (i, input) in seed_corpus().into_iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i:03}")), input).unwrap();
        }
    }
}
