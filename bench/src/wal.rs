//! `attnstore bench-wal`: the durability figures, each against a baseline measured in the
//! same run — group-commit append throughput vs one sequential write + fsync of the same
//! bytes, recovery time per GB of KV, and the first attention after reopening a long
//! context vs recomputing its index from the prompt's KV.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use attnstore_wal::{LogWriter, RecordKind, StdStorage, SyncPolicy, WriterConfig, WriterStats};

use attnstore::durable::{chunk_bytes, DATA_DIR, INDEX_DIR};
use attnstore::{
    AttnShape, Budget, Codec, ContextId, ContextSpec, DType, DurableConfig, Engine, EngineConfig, HackParams,
    IndexRebuild, Method, PqParams, Request, Strategy,
};

use crate::memory;
use crate::synth::{SynthContext, SynthParams};
use crate::{Error, Result};

/// Settings of the durability bench.
#[derive(Debug, Clone)]
pub struct WalBenchConfig {
    /// Scratch directory (created, and deleted at the end).
    pub dir: PathBuf,
    /// Appending threads.
    pub threads: usize,
    /// Records (or engine batches) per thread.
    pub records_per_thread: usize,
    /// Payload bytes per WAL record.
    pub record_bytes: usize,
    /// WAL records each thread keeps in flight in the pipelined condition
    /// ([`attnstore_wal::LogWriter::submit`], acknowledged by `wait_durable`).
    pub pipeline: usize,
    /// Tokens per engine append batch.
    pub batch_tokens: usize,
    /// Tokens of the long context (recovery and first-attention figures); 0 skips them.
    pub context_tokens: usize,
    /// Layers of the long context.
    pub layers: usize,
    /// Shape of the contexts.
    pub shape: AttnShape,
}

impl WalBenchConfig {
    /// Checks that every count is at least 1 (a rate over no records, threads or tokens means
    /// nothing) and that the shape is usable.
    pub fn validate(&self) -> Result<()> {
        let counts = [
            ("threads", self.threads, "appending threads"),
            ("records_per_thread", self.records_per_thread, "records (and engine batches) per thread"),
            ("pipeline", self.pipeline, "records in flight per thread in the pipelined condition"),
            ("batch_tokens", self.batch_tokens, "tokens per engine append batch"),
            ("layers", self.layers, "layers of the long context"),
        ];
        for (name, value, what) in counts {
            if value == 0 {
                return Err(Error::InvalidSetting(format!(
                    "bench-wal {name} ({what}) must be at least 1, got 0: rates over nothing mean nothing"
                )));
            }
        }
        Ok(ContextSpec::new(self.shape, self.layers).validate()?)
    }

    /// Bytes the long-context figures hold at their peak with a context of `tokens` tokens
    /// (0: they are skipped): the synthetic f32 keys and values, and per layer twice a wave
    /// f16 context (the largest of the conditions: each engine is dropped before the next
    /// opens, but the allocator keeps much of what one freed) plus its f16 rows read back
    /// on reopening. Measured: peak RSS of `attnstore bench-wal --tokens 64K` 1.83 GiB,
    /// estimated 2.08 GiB. `None` past `u64`.
    pub fn context_bytes_needed(&self, tokens: usize) -> Option<u64> {
        if tokens == 0 {
            return Some(0);
        }
        let memory = |method: &Method| memory::context_bytes(&self.shape, Codec::F16, method, tokens);
        let per_layer = memory(&Method::default())?.checked_mul(2)?.checked_add(memory(&Method::Flat)?)?;
        memory::run_bytes(&self.shape, tokens, per_layer.checked_mul(self.layers as u64))
    }
}

/// Bytes the files under `dir` occupy on disk (allocated blocks: punched holes do not count).
fn allocated(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .filter_map(|e| e.metadata().ok().map(|m| (e.path(), m)))
        .map(|(path, m)| if m.is_dir() { allocated(&path) } else { m.blocks() * 512 })
        .sum()
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn fresh(dir: &Path) -> Result<()> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).map_err(|e| attnstore_wal::Error::io("create dir", dir, &e))?;
    Ok(())
}

/// Runs `threads` appenders, each calling `work` once, on a fresh log in `dir`; returns the
/// time until all of them are done and the writer's statistics.
fn run_appenders(
    dir: &Path,
    config: WriterConfig,
    threads: usize,
    work: impl Fn(&LogWriter) -> Result<()> + Sync,
) -> Result<(Duration, WriterStats)> {
    fresh(dir)?;
    // A scratch log no engine replays: any directory id serves; its first record gets lsn 1.
    let log = LogWriter::create(dir, Arc::new(StdStorage), config, 1, 1)?;
    let started = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..threads).map(|_| s.spawn(|| work(&log))).collect();
        handles.into_iter().try_for_each(|h| h.join().expect("bench thread panicked"))
    })?;
    let took = started.elapsed();
    let stats = log.stats();
    log.close()?;
    Ok((took, stats))
}

/// One throughput line: `mb` megabytes in `count` records (or batches, `unit`) acknowledged
/// within `took`, with the log's fsyncs.
fn rate_line(what: &str, unit: &str, mb: f64, count: usize, took: Duration, stats: WriterStats) -> String {
    format!(
        "  {what} {:8.1} MB/s  {:9.0} {unit}/s  {} log fsyncs ({:.1} {unit} per fsync)",
        mb / secs(took),
        count as f64 / secs(took),
        stats.syncs,
        count as f64 / stats.syncs.max(1) as f64
    )
}

/// One sequential writer, `pieces` writes of `piece_bytes`, one fsync at the end.
fn sequential_write_then_fsync(path: &Path, pieces: usize, piece_bytes: usize) -> Result<Duration> {
    let io = |e: std::io::Error| Error::from(attnstore_wal::Error::io("bench write", path, &e));
    let piece = vec![0x5a_u8; piece_bytes];
    let started = Instant::now();
    let mut file = File::create(path).map_err(io)?;
    for _ in 0..pieces {
        file.write_all(&piece).map_err(io)?;
    }
    file.sync_data().map_err(io)?;
    Ok(started.elapsed())
}

/// The contexts of the engine-append figures: flat f16.
fn append_spec(shape: AttnShape) -> ContextSpec {
    ContextSpec::new(shape, 1).with_method(Method::Flat).with_dtype(DType::F16)
}

/// Engine appends on a fresh durable engine in `dir`: one flat f16 context per thread,
/// `records_per_thread` batches of `batch_tokens` each, acknowledged one at a time
/// (`append`) or with `pipeline` in flight (`submit_append` + `wait_durable`). Returns the
/// time until every batch is acknowledged and the log's statistics.
fn engine_appends(cfg: &WalBenchConfig, dir: &Path, pipeline: Option<usize>) -> Result<(Duration, WriterStats)> {
    fresh(dir)?;
    let shape = cfg.shape;
    let engine = Engine::open(dir, EngineConfig::default())?;
    let spec = append_spec(shape);
    let contexts =
        (0..cfg.threads).map(|_| engine.create_context(spec.clone())).collect::<attnstore::Result<Vec<_>>>()?;
    let kv: Vec<f32> = (0..shape.kv_len(cfg.batch_tokens)).map(|i| ((i % 97) as f32 - 48.0) * 0.01).collect();
    let syncs_before = engine.wal_stats()?.syncs;
    let started = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = contexts
            .iter()
            .map(|&ctx| {
                let (engine, kv) = (&engine, &kv);
                s.spawn(move || -> Result<()> {
                    let Some(pipeline) = pipeline else {
                        for _ in 0..cfg.records_per_thread {
                            engine.append(ctx, 0, kv, kv)?;
                        }
                        return Ok(());
                    };
                    let mut inflight = std::collections::VecDeque::with_capacity(pipeline + 1);
                    for _ in 0..cfg.records_per_thread {
                        inflight.push_back(engine.submit_append(ctx, 0, kv, kv)?);
                        if inflight.len() > pipeline {
                            engine.wait_durable(inflight.pop_front().expect("non-empty"))?;
                        }
                    }
                    if let Some(last) = inflight.pop_back() {
                        engine.wait_durable(last)?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| h.join().expect("bench thread panicked"))
    })?;
    let took = started.elapsed();
    let mut stats = engine.wal_stats()?;
    stats.syncs -= syncs_before;
    drop(engine);
    let _ = std::fs::remove_dir_all(dir);
    Ok((took, stats))
}

/// Runs the bench, printing each figure as it is measured; removes its scratch directory.
pub fn run(cfg: &WalBenchConfig, out: &mut dyn Write) -> Result<()> {
    cfg.validate()?;
    let outcome = measure(cfg, out);
    let _ = std::fs::remove_dir_all(&cfg.dir);
    outcome
}

fn measure(cfg: &WalBenchConfig, out: &mut dyn Write) -> Result<()> {
    let p = |out: &mut dyn Write, line: String| {
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    };
    fresh(&cfg.dir)?;
    let threads = cfg.threads;
    let records = threads * cfg.records_per_thread;

    // 1. WAL records: group commit vs one sequential write + fsync of the same frame bytes.
    let frame = attnstore_wal::FRAME_HEADER_BYTES + cfg.record_bytes;
    let total = records * frame;
    let base = sequential_write_then_fsync(&cfg.dir.join("baseline.bin"), records, frame)?;
    let per_record = {
        let path = cfg.dir.join("baseline-each.bin");
        let n = records.min(2000);
        let io = |e: std::io::Error| Error::from(attnstore_wal::Error::io("bench write", &path, &e));
        let mut file = File::create(&path).map_err(io)?;
        let piece = vec![0x5a_u8; frame];
        let started = Instant::now();
        for _ in 0..n {
            file.write_all(&piece).map_err(io)?;
            file.sync_data().map_err(io)?;
        }
        started.elapsed().as_secs_f64() / n as f64
    };
    let wal_dir = cfg.dir.join("wal");
    let config = WriterConfig { policy: SyncPolicy::EveryBatch, max_file_bytes: 64 << 20 };
    let payload = vec![0xa5_u8; cfg.record_bytes];
    let (group, stats) = run_appenders(&wal_dir, config, threads, |log| {
        for _ in 0..cfg.records_per_thread {
            log.append(RecordKind::AppendKv, &payload)?;
        }
        Ok(())
    })?;
    let mb = total as f64 / 1e6;
    p(
        out,
        format!(
            "wal append: {threads} threads x {} records of {} B ({mb:.1} MB), sync every batch",
            cfg.records_per_thread, cfg.record_bytes
        ),
    );
    let rate = |what: &str, took: Duration, stats: WriterStats| rate_line(what, "records", mb, records, took, stats);
    p(out, rate("group commit       ", group, stats));
    p(out, format!("  baseline: 1 sequential write stream + 1 fsync of the same bytes {:8.1} MB/s", mb / secs(base)));
    p(
        out,
        format!(
            "  baseline: fsync after every record (no group commit): {:.3} ms per record = {:.0} records/s",
            per_record * 1e3,
            1.0 / per_record
        ),
    );
    p(out, format!("  ratio group commit / sequential write+fsync: {:.2}", secs(base) / secs(group)));

    // 1b. The same records pipelined: each thread keeps `pipeline` records in flight
    // (`submit`), and a record counts as appended only once `wait_durable` acknowledged it.
    let pipeline = cfg.pipeline;
    let (pipelined, stats) = run_appenders(&wal_dir, config, threads, |log| {
        let mut inflight = std::collections::VecDeque::with_capacity(pipeline + 1);
        for _ in 0..cfg.records_per_thread {
            inflight.push_back(log.submit(RecordKind::AppendKv, &payload, None)?);
            if inflight.len() > pipeline {
                log.wait_durable(inflight.pop_front().unwrap_or_default())?;
            }
        }
        if let Some(&last) = inflight.back() {
            log.wait_durable(last)?;
        }
        Ok(())
    })?;
    p(
        out,
        rate(&format!("pipelined ({pipeline} in flight per thread, acknowledged by wait_durable)"), pipelined, stats),
    );
    p(out, format!("  ratio pipelined group commit / sequential write+fsync: {:.2}", secs(base) / secs(pipelined)));

    // 2. Engine appends (KV batches through data files and the log) vs the same chunk bytes
    // written sequentially: each batch acknowledged before the next, and pipelined.
    let shape = cfg.shape;
    let batch_tokens = cfg.batch_tokens;
    let (appended, wal_stats) = engine_appends(cfg, &cfg.dir.join("engine-append"), None)?;
    let (pipelined, pipelined_stats) = engine_appends(cfg, &cfg.dir.join("engine-pipelined"), Some(pipeline))?;
    let chunk = chunk_bytes(&append_spec(shape), batch_tokens) as usize;
    let engine_bytes = records * chunk;
    let base = sequential_write_then_fsync(&cfg.dir.join("baseline-chunks.bin"), records, chunk)?;
    let mb = engine_bytes as f64 / 1e6;
    p(out, format!(
        "engine append: {threads} threads x {} batches of {batch_tokens} tokens ({} B chunks, {mb:.1} MB), flat f16, sync every batch",
        cfg.records_per_thread, chunk
    ));
    let rate = |what: &str, took: Duration, stats: WriterStats| rate_line(what, "batches", mb, records, took, stats);
    p(out, rate("durable append     ", appended, wal_stats));
    p(
        out,
        rate(
            &format!("submit_append ({pipeline} in flight per thread, acknowledged by wait_durable)"),
            pipelined,
            pipelined_stats,
        ),
    );
    p(out, format!("  baseline: 1 sequential write stream + 1 fsync of the same bytes {:8.1} MB/s", mb / secs(base)));
    p(out, format!("  ratio durable append / sequential write+fsync: {:.2}", secs(base) / secs(appended)));
    p(out, format!("  ratio pipelined durable append / sequential write+fsync: {:.2}", secs(base) / secs(pipelined)));

    if cfg.context_tokens == 0 {
        return Ok(());
    }
    // 3. Recovery per GB and the first attention after reopening a long context.
    let tokens = cfg.context_tokens;
    let synth = SynthContext::generate(SynthParams::new(shape, tokens, 42));
    let query = synth.queries(0);
    let budget = Budget::default();
    // PQ codebooks train in the background after a prefill: every condition below waits for
    // them (`ready`), so each one ends with the first *sparse* attention a PQ plan can serve.
    let ready = |engine: &Engine, ctx: ContextId, layers: usize| -> Result<()> {
        for layer in 0..layers {
            engine.wait_index(ctx, layer, Duration::from_secs(3600))?;
        }
        Ok(())
    };
    let hack2 = Codec::Hack2(HackParams::default());
    let conditions = [
        (Method::Flat, Codec::F16),
        (Method::default(), Codec::F16),
        (Method::Pq(PqParams::default()), Codec::F16),
        (Method::default(), hack2),
        (Method::Pq(PqParams::default()), hack2),
    ];
    // Bytes on disk of each method's f16 context (the same run's baseline of its hack2 one).
    let mut f16_disk = std::collections::BTreeMap::new();
    for (method, codec) in conditions {
        let dir = cfg.dir.join(format!("context-{}-{codec}", method.name()));
        fresh(&dir)?;
        let spec = ContextSpec::new(shape, cfg.layers).with_method(method).with_codec(codec);
        // Recompute: an in-memory engine ingests the prompt's KV and builds the index.
        let recompute = {
            let engine = Engine::in_memory(EngineConfig::default())?;
            let started = Instant::now();
            let ctx = engine.create_context(spec.clone())?;
            for layer in 0..spec.layers.len() {
                engine.prefill(ctx, layer, &synth.keys, &synth.values)?;
            }
            ready(&engine, ctx, spec.layers.len())?;
            let plan = engine.plan(&[Request::new(ctx, 0, query.clone())], &budget)?;
            let first = engine.execute(&plan)?;
            (started.elapsed(), first)
        };
        let (ctx, write_time) = {
            let engine = Engine::open(&dir, EngineConfig::default())?;
            let started = Instant::now();
            let ctx = engine.create_context(spec.clone())?;
            for layer in 0..spec.layers.len() {
                engine.prefill(ctx, layer, &synth.keys, &synth.values)?;
            }
            ready(&engine, ctx, spec.layers.len())?;
            engine.checkpoint()?;
            (ctx, started.elapsed())
        };
        let (data, index) = (allocated(&dir.join(DATA_DIR)), allocated(&dir.join(INDEX_DIR)));
        let f16_kv = (2 * tokens * shape.kv_heads * shape.head_dim * 2 * spec.layers.len()) as u64;
        let started = Instant::now();
        let engine = Engine::open(&dir, EngineConfig::default())?;
        let opened = started.elapsed();
        ready(&engine, ctx, spec.layers.len())?;
        let plan = engine.plan(&[Request::new(ctx, 0, query.clone())], &budget)?;
        let first = engine.execute(&plan)?;
        let reopen_first = started.elapsed();
        let report = engine.recovery_report().cloned().unwrap_or_default();
        // Bytes read back: f16 chunks, and a hack2 layer's 2-bit home.
        let gb = (report.kv_bytes_loaded + report.home_bytes_loaded) as f64 / 1e9;
        let same = first == recompute.1;
        p(
            out,
            format!(
                "context {tokens} tokens x {} layers, {} kv heads, d={}, {codec}, method {}: {:.3} GB of KV read back",
                spec.layers.len(),
                shape.kv_heads,
                shape.head_dim,
                method.name(),
                gb
            ),
        );
        let mb = |b: u64| b as f64 / 1e6;
        p(out, format!(
            "  on disk after the checkpoint: data files {:.1} MB + index files {:.1} MB = {:.1} MB, {:.3} of the f16 KV ({:.1} MB)",
            mb(data),
            mb(index),
            mb(data + index),
            (data + index) as f64 / f16_kv as f64,
            mb(f16_kv)
        ));
        match (codec, f16_disk.get(method.name())) {
            (Codec::F16, _) => {
                f16_disk.insert(method.name(), data + index);
            }
            (Codec::Hack2(_), Some(&base)) => p(out, format!(
                "  ratio on-disk bytes hack2 / f16 {} context (same run): {:.3}; {} layers restored from 2-bit homes ({:.1} MB of segment files and homes)",
                method.name(),
                (data + index) as f64 / base as f64,
                report.homes_restored,
                mb(report.home_bytes_loaded)
            )),
            _ => {}
        }
        p(out, format!("  durable prefill + checkpoint: {:.2} s", secs(write_time)));
        p(out, format!(
            "  reopen: {:.2} s = {:.2} s per GB (reading + verifying {:.2} s, rebuilding the index {:.2} s, {} of {} layers from a checkpointed layout; page cache warm)",
            secs(opened),
            secs(opened) / gb.max(1e-9),
            secs(report.read_time),
            secs(report.rebuild_time),
            report.layouts_restored,
            report.layers_loaded
        ));
        p(out, format!(
            "  first attention after reopen: {:.2} s; recompute (prefill from f32 KV in memory, index ready, first attention): {:.2} s; ratio reopen/recompute {:.2}; outputs equal: {same}",
            secs(reopen_first),
            secs(recompute.0),
            secs(reopen_first) / secs(recompute.0)
        ));
        drop(engine);
        if method != Method::Flat && codec.hack().is_none() {
            // Same-run baseline: reopen without the checkpointed layouts (k-means again).
            // (A hack2 layer's home is the only copy of its tokens: not removable.)
            // The first attention is timed once the index is ready (PQ trains in the background).
            let index_dir = dir.join(INDEX_DIR);
            let saved = dir.join("index-saved");
            std::fs::rename(&index_dir, &saved).map_err(|e| attnstore_wal::Error::io("rename", &index_dir, &e))?;
            let started = Instant::now();
            let engine = Engine::open(&dir, EngineConfig::default())?;
            ready(&engine, ctx, spec.layers.len())?;
            let plan = engine.plan(&[Request::new(ctx, 0, query.clone())], &budget)?;
            let same = engine.execute(&plan)? == recompute.1;
            let without = started.elapsed();
            let rebuild = engine.recovery_report().map_or(Duration::ZERO, |r| r.rebuild_time);
            drop(engine);
            let _ = std::fs::remove_dir_all(&index_dir);
            std::fs::rename(&saved, &index_dir).map_err(|e| attnstore_wal::Error::io("rename", &saved, &e))?;
            p(out, format!(
                "  without the checkpointed layouts (clustering or training again): first attention after reopen {:.2} s (index rebuild {:.2} s); with them {:.2} s: {:.2}x faster; outputs equal: {same}",
                secs(without),
                secs(rebuild),
                secs(reopen_first),
                secs(without) / secs(reopen_first)
            ));
        }
        if method != Method::Flat {
            // Reopen again, serving exactly at once while the index is rebuilt in the background.
            let config = DurableConfig { index_rebuild: IndexRebuild::Background, ..Default::default() };
            let started = Instant::now();
            let engine = Engine::open_with(&dir, EngineConfig::default(), config)?;
            let plan = engine.plan(&[Request::new(ctx, 0, query.clone())], &budget)?;
            engine.execute(&plan)?;
            let first = started.elapsed();
            let exact = matches!(plan.requests[0].strategy, Strategy::Exact { .. });
            engine.wait_index_rebuild(Duration::from_secs(3600))?;
            ready(&engine, ctx, spec.layers.len())?;
            let index_ready = started.elapsed();
            let plan = engine.plan(&[Request::new(ctx, 0, query.clone())], &budget)?;
            let same = engine.execute(&plan)? == recompute.1;
            p(out, format!(
                "  background rebuild: first attention after reopen {:.2} s (exact: {exact}), ratio to recompute {:.2}; index ready after {:.2} s, then outputs equal: {same}",
                secs(first),
                secs(first) / secs(recompute.0),
                secs(index_ready)
            ));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}
