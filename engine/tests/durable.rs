//! The durable engine end to end: reopen recovers exactly what was committed, torn logs and
//! uncommitted data are cut, corruption and missing files are typed errors naming the file
//! and offset, and a full disk or failed fsync never leaves half-visible batches.

mod common;
use common::copy_dir;
use common::synth::{SynthContext, SynthParams};

use std::path::{Path, PathBuf};
use std::sync::Arc;

use attnstore::durable::{DATA_DIR, WAL_DIR};
use attnstore::{
    AttnShape, Budget, ContextId, ContextSpec, DType, DurableConfig, Engine, EngineConfig, Error, IndexRebuild, Method,
    Request, WaveParams,
};
use attnstore_wal::{list_log_files, FaultyStorage, SyncPolicy, WriterConfig};

fn shape() -> AttnShape {
    AttnShape::new(4, 2, 16).unwrap()
}

fn spec() -> ContextSpec {
    let wave = WaveParams { segment_tokens: 256, decode_segment_tokens: 64, local_tokens: 16, ..WaveParams::default() };
    ContextSpec::new(shape(), 2).with_method(Method::Wave(wave))
}

/// Batch `i`: a prefill of 300 tokens for i = 0, then appends of 1..=9 tokens.
fn batch(i: usize) -> (usize, usize, bool) {
    if i == 0 {
        return (0, 300, true);
    }
    let from = 300 + (i - 1) * 5;
    (from, from + 1 + i % 9, false)
}

fn ingest(engine: &Engine, ctx: ContextId, synth: &SynthContext, i: usize) -> Result<(), Error> {
    let (from, to, prefill) = batch(i);
    let (k, v) = synth.slice(from, to);
    for layer in 0..2 {
        if prefill {
            engine.prefill(ctx, layer, &k, &v)?;
        } else {
            engine.append(ctx, layer, &k, &v)?;
        }
    }
    Ok(())
}

fn synth() -> SynthContext {
    SynthContext::generate(SynthParams::new(shape(), 600, 3))
}

/// Attention of one decode step, full budget and sparse, over layer `layer`.
fn attention(engine: &Engine, ctx: ContextId, synth: &SynthContext, layer: usize) -> Vec<Vec<f32>> {
    [Budget::full(), Budget::default().with_retrieve_floor(16).with_retrieve(0.1)]
        .iter()
        .map(|budget| {
            let plan = engine.plan(&[Request::new(ctx, layer, synth.queries(1))], budget).unwrap();
            engine.execute(&plan).unwrap().remove(0)
        })
        .collect()
}

/// An in-memory engine holding batches `0..n`: what a recovered engine must equal.
fn reference(synth: &SynthContext, n: usize) -> (Engine, ContextId) {
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let ctx = engine.create_context(spec()).unwrap();
    for i in 0..n {
        ingest(&engine, ctx, synth, i).unwrap();
    }
    (engine, ctx)
}

fn assert_holds_batches(engine: &Engine, ctx: ContextId, synth: &SynthContext, n: usize) {
    let (want, want_ctx) = reference(synth, n);
    for layer in 0..2 {
        let stored = engine.stored_batches(ctx, layer).unwrap();
        assert_eq!(stored.len(), n, "layer {layer}");
        for (i, b) in stored.iter().enumerate() {
            let (from, to, prefill) = batch(i);
            let (k, v) = synth.slice(from, to);
            let round = |x: &[f32]| x.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect::<Vec<_>>();
            assert_eq!((b.prefill, b.tokens), (prefill, to - from), "batch {i}");
            assert_eq!((&b.keys, &b.values), (&round(&k), &round(&v)), "batch {i} bytes");
        }
        assert_eq!(engine.stats(ctx, layer).unwrap().tokens, want.stats(want_ctx, layer).unwrap().tokens);
        assert_eq!(attention(engine, ctx, synth, layer), attention(&want, want_ctx, synth, layer), "layer {layer}");
    }
}

fn log_files(dir: &Path) -> Vec<PathBuf> {
    list_log_files(&dir.join(WAL_DIR)).unwrap().into_iter().map(|(_, p)| p).collect()
}

#[test]
fn reopening_recovers_every_committed_batch_byte_exact_with_equal_attention() {
    let dir = tempfile::tempdir().unwrap();
    let synth = synth();
    let ctx = {
        let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
        let ctx = engine.create_context(spec()).unwrap();
        for i in 0..6 {
            ingest(&engine, ctx, &synth, i).unwrap();
        }
        let checkpoint = engine.checkpoint().unwrap();
        assert_eq!(checkpoint.generation, 1);
        for i in 6..12 {
            ingest(&engine, ctx, &synth, i).unwrap();
        }
        assert_holds_batches(&engine, ctx, &synth, 12);
        ctx
    };
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    let report = engine.recovery_report().unwrap().clone();
    assert_eq!(report.manifest_generation, Some(1));
    assert_eq!(report.replayed.appends, 12, "6 batches × 2 layers after the checkpoint\n{report}");
    assert_eq!((report.contexts, report.layers_loaded), (1, 2));
    assert!(report.torn_tail.is_none());
    assert_holds_batches(&engine, ctx, &synth, 12);
    // New contexts never reuse an id, and the engine keeps working after recovery.
    let other = engine.create_context(spec()).unwrap();
    assert!(other.0 > ctx.0);
    ingest(&engine, ctx, &synth, 12).unwrap();
    drop(engine);
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    assert_holds_batches(&engine, ctx, &synth, 13);
    assert_eq!(engine.contexts(), vec![ctx, other]);
}

#[test]
fn a_checkpoint_deletes_covered_log_files_and_a_dropped_context_stays_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let synth = synth();
    let config = DurableConfig {
        wal: WriterConfig { policy: SyncPolicy::EveryBatch, max_file_bytes: 256 },
        ..DurableConfig::default()
    };
    let (keep, gone) = {
        let engine = Engine::open_with(dir.path(), EngineConfig::default(), config.clone()).unwrap();
        let keep = engine.create_context(spec()).unwrap();
        let gone = engine.create_context(spec()).unwrap();
        for i in 0..8 {
            ingest(&engine, keep, &synth, i).unwrap();
            ingest(&engine, gone, &synth, i).unwrap();
        }
        assert!(log_files(dir.path()).len() > 3);
        engine.drop_context(gone).unwrap();
        let report = engine.checkpoint().unwrap();
        assert!(report.removed_log_files > 3, "{report:?}");
        assert_eq!(log_files(dir.path()).len(), 1);
        (keep, gone)
    };
    let names: Vec<String> = std::fs::read_dir(dir.path().join(DATA_DIR))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(names.iter().all(|n| !n.contains(&format!("{:010}", gone.0))), "{names:?}");
    let engine = Engine::open_with(dir.path(), EngineConfig::default(), config).unwrap();
    assert_eq!(engine.contexts(), vec![keep]);
    assert_holds_batches(&engine, keep, &synth, 8);
}

/// Writes batches 0..5 and returns the directory and the log file holding them.
fn five_batches() -> (tempfile::TempDir, ContextId, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let synth = synth();
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    let ctx = engine.create_context(spec()).unwrap();
    for i in 0..5 {
        ingest(&engine, ctx, &synth, i).unwrap();
    }
    drop(engine);
    let log = log_files(dir.path()).pop().unwrap();
    (dir, ctx, log)
}

#[test]
fn a_crash_in_the_last_log_write_recovers_the_prefix_and_appends_go_on_in_the_same_file() {
    let (dir, ctx, log) = five_batches();
    let full = std::fs::read(&log).unwrap();
    let ends = attnstore_wal::RecordReader::open_log(&full).unwrap().map(|r| r.unwrap().end()).collect::<Vec<_>>();
    let written = *ends.last().unwrap();
    let copy = tempfile::tempdir().unwrap();
    let sector = attnstore_wal::SECTOR_BYTES;
    // The last group write lands up to some sector boundary; the rest stays zero.
    for landed in (sector..written).step_by(sector) {
        // Work on a copy: recovery repairs what it opens.
        let _ = std::fs::remove_dir_all(copy.path());
        copy_dir(dir.path(), copy.path());
        let mut crashed = full.clone();
        crashed[landed..].fill(0);
        std::fs::write(copy.path().join(WAL_DIR).join(log.file_name().unwrap()), &crashed).unwrap();
        let engine =
            Engine::open(copy.path(), EngineConfig::default()).unwrap_or_else(|e| panic!("landed {landed}: {e}"));
        let report = engine.recovery_report().unwrap();
        let whole = ends.iter().filter(|&&end| end <= landed).count();
        assert_eq!(report.torn_tail.is_some(), !ends.contains(&landed), "landed {landed}");
        // One create record, then one append per (batch, layer).
        let batches = engine.stored_batches(ctx, 0).unwrap().len() + engine.stored_batches(ctx, 1).unwrap().len();
        assert_eq!(batches, whole - 1, "landed {landed}");
        let files_before = list_log_files(&copy.path().join(WAL_DIR)).unwrap().len();
        let (k, v) = synth().slice(0, 2);
        engine.append(ctx, 0, &k, &v).unwrap();
        drop(engine);
        let check = attnstore::durable::check(copy.path()).unwrap();
        assert_eq!((check.torn_tail, check.log_files.len()), (None, files_before), "landed {landed}");
    }
}

#[test]
fn a_truncated_log_is_damage_unless_point_in_time_recovery_is_asked_for_and_then_reports_the_cut() {
    let (dir, ctx, log) = five_batches();
    let full = std::fs::read(&log).unwrap();
    let ends = attnstore_wal::RecordReader::open_log(&full).unwrap().map(|r| r.unwrap().end()).collect::<Vec<_>>();
    let copy = tempfile::tempdir().unwrap();
    for cut in [0, 20, 40, ends[0] + 3, ends[ends.len() - 2], *ends.last().unwrap() - 1, *ends.last().unwrap()] {
        let _ = std::fs::remove_dir_all(copy.path());
        copy_dir(dir.path(), copy.path());
        let path = copy.path().join(WAL_DIR).join(log.file_name().unwrap());
        std::fs::write(&path, &full[..cut]).unwrap();
        let error = Engine::open(copy.path(), EngineConfig::default()).err().expect("a truncated log is refused");
        assert!(error.to_string().contains(&*log.file_name().unwrap().to_string_lossy()), "cut {cut}: {error}");
        assert!(attnstore::durable::check(copy.path()).is_err(), "check fails too at cut {cut}");
        let pit = DurableConfig { recovery: attnstore_wal::RecoveryMode::PointInTime, ..DurableConfig::default() };
        let engine = Engine::open_with(copy.path(), EngineConfig::default(), pit).unwrap();
        let report = engine.recovery_report().unwrap();
        let cut_at = report.log_cut.clone().expect("the cut is reported");
        let kept = ends.iter().filter(|&&end| end <= cut).count();
        assert_eq!(cut_at.next_lsn, 1 + kept as u64, "cut {cut}");
        if kept > 0 {
            let batches = engine.stored_batches(ctx, 0).unwrap().len() + engine.stored_batches(ctx, 1).unwrap().len();
            assert_eq!(batches, kept - 1, "cut {cut}");
        } else {
            assert!(engine.stats(ctx, 0).is_err(), "the context's creation was cut too");
        }
        drop(engine);
        assert!(attnstore::durable::check(copy.path()).is_ok(), "repaired at cut {cut}");
    }
}

#[test]
fn a_bit_flip_in_the_middle_of_the_log_is_an_error_naming_file_and_offset() {
    let (dir, _, log) = five_batches();
    let mut bytes = std::fs::read(&log).unwrap();
    let second = attnstore_wal::RecordReader::open_log(&bytes).unwrap().nth(1).unwrap().unwrap();
    let (offset, end) = (second.offset, second.end());
    bytes[end - 2] ^= 0x20;
    std::fs::write(&log, &bytes).unwrap();
    for outcome in
        [Engine::open(dir.path(), EngineConfig::default()).err(), attnstore::durable::check(dir.path()).err()]
    {
        match outcome {
            Some(Error::Wal(attnstore_wal::Error::InFile { file, source })) => {
                assert_eq!(file, log);
                assert_eq!(source.offset(), Some(offset));
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_bit_flip_in_a_data_file_is_an_error_naming_file_and_chunk_offset() {
    let (dir, ctx, _) = five_batches();
    let data = dir.path().join(DATA_DIR).join(format!("ctx-{:010}-layer-0001.kv", ctx.0));
    let mut bytes = std::fs::read(&data).unwrap();
    let at = bytes.len() - 7;
    bytes[at] ^= 0x01;
    std::fs::write(&data, &bytes).unwrap();
    let err = Engine::open(dir.path(), EngineConfig::default()).err().unwrap();
    match &err {
        Error::Corrupt { file, offset, detail } => {
            assert_eq!(file, &data);
            assert!(*offset > 0 && *offset < at as u64, "{err}");
            assert!(detail.contains("checksum"), "{err}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(attnstore::durable::check(dir.path()).err(), Some(err));
}

#[test]
fn a_missing_or_short_data_file_is_a_typed_error() {
    let (dir, ctx, _) = five_batches();
    let data = dir.path().join(DATA_DIR).join(format!("ctx-{:010}-layer-0000.kv", ctx.0));
    let len = std::fs::metadata(&data).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&data).unwrap().set_len(len - 1).unwrap();
    match Engine::open(dir.path(), EngineConfig::default()).err() {
        Some(Error::DataFileShort { file, expected_bytes, got_bytes }) => {
            assert_eq!((file, expected_bytes, got_bytes), (data.clone(), len, len - 1))
        }
        other => panic!("{other:?}"),
    }
    std::fs::remove_file(&data).unwrap();
    match Engine::open(dir.path(), EngineConfig::default()).err() {
        Some(Error::MissingDataFile { file, committed_bytes }) => assert_eq!((file, committed_bytes), (data, len)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_full_disk_during_a_data_write_fails_the_append_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let synth = synth();
    let storage = FaultyStorage::new();
    let config = DurableConfig { storage: Arc::new(storage.clone()), ..DurableConfig::default() };
    let engine = Engine::open_with(dir.path(), EngineConfig::default(), config.clone()).unwrap();
    let ctx = engine.create_context(spec()).unwrap();
    for i in 0..3 {
        ingest(&engine, ctx, &synth, i).unwrap();
    }
    let tokens = engine.stats(ctx, 0).unwrap().tokens;
    storage.set_write_budget(40);
    let (k, v) = synth.slice(400, 404);
    let err = engine.append(ctx, 0, &k, &v).unwrap_err();
    assert!(
        matches!(&err, Error::Wal(attnstore_wal::Error::Io { kind: std::io::ErrorKind::StorageFull, .. })),
        "{err}"
    );
    assert_eq!(engine.stats(ctx, 0).unwrap().tokens, tokens, "a failed append is not visible");
    // Space comes back: the data write is retried at the same offset and commits.
    storage.set_write_budget(u64::MAX);
    ingest(&engine, ctx, &synth, 3).unwrap();
    drop(engine);
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    assert_holds_batches(&engine, ctx, &synth, 4);
}

#[test]
fn a_full_disk_during_the_log_write_or_a_failed_fsync_poisons_and_reopen_recovers_the_acknowledged() {
    for fail_sync in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let synth = synth();
        let storage = FaultyStorage::new();
        let config = DurableConfig { storage: Arc::new(storage.clone()), ..DurableConfig::default() };
        let engine = Engine::open_with(dir.path(), EngineConfig::default(), config).unwrap();
        let ctx = engine.create_context(spec()).unwrap();
        for i in 0..3 {
            ingest(&engine, ctx, &synth, i).unwrap();
        }
        let (k, v) = synth.slice(400, 402);
        let chunk_bytes = 48 + 2 * 2 * 16 * 2 * 2;
        if fail_sync {
            storage.fail_syncs(true);
        } else {
            // The data chunk fits, the log frame does not.
            storage.set_write_budget(chunk_bytes as u64 + 5);
        }
        let err = engine.append(ctx, 0, &k, &v).unwrap_err();
        assert!(matches!(&err, Error::Wal(attnstore_wal::Error::Poisoned { .. })), "{err}");
        storage.fail_syncs(false);
        storage.set_write_budget(u64::MAX);
        let again = engine.append(ctx, 1, &k, &v).unwrap_err();
        assert!(
            matches!(&again, Error::Wal(attnstore_wal::Error::Poisoned { .. })),
            "refused after poisoning: {again}"
        );
        assert!(matches!(engine.checkpoint(), Err(Error::Wal(attnstore_wal::Error::Poisoned { .. }))));
        drop(engine);
        let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
        assert_holds_batches(&engine, ctx, &synth, 3);
    }
}

#[test]
fn in_memory_engines_refuse_durable_calls_and_other_policies_still_recover_after_close() {
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    assert!(matches!(engine.checkpoint(), Err(Error::NotDurable(_))));
    assert!(!engine.is_durable());
    for policy in [SyncPolicy::None, SyncPolicy::Interval(std::time::Duration::from_millis(2))] {
        let dir = tempfile::tempdir().unwrap();
        let synth = synth();
        let config =
            DurableConfig { wal: WriterConfig { policy, ..WriterConfig::default() }, ..DurableConfig::default() };
        let ctx = {
            let engine = Engine::open_with(dir.path(), EngineConfig::default(), config.clone()).unwrap();
            let ctx = engine.create_context(spec().with_dtype(DType::F16)).unwrap();
            for i in 0..4 {
                ingest(&engine, ctx, &synth, i).unwrap();
            }
            engine.sync().unwrap();
            ctx
        };
        let engine = Engine::open_with(dir.path(), EngineConfig::default(), config).unwrap();
        assert_holds_batches(&engine, ctx, &synth, 4);
    }
}

#[test]
fn a_background_rebuild_serves_the_kv_at_once_and_swaps_in_the_same_index_including_new_appends() {
    let dir = tempfile::tempdir().unwrap();
    let synth = synth();
    let ctx = {
        let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
        let ctx = engine.create_context(spec()).unwrap();
        for i in 0..8 {
            ingest(&engine, ctx, &synth, i).unwrap();
        }
        ctx
    };
    let config = DurableConfig { index_rebuild: IndexRebuild::Background, ..DurableConfig::default() };
    let engine = Engine::open_with(dir.path(), EngineConfig::default(), config).unwrap();
    assert_eq!(engine.recovery_report().unwrap().background_rebuild_layers, 2);
    // Served at once (exactly until the index is back), and appends keep working meanwhile.
    let (want, want_ctx) = reference(&synth, 8);
    let full = |e: &Engine, c| loop {
        let plan = e.plan(&[Request::new(c, 0, synth.queries(1))], &Budget::full()).unwrap();
        match e.execute(&plan) {
            Ok(mut out) => break out.remove(0),
            // The rebuilt index may be swapped in between the two calls: plan again, as the
            // error says (the rebuild's own race, seen once in CI).
            Err(attnstore::Error::StalePlan { .. }) => continue,
            Err(e) => panic!("{e}"),
        }
    };
    let (got, expected) = (full(&engine, ctx), full(&want, want_ctx));
    let err = got.iter().zip(&expected).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(err < 1e-4, "{err}");
    ingest(&engine, ctx, &synth, 8).unwrap();
    assert!(engine.wait_index_rebuild(std::time::Duration::from_secs(120)).unwrap());
    assert!(engine.index_rebuild_time().is_some());
    assert_holds_batches(&engine, ctx, &synth, 9);
}

#[test]
fn concurrent_drops_of_one_context_log_it_once_and_the_directory_reopens() {
    let dir = tempfile::tempdir().unwrap();
    let synth = synth();
    {
        let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
        for _ in 0..8 {
            let ctx = engine.create_context(spec()).unwrap();
            ingest(&engine, ctx, &synth, 0).unwrap();
            let outcomes: Vec<_> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..4).map(|_| s.spawn(|| engine.drop_context(ctx))).collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert_eq!(outcomes.iter().filter(|o| o.is_ok()).count(), 1, "{outcomes:?}");
            assert!(outcomes.iter().all(|o| matches!(o, Ok(()) | Err(Error::UnknownContext(_)))));
        }
    }
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    assert!(engine.contexts().is_empty());
    assert_eq!(engine.recovery_report().unwrap().replayed.drops, 8);
}

#[test]
fn a_second_engine_cannot_open_a_directory_in_use_until_the_first_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let first = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    match Engine::open(dir.path(), EngineConfig::default()) {
        Err(Error::DirectoryLocked { dir: locked, .. }) => assert_eq!(locked, dir.path()),
        other => panic!("{:?}", other.map(|_| ())),
    }
    drop(first);
    Engine::open(dir.path(), EngineConfig::default()).unwrap();
}

#[test]
fn a_damaged_manifest_or_a_missing_log_file_is_a_typed_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let synth = synth();
    {
        let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
        let ctx = engine.create_context(spec()).unwrap();
        ingest(&engine, ctx, &synth, 0).unwrap();
        engine.checkpoint().unwrap();
        ingest(&engine, ctx, &synth, 1).unwrap();
    }
    let manifest = dir.path().join(attnstore::durable::MANIFEST_FILE);
    let good = std::fs::read(&manifest).unwrap();
    let mut bad = good.clone();
    *bad.last_mut().unwrap() ^= 0x08;
    std::fs::write(&manifest, &bad).unwrap();
    match Engine::open(dir.path(), EngineConfig::default()).err() {
        Some(Error::Wal(e @ (attnstore_wal::Error::InFile { .. } | attnstore_wal::Error::BadManifest { .. }))) => {
            assert!(e.to_string().contains("MANIFEST"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    std::fs::write(&manifest, &good).unwrap();
    for log in log_files(dir.path()) {
        std::fs::remove_file(log).unwrap();
    }
    // The appends after the checkpoint lived only in the log: losing it is an error, not an empty log.
    for outcome in
        [attnstore::durable::check(dir.path()).err(), Engine::open(dir.path(), EngineConfig::default()).err()]
    {
        match outcome {
            Some(Error::MissingLog { file, expected_lsn }) => {
                assert_eq!(file, dir.path().join(WAL_DIR).join(attnstore_wal::log_file_name(expected_lsn)));
                assert!(expected_lsn > 1);
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_hack2_context_reopens_with_the_same_codec_and_identical_attention() {
    // Data files hold the f16 rows; recovery rebuilds the segments and re-derives the same
    // 2-bit codes (seeded), so attention after reopening is bit-identical.
    let dir = tempfile::tempdir().unwrap();
    let synth = synth();
    let spec = spec().with_codec(attnstore::Codec::Hack2(attnstore::HackParams::default()));
    let (ctx, before) = {
        let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
        let ctx = engine.create_context(spec.clone()).unwrap();
        for i in 0..6 {
            ingest(&engine, ctx, &synth, i).unwrap();
        }
        engine.checkpoint().unwrap();
        for i in 6..12 {
            ingest(&engine, ctx, &synth, i).unwrap();
        }
        assert!(engine.stats(ctx, 0).unwrap().segments >= 1, "the test must cover 2-bit segments");
        (ctx, (0..2).map(|l| attention(&engine, ctx, &synth, l)).collect::<Vec<_>>())
    };
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    assert!(engine.wait_index_rebuild(std::time::Duration::from_secs(60)).unwrap());
    assert_eq!(engine.spec(ctx).unwrap().codec, spec.codec);
    let after: Vec<_> = (0..2).map(|l| attention(&engine, ctx, &synth, l)).collect();
    assert_eq!(after, before);
}

#[test]
fn a_checkpointed_index_layout_restores_wave_layers_without_clustering_and_a_bad_one_is_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let synth = synth();
    let ctx = {
        let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
        let ctx = engine.create_context(spec()).unwrap();
        for i in 0..30 {
            ingest(&engine, ctx, &synth, i).unwrap();
        }
        let checkpoint = engine.checkpoint().unwrap();
        assert_eq!(checkpoint.layouts_written, 2, "one layout per wave layer");
        assert!(checkpoint.layout_bytes > 0);
        // Nothing was re-segmented since: the next checkpoint keeps the files.
        assert_eq!(engine.checkpoint().unwrap().layouts_written, 0);
        for i in 30..40 {
            ingest(&engine, ctx, &synth, i).unwrap();
        }
        ctx
    };
    let layout_file = dir.path().join("index").join(format!("ctx-{}-layer-1.layout", ctx.0));
    assert!(layout_file.exists());
    {
        let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
        let report = engine.recovery_report().unwrap().clone();
        assert_eq!(report.layouts_restored, 2, "{report}");
        assert!(report.layout_errors.is_empty(), "{report}");
        assert!(report.to_string().contains("2 layers restored without clustering"), "{report}");
        // Same segments, clusters and answers (sparse plans included) as the engine that wrote them.
        assert_holds_batches(&engine, ctx, &synth, 40);
    }
    // A damaged layout is reported, and that layer is rebuilt from its KV: still the same answers.
    let mut bytes = std::fs::read(&layout_file).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&layout_file, bytes).unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    let report = engine.recovery_report().unwrap().clone();
    assert_eq!(report.layouts_restored, 1, "{report}");
    assert_eq!(report.layout_errors.len(), 1, "{report}");
    assert!(report.layout_errors[0].contains("layer-1.layout"), "{report}");
    assert_holds_batches(&engine, ctx, &synth, 40);
    // A background rebuild uses the intact layout too and swaps in the same index.
    drop(engine);
    let config = DurableConfig { index_rebuild: IndexRebuild::Background, ..DurableConfig::default() };
    let engine = Engine::open_with(dir.path(), EngineConfig::default(), config).unwrap();
    assert!(engine.wait_index_rebuild(std::time::Duration::from_secs(120)).unwrap());
    assert_holds_batches(&engine, ctx, &synth, 40);
    // Dropping the context makes its layouts stale: the next checkpoint removes them.
    engine.drop_context(ctx).unwrap();
    engine.checkpoint().unwrap();
    assert!(!layout_file.exists());
}
