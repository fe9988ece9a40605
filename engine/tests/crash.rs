//! Crash test: a child process (this test binary re-run on the ignored `crash_child` test)
//! opens a durable engine and appends from several threads, printing each batch before it
//! submits it (`S`) and once it is acknowledged (`A`: `append` returned, or for the threads
//! that keep appends in flight, `wait_durable` of its ticket returned); the parent kills it
//! with SIGKILL at a random moment, reopens the directory and checks that every acknowledged
//! batch is there byte-exact, that nothing beyond what was submitted is there, and that
//! attention over the recovered context equals attention over the same batches in memory.
//!
//! `ATTNSTORE_CRASH_ROUNDS` sets the rounds (default 200, run as two streams at once),
//! `ATTNSTORE_CRASH_SEED` the seed.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use attnstore::{
    AttnShape, Budget, Codec, ContextId, ContextSpec, DurableConfig, Engine, EngineConfig, HackParams, IndexRebuild,
    Method, PqParams, Request, WaveParams,
};
use attnstore_kernels::random::SplitMix64;

const CHILD_DIR_ENV: &str = "ATTNSTORE_CRASH_CHILD_DIR";
const CHILD_BACKGROUND_ENV: &str = "ATTNSTORE_CRASH_CHILD_BACKGROUND_REBUILD";
const THREADS: usize = 4;
/// Threads from this one on append pipelined (`Engine::submit_append`).
const PIPELINED_FROM: usize = 2;
/// Appends a pipelined thread keeps in flight.
const IN_FLIGHT: usize = 4;
/// A fresh directory every this many rounds keeps the verification cost flat.
const ROUNDS_PER_DIR: usize = 10;

fn shape() -> AttnShape {
    AttnShape::new(4, 2, 16).unwrap()
}

/// Thread with the `hack2` wave context: its checkpoints move its tokens to 2-bit segment
/// files and punch them out of its data file.
const HACK2_THREAD: usize = 2;
/// Thread with the `hack2` PQ context: once its codebooks are trained, its checkpoints move
/// its base rows to 2-bit segment files (its codebooks to its layout file) and punch them out.
const PQ_HACK2_THREAD: usize = 3;

/// Thread `t`'s context: wave index (small segments) for even threads, flat for thread 1;
/// thread [`HACK2_THREAD`]'s wave index stores its segments in 2-bit form and thread
/// [`PQ_HACK2_THREAD`]'s PQ index its base rows.
fn spec(t: usize) -> ContextSpec {
    let wave = WaveParams { segment_tokens: 128, decode_segment_tokens: 32, local_tokens: 8, ..WaveParams::default() };
    let pq = PqParams { min_build_tokens: 64, local_tokens: 8, ..PqParams::default() };
    let method = match t {
        PQ_HACK2_THREAD => Method::Pq(pq),
        _ if t.is_multiple_of(2) => Method::Wave(wave),
        _ => Method::Flat,
    };
    let spec = ContextSpec::new(shape(), 1).with_method(method);
    match t {
        HACK2_THREAD | PQ_HACK2_THREAD => spec.with_codec(Codec::Hack2(HackParams::new(16).unwrap())),
        _ => spec,
    }
}

/// Batches of thread `t` that `engine` holds, counted back from its tokens through the
/// batch sizes (a `hack2` layer's data file no longer holds the batches its home does).
fn batches_held(engine: &Engine, ctx: ContextId, t: usize) -> usize {
    let tokens = engine.stats(ctx, 0).unwrap().tokens;
    let (mut i, mut sum) = (0, 0);
    while sum < tokens {
        sum += batch(t, i).0.len() / shape().kv_len(1);
        i += 1;
    }
    assert_eq!(sum, tokens, "thread {t}: {tokens} tokens is not a whole number of batches");
    i
}

/// Batch `i` of thread `t`: 1..=8 tokens (a 40-token prefill for i = 0), deterministic.
fn batch(t: usize, i: usize) -> (Vec<f32>, Vec<f32>) {
    let mut rng = SplitMix64::fork(t as u64 * 1_000_003 + 17, i as u64);
    let tokens = if i == 0 { 40 } else { 1 + rng.below(8) };
    let n = shape().kv_len(tokens);
    let keys = (0..n).map(|_| rng.normal()).collect();
    let values = (0..n).map(|_| rng.normal()).collect();
    (keys, values)
}

fn ingest(engine: &Engine, ctx: ContextId, t: usize, i: usize) -> attnstore::Result<()> {
    let (k, v) = batch(t, i);
    if i == 0 {
        engine.prefill(ctx, 0, &k, &v)
    } else {
        engine.append(ctx, 0, &k, &v)
    }
}

fn say(line: &str) {
    // Straight to the process's stdout (not the test harness's capture), one flushed line
    // at a time, so the parent sees every acknowledgement printed before the kill.
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[test]
#[ignore = "helper: the crash test runs it in a child process"]
fn crash_child() {
    let Some(dir) = std::env::var_os(CHILD_DIR_ENV) else { return };
    // Odd rounds rebuild indexes in the background, so kills also land during a rebuild.
    let index_rebuild = match std::env::var_os(CHILD_BACKGROUND_ENV) {
        Some(_) => IndexRebuild::Background,
        None => IndexRebuild::Blocking,
    };
    let config = DurableConfig { index_rebuild, ..DurableConfig::default() };
    let engine = Engine::open_with(Path::new(&dir), EngineConfig::default(), config).unwrap();
    while engine.contexts().len() < THREADS {
        let t = engine.contexts().len();
        engine.create_context(spec(t)).unwrap();
    }
    let contexts = engine.contexts();
    say("ready");
    std::thread::scope(|s| {
        for (t, &ctx) in contexts.iter().enumerate().take(THREADS) {
            let engine = &engine;
            s.spawn(move || {
                let start = batches_held(engine, ctx, t);
                // Threads from PIPELINED_FROM on keep appends in flight (`submit_append`) and
                // print `A` only once `wait_durable` acknowledged them.
                let mut inflight = std::collections::VecDeque::new();
                for i in start.. {
                    say(&format!("S {t} {i}"));
                    if t < PIPELINED_FROM || i == 0 {
                        ingest(engine, ctx, t, i).unwrap();
                        say(&format!("A {t} {i}"));
                    } else {
                        let (k, v) = batch(t, i);
                        inflight.push_back((i, engine.submit_append(ctx, 0, &k, &v).unwrap()));
                        if inflight.len() > IN_FLIGHT {
                            let (acked, ticket) = inflight.pop_front().unwrap();
                            engine.wait_durable(ticket).unwrap();
                            say(&format!("A {t} {acked}"));
                        }
                    }
                    if t == 0 && i % 10 == 9 {
                        engine.checkpoint().unwrap();
                        say("C");
                    }
                }
            });
        }
    });
}

/// What the child printed before it died.
#[derive(Default)]
struct Printed {
    /// Per thread, one past the highest acknowledged batch index.
    acked: [usize; THREADS],
    /// Per thread, one past the highest submitted batch index.
    submitted: [usize; THREADS],
    checkpoints: usize,
    /// Acknowledgements printed.
    acks: usize,
}

fn parse(lines: &[String]) -> Printed {
    let mut p = Printed::default();
    for line in lines {
        let mut words = line.split(' ');
        let tag = words.next();
        let nums: Vec<usize> = words.filter_map(|w| w.parse().ok()).collect();
        match (tag, nums.as_slice()) {
            (Some("A"), &[t, i]) => {
                p.acked[t] = p.acked[t].max(i + 1);
                p.acks += 1;
            }
            (Some("S"), &[t, i]) => p.submitted[t] = p.submitted[t].max(i + 1),
            (Some("C"), _) => p.checkpoints += 1,
            _ => {}
        }
    }
    p
}

fn attention(engine: &Engine, ctx: ContextId, step: u64) -> Vec<Vec<f32>> {
    let mut rng = SplitMix64::new(step);
    let q: Vec<f32> = (0..shape().query_len()).map(|_| rng.normal()).collect();
    [Budget::full(), Budget::default().with_retrieve_floor(8).with_retrieve(0.2)]
        .iter()
        .map(|budget| {
            let plan = engine.plan(&[Request::new(ctx, 0, q.clone())], budget).unwrap();
            engine.execute(&plan).unwrap().remove(0)
        })
        .collect()
}

/// Reopens `dir` and checks it against what the child printed; returns batches recovered,
/// how many of them came from a 2-bit home rather than the data file, and how many of those
/// from the PQ context's.
fn verify(dir: &Path, printed: &Printed, round: usize) -> (usize, usize, usize) {
    let engine = Engine::open(dir, EngineConfig::default()).unwrap_or_else(|e| panic!("round {round}: reopen: {e}"));
    let contexts = engine.contexts();
    let (mut total, mut from_homes, mut from_pq_homes) = (0, 0, 0);
    for (t, &ctx) in contexts.iter().enumerate().take(THREADS) {
        let stored = engine.stored_batches(ctx, 0).unwrap();
        let n = batches_held(&engine, ctx, t);
        // Only a hack2 layer's data file may have handed batches to its 2-bit home.
        let homed = n - stored.len();
        assert!(
            homed == 0 || t == HACK2_THREAD || t == PQ_HACK2_THREAD,
            "round {round} thread {t}: {homed} batches missing from its data file"
        );
        assert!(
            n >= printed.acked[t],
            "round {round} thread {t}: {n} batches recovered, {} acknowledged",
            printed.acked[t]
        );
        assert!(
            n <= printed.submitted[t].max(printed.acked[t]) || printed.submitted[t] == 0,
            "round {round} thread {t}: {n} batches recovered, only {} submitted",
            printed.submitted[t]
        );
        let reference = Engine::in_memory(EngineConfig::default()).unwrap();
        let rctx = reference.create_context(spec(t)).unwrap();
        for (j, b) in stored.iter().enumerate() {
            let i = homed + j;
            let (k, v) = batch(t, i);
            let round_f16 = |x: &[f32]| x.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect::<Vec<_>>();
            assert!(
                b.keys == round_f16(&k) && b.values == round_f16(&v) && b.prefill == (i == 0),
                "round {round} thread {t}: batch {i} differs from what was appended"
            );
        }
        for i in 0..n {
            ingest(&reference, rctx, t, i).unwrap();
        }
        if n > 0 {
            // A PQ index plans exactly until its codebooks are trained (in the background):
            // compare trained with trained.
            for (e, c) in [(&engine, ctx), (&reference, rctx)] {
                assert!(e.wait_index(c, 0, Duration::from_secs(60)).unwrap(), "round {round} thread {t}: no index");
            }
            assert_eq!(
                attention(&engine, ctx, round as u64),
                attention(&reference, rctx, round as u64),
                "round {round} thread {t}: attention after recovery differs"
            );
        }
        total += n;
        from_homes += homed;
        if t == PQ_HACK2_THREAD {
            from_pq_homes += homed;
        }
    }
    (total, from_homes, from_pq_homes)
}

/// Rounds run as this many independent streams at once (each with its own directories and
/// random stream): a round mostly waits for its child, so two streams halve the test's time.
const STREAMS: usize = 2;

/// What a stream of rounds saw.
#[derive(Default)]
struct Tally {
    acked: usize,
    recovered: usize,
    /// Batches recovered from a 2-bit home, summed over rounds.
    from_homes: usize,
    /// Of those, batches recovered from the PQ context's 2-bit home.
    from_pq_homes: usize,
    checkpoints: usize,
    killed_before_ready: usize,
}

/// Runs the rounds `stream, stream + STREAMS, ..` below `rounds`: each starts the child on a
/// directory (a fresh one every `ROUNDS_PER_DIR` rounds of the stream), kills it at a random
/// moment and verifies what recovery finds.
fn run_stream(stream: usize, rounds: usize, seed: u64) -> Tally {
    let mut rng = SplitMix64::new(seed.wrapping_add(stream as u64));
    let exe = std::env::current_exe().unwrap();
    let mut tally = Tally::default();
    let mut dir = tempfile::tempdir().unwrap();
    for (local, round) in (stream..rounds).step_by(STREAMS).enumerate() {
        if local > 0 && local % ROUNDS_PER_DIR == 0 {
            dir = tempfile::tempdir().unwrap();
        }
        let mut command = Command::new(&exe);
        if local % 2 == 1 {
            command.env(CHILD_BACKGROUND_ENV, "1");
        }
        let mut child = command
            .args(["--exact", "crash_child", "--ignored", "--nocapture", "--test-threads=1"])
            .env(CHILD_DIR_ENV, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let reader =
            std::thread::spawn(move || BufReader::new(stdout).lines().map_while(Result::ok).collect::<Vec<_>>());
        // Kill anywhere from during the child's own recovery to well into its appends.
        std::thread::sleep(Duration::from_micros(2_000 + rng.below(150_000) as u64));
        let exited_early = child.try_wait().unwrap();
        child.kill().unwrap(); // SIGKILL on Unix
        let status = child.wait().unwrap();
        let lines = reader.join().unwrap();
        if let Some(status) = exited_early {
            let mut err = String::new();
            let _ = std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err);
            panic!("round {round}: the child exited by itself ({status}):\n{err}");
        }
        assert!(!status.success());
        // libtest prints `test crash_child ... ` without a newline before the body runs.
        if !lines.iter().any(|l| l.ends_with("ready")) {
            tally.killed_before_ready += 1;
        }
        let printed = parse(&lines);
        tally.acked += printed.acks;
        tally.checkpoints += printed.checkpoints;
        let (recovered, from_homes, from_pq_homes) = verify(dir.path(), &printed, round);
        tally.recovered = recovered;
        tally.from_homes += from_homes;
        tally.from_pq_homes += from_pq_homes;
    }
    tally
}

#[test]
fn sigkill_at_random_moments_never_loses_an_acknowledged_append_nor_shows_an_unsubmitted_one() {
    let rounds: usize = std::env::var("ATTNSTORE_CRASH_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    let seed: u64 = std::env::var("ATTNSTORE_CRASH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    let started = Instant::now();
    let tallies: Vec<Tally> = std::thread::scope(|scope| {
        let streams: Vec<_> = (0..STREAMS).map(|s| scope.spawn(move || run_stream(s, rounds, seed))).collect();
        streams.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    });
    let sum = |f: fn(&Tally) -> usize| tallies.iter().map(f).sum::<usize>();
    let acked_total = sum(|t| t.acked);
    eprintln!(
        "crash test: {rounds} rounds in {STREAMS} streams in {:.1} s, {} killed during startup/recovery, \
         {} checkpoints, {acked_total} appends acknowledged, last directories hold {} batches, \
         {} batches recovered from 2-bit homes over all rounds ({} of them the PQ context's)",
        started.elapsed().as_secs_f64(),
        sum(|t| t.killed_before_ready),
        sum(|t| t.checkpoints),
        sum(|t| t.recovered),
        sum(|t| t.from_homes),
        sum(|t| t.from_pq_homes),
    );
    assert!(acked_total > rounds, "the children acknowledged too little for the test to mean anything");
    assert!(rounds < 40 || sum(|t| t.from_homes) > 0, "no round recovered a hack2 layer from its 2-bit home");
    assert!(rounds < 40 || sum(|t| t.from_pq_homes) > 0, "no round recovered the hack2 PQ layer from its 2-bit home");
}
