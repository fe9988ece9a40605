//! Helpers shared by the engine's integration tests: synthetic KV (`synth`), the host blocks
//! a buffered context needs, and copies of durable directories.

// Each test binary uses some of these helpers, none uses all.
#![allow(dead_code)]

pub mod synth;

/// What a `metrics_util` debugging recorder took (its snapshot as a vector).
pub type MetricsSnapshot = Vec<(
    metrics_util::CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    metrics_util::debugging::DebugValue,
)>;

/// The value of metric `name` of `kind` with exactly `labels` in `snapshot`, if recorded.
pub fn metric<'a>(
    snapshot: &'a MetricsSnapshot,
    kind: metrics_util::MetricKind,
    name: &str,
    labels: &[(&str, &str)],
) -> Option<&'a metrics_util::debugging::DebugValue> {
    snapshot
        .iter()
        .find(|(k, _, _, _)| {
            k.kind() == kind
                && k.key().name() == name
                && k.key().labels().count() == labels.len()
                && labels.iter().all(|(l, v)| k.key().labels().any(|x| x.key() == *l && x.value() == *v))
        })
        .map(|(_, _, _, v)| v)
}

use std::path::Path;

use attnstore::{AttnShape, DType};

/// Host blocks that hold all indexed rows of a context: per cluster, K and V each round up
/// to whole blocks (clusters average 16 tokens, so ≤ tokens / 16 + segments partial blocks).
pub fn blocks_for_context(shape: &AttnShape, dtype: DType, tokens: usize, block_bytes: usize) -> usize {
    let per_block = (block_bytes / (shape.head_dim * dtype.size_bytes())).max(1);
    let per_head = tokens.div_ceil(per_block) + tokens / 8 + 64;
    2 * per_head * shape.kv_heads
}

/// Copies the directory tree `from` to `to` (files and folders; recovery repairs what it
/// opens, so tests damage and open copies).
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Bytes a directory's files occupy on disk (allocated blocks), recursively.
pub fn allocated(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            let meta = e.metadata().unwrap();
            if meta.is_dir() {
                allocated(&e.path())
            } else {
                meta.blocks() * 512
            }
        })
        .sum()
}

/// A durable engine at `dir` whose context `ctx` has a PQ layer 0 homed in its codes: with
/// the layer's codebook file gone, opening is `Corrupt` naming the codebooks (its rows live
/// only in the codes); with the file back, the home is restored.
pub fn codebooks_are_needed(dir: &Path, ctx: attnstore::ContextId) {
    use attnstore::{Engine, EngineConfig, Error};
    let layout = dir.join("index").join(format!("ctx-{}-layer-0.pq", ctx.0));
    let saved = std::fs::read(&layout).unwrap();
    std::fs::remove_file(&layout).unwrap();
    match Engine::open(dir, EngineConfig::default()) {
        Err(Error::Corrupt { detail, .. }) => {
            assert!(detail.contains("codebooks") && detail.contains("live only there"), "{detail}")
        }
        Err(e) => panic!("expected Corrupt, got {e}"),
        Ok(_) => panic!("opened without the codebooks its home relies on"),
    }
    std::fs::write(&layout, &saved).unwrap();
    assert_eq!(Engine::open(dir, EngineConfig::default()).unwrap().recovery_report().unwrap().homes_restored, 1);
}
