//! The `attnstore` command: `bench` measures sparse against exact attention on synthetic
//! contexts (or, with `--trace`, on a captured real trace); `explain` prints the plan of one
//! decode step; `check` and `recover` inspect and repair a durable engine directory;
//! `bench-wal` measures the durability paths; `generate`, `capture`, `eval` and `argmax` run
//! a real model (SmolLM2-135M) whose decode attention attnstore serves.

mod model;
mod remote;

use attnstore::{
    AttnShape, Budget, BufferSettings, Codec, ContextId, ContextSpec, DType, Engine, EngineConfig, EstimateShare,
    Method, ReplacerKind, Request, SelectionMode,
};
use attnstore_bench::{memory, BenchConfig, BenchMethod, InspectConfig, SynthContext, SynthParams, WalBenchConfig};
use clap::{Args, Parser, Subcommand};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "attnstore",
    version,
    about = "A storage engine for the attention KV cache of long-context LLM inference"
)]
struct Cli {
    /// What to log to stderr, as a tracing filter: a level (`info`, `debug`, `trace`) or
    /// per-target directives (`attnstore=debug,attnstore_wal=trace`). Defaults to the
    /// `RUST_LOG` variable, else `warn`. Spans cover plan, execute, ingest, open (recovery),
    /// checkpoints, maintainer rounds, block reads and WAL group flushes.
    #[arg(long, global = true, value_name = "FILTER")]
    log: Option<String>,
    /// Record the run's metrics (plan and execute latency, requests, WAL and buffer I/O)
    /// with a Prometheus recorder and write them to FILE in the Prometheus text format when
    /// the command ends.
    #[arg(long, global = true, value_name = "FILE")]
    metrics: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

/// Logs to stderr under `filter` (else `RUST_LOG`, else `warn`), with span timings at close.
fn init_logging(filter: Option<&str>) -> Result<(), String> {
    use tracing_subscriber::{fmt::format::FmtSpan, EnvFilter};
    let filter = match filter {
        Some(f) => EnvFilter::try_new(f).map_err(|e| format!("--log {f:?}: {e}"))?,
        None => EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_span_events(FmtSpan::CLOSE)
        .try_init()
        .map_err(|e| format!("logging: {e}"))
}

#[derive(Subcommand)]
enum Command {
    /// Benchmark sparse against exact attention on one layer of synthetic KV per --tokens
    /// length, or their accuracy on a captured real trace (--trace).
    ///
    /// On synthetic KV one run measures a memory-read ceiling and exact attention, the index
    /// builds of the methods measured, their sparse plans (--method: wave for every --estimate
    /// and --selection, PQ for every --selection), PQ scoring against exact q·k scores, an
    /// oracle top-k attending as many tokens exactly, and with --codec hack2 exact attention
    /// over the 2-bit rows. Decode times come with exact attention timed in the same loop,
    /// the output error and the recall of the true top-k. A length whose run cannot fit in
    /// the available memory is refused before anything is allocated.
    Bench(BenchArgs),
    /// Print the plan (EXPLAIN) of one decode step over a synthetic context.
    Explain(ExplainArgs),
    /// Serve a synthetic wave context from the buffer manager and from the index in the same
    /// run (decode steps on both), then print the buffer manager's tiers: capacity, used,
    /// hit ratio, bytes and latency moved, evictions, dropped access records, failures.
    Inspect(InspectArgs),
    /// Verify every checksum of a durable engine directory and print what is there
    /// (read-only); exits 1 on any damage, naming the file.
    Check {
        /// The engine directory (never made one if it is not).
        dir: PathBuf,
    },
    /// Open a durable engine directory, run recovery (zeroes the torn tail a crash left) and
    /// report what replay did; refuses damage that may hide acknowledged appends.
    Recover {
        /// The engine directory (never made one if it is not).
        dir: PathBuf,
        /// Accept losing acknowledged appends: cut the log at the first damage (and the data
        /// its dropped records committed) instead of refusing, and print exactly what was cut.
        #[arg(long)]
        point_in_time: bool,
    },
    /// Benchmark group commit, recovery time per GB and the first attention after reopening.
    BenchWal(BenchWalArgs),
    /// Generate text with a GGUF model (SmolLM2, Gemma-3, Qwen2), decode attention served by
    /// attnstore (greedy).
    Generate(model::GenerateArgs),
    /// Write a real KV trace: every layer's post-RoPE keys, values and decode queries.
    Capture(model::CaptureArgs),
    /// Accuracy of every method and budget against exact attention on real long texts.
    Eval(model::EvalArgs),
    /// Teacher-forced argmax of the exact method, for scripts/llamacpp-check.
    Argmax(model::ArgmaxArgs),
    /// Write a small model with random weights and an architecture's real GGUF layout.
    SynthModel(model::SynthArgs),
    /// Benchmark the remote tier on Redis: publish and attach of a synthetic context against
    /// the store's own pipelined SET/GET of the same values (and redis-benchmark), and
    /// attach + first attention against prefill + index build.
    BenchRemote(remote::BenchRemoteArgs),
}

#[derive(Args)]
struct BenchWalArgs {
    /// Scratch directory (created, and deleted at the end).
    #[arg(long, default_value = "target/bench-wal")]
    dir: PathBuf,
    /// Appending threads (at least 1).
    #[arg(long, default_value_t = 8, value_parser = parse_count)]
    threads: usize,
    /// Records (and engine batches) per thread (at least 1).
    #[arg(long, default_value_t = 500, value_parser = parse_count)]
    records: usize,
    /// Payload bytes per WAL record.
    #[arg(long, default_value_t = 4096)]
    record_bytes: usize,
    /// WAL records each thread keeps in flight in the pipelined group-commit condition
    /// (submitted, then acknowledged by waiting for durability; at least 1).
    #[arg(long, default_value_t = 64, value_parser = parse_count)]
    pipeline: usize,
    /// Tokens per engine append batch (at least 1).
    #[arg(long, default_value_t = 16, value_parser = parse_count)]
    batch_tokens: usize,
    /// Tokens of the long context (K and M suffixes allowed); 0 skips the recovery figures.
    /// A context that cannot fit in the available memory is refused up front.
    #[arg(long, default_value = "128K", value_parser = parse_tokens_or_zero)]
    tokens: usize,
    /// Layers of the long context (at least 1).
    #[arg(long, default_value_t = 1, value_parser = parse_count)]
    layers: usize,
    #[command(flatten)]
    shape: ShapeArgs,
}

#[derive(Args, Clone)]
struct ShapeArgs {
    /// Query heads.
    #[arg(long, default_value_t = 32)]
    q_heads: usize,
    /// KV heads (q_heads must be a multiple).
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    /// Head dimension.
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// Storage type: f32, f16 or bf16.
    #[arg(long, default_value = "f16")]
    dtype: DType,
    /// Codec of the stored rows: f32, f16, bf16 (plain; overrides --dtype), or hack2 /
    /// hack2:Π (2-bit homomorphic, HACK), hack2c / hack2c:Π (the same with keys
    /// normalized per channel) or kv43 / kv43:G (4-bit per-channel keys over G-token groups,
    /// 3-bit values; wave or pq) for indexed rows, with an f16 steady zone.
    #[arg(long)]
    codec: Option<Codec>,
    /// Seed of the synthetic data.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

#[derive(Args, Clone)]
struct BudgetArgs {
    /// Fraction of tokens attended exactly in the retrieval zone.
    #[arg(long, default_value_t = 0.018)]
    retrieve: f64,
    /// Minimum tokens in the retrieval zone.
    #[arg(long, default_value_t = 512)]
    retrieve_floor: usize,
    /// A plan is made exact when a sparse plan would read at least this share of the bytes
    /// exact attention reads (short contexts, or 2-bit rows that make exact cheap).
    #[arg(long, default_value_t = 0.5)]
    exact_threshold: f64,
}

impl BudgetArgs {
    /// The default budget with these settings (estimation share and selection mode left to
    /// the caller).
    fn budget(&self) -> Budget {
        Budget::default()
            .with_retrieve(self.retrieve)
            .with_retrieve_floor(self.retrieve_floor)
            .with_exact_threshold(self.exact_threshold)
    }
}

#[derive(Args)]
struct BenchArgs {
    /// Context lengths, comma separated (K and M suffixes allowed). A length that cannot fit
    /// in the available memory is refused before anything is allocated.
    #[arg(long, default_value = "32K,128K", value_delimiter = ',', value_parser = parse_tokens)]
    tokens: Vec<usize>,
    #[command(flatten)]
    shape: ShapeArgs,
    #[command(flatten)]
    budget: BudgetArgs,
    /// Estimation shares to compare: fractions of tokens, or `rest` (every cluster not retrieved).
    #[arg(long, default_value = "0.232,rest", value_delimiter = ',', value_parser = parse_share)]
    estimate: Vec<EstimateShare>,
    /// Selection modes to compare: per-kv-head, per-query-head.
    #[arg(long, default_value = "per-kv-head,per-query-head", value_delimiter = ',', value_parser = parse_mode)]
    selection: Vec<SelectionMode>,
    /// Decode steps (distinct queries) per configuration (at least 1).
    #[arg(long, default_value_t = 4, value_parser = parse_count)]
    queries: usize,
    /// Timed repetitions per query (at least 1; the median is reported).
    #[arg(long, default_value_t = 5, value_parser = parse_count)]
    reps: usize,
    /// Access methods to measure: wave, pq, or all (comma separated). The exact baseline and
    /// the oracle top-k always run.
    #[arg(long, default_value = "all", value_delimiter = ',', value_parser = parse_bench_method)]
    method: Vec<Vec<BenchMethod>>,
    /// Time budget (ms) the PQ codebook build must fit in: picks the k-means iteration limit
    /// from a time model measured on this machine. Default: no budget (25 iterations at most).
    #[arg(long)]
    pq_build_budget_ms: Option<u64>,
    /// Print JSON lines only (one object per configuration) on stdout.
    #[arg(long)]
    json: bool,
    /// Evaluate every method on a real trace written by `attnstore capture` instead of
    /// synthetic KV (relative error, recall of the true top-k, bytes read).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// With --trace: layers attended exactly whatever the budget.
    #[arg(long, default_value_t = 0)]
    dense_layers: usize,
    /// Budget scales, comma separated (each positive): every sparse method and the oracle
    /// run once per scale with the retrieval fraction and floor multiplied by it. Default 1,
    /// or 0.25,0.5,1,2 with --plot (the frontier's points).
    #[arg(long, value_delimiter = ',', value_parser = model::parse_scale)]
    scales: Option<Vec<f64>>,
    /// Write charts into this directory (SVG and PNG): per length the accuracy/cost frontier
    /// (error against exactly attended tokens, with the oracle's curve), latency against
    /// context length, and the buffer tiers' hit ratios over a short buffered run.
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(Args)]
struct ExplainArgs {
    /// Context length (K and M suffixes allowed).
    #[arg(long, default_value = "32K", value_parser = parse_tokens)]
    tokens: usize,
    #[command(flatten)]
    shape: ShapeArgs,
    #[command(flatten)]
    budget: BudgetArgs,
    /// Estimation share: a fraction of tokens, or `rest`.
    #[arg(long, default_value = "0.232", value_parser = parse_share)]
    estimate: EstimateShare,
    /// Selection mode: per-kv-head (default) or per-query-head.
    #[arg(long, default_value = "per-kv-head", value_parser = parse_mode)]
    selection: SelectionMode,
    /// Exact attention (full budget).
    #[arg(long)]
    full: bool,
    /// Access method: wave, pq or flat.
    #[arg(long, default_value = "wave", value_parser = parse_method)]
    method: Method,
    /// One line per KV head as well.
    #[arg(long)]
    verbose: bool,
    /// EXPLAIN ANALYZE: execute the plan and print, per zone, planned against actual rows,
    /// where the bytes came from (index memory, blocks per tier) and time.
    #[arg(long)]
    analyze: bool,
    /// With --analyze: print the analysis as one JSON object (per request the planned rows
    /// and the actual counts per zone) instead of text.
    #[arg(long, requires = "analyze")]
    json: bool,
    /// With --analyze: plan for the GPU (`plan_gpu`: the device selects a wave layer's
    /// clusters) over rows homed in a buffer manager, and execute on the GPU
    /// (`execute_gpu_analyze`), after a few warm-up steps. Needs a build with `--features cuda`.
    #[arg(long, requires = "analyze")]
    gpu: bool,
}

#[derive(Args)]
struct InspectArgs {
    /// Context length (K and M suffixes allowed).
    #[arg(long, default_value = "32K", value_parser = parse_tokens)]
    tokens: usize,
    #[command(flatten)]
    shape: ShapeArgs,
    #[command(flatten)]
    budget: BudgetArgs,
    /// Sparse decode steps (distinct queries; at least 1).
    #[arg(long, default_value_t = 200, value_parser = parse_count)]
    steps: usize,
    /// Of those, steps that also run an exact plan on both engines.
    #[arg(long, default_value_t = 3)]
    exact_steps: usize,
    /// Blocks of the Host arena; 0 sizes it to hold the whole context. Smaller needs
    /// --spill-dir (the rest spills to disk) or the prefill fails with a typed error.
    #[arg(long, default_value_t = 0)]
    host_blocks: usize,
    /// Gpu-tier cache as a share of the Host arena (host memory stands in for it on the CPU).
    #[arg(long, default_value_t = 0.05)]
    gpu_share: f64,
    /// Replacement policy of the Gpu tier: lru, lfu, clock or sieve.
    #[arg(long, default_value = "clock", value_parser = parse_replacer)]
    replacer: ReplacerKind,
    /// Folder for spilled blocks (created; files deleted at the end).
    #[arg(long)]
    spill_dir: Option<PathBuf>,
    /// Do not run the asynchronous maintainer (nothing is admitted into the Gpu tier).
    #[arg(long)]
    no_maintainer: bool,
    /// Block size in bytes: a positive multiple of 64 (the cache line); with --spill-dir a
    /// multiple of 512, since the Disk tier reads and writes blocks with O_DIRECT.
    #[arg(long, default_value_t = 2048)]
    block_bytes: usize,
    /// Print only the metrics the run recorded (plan and execute latency, requests, the
    /// buffered engine's tiers), in the Prometheus text format.
    #[arg(long)]
    prometheus: bool,
    /// Write a chart of the tiers' hit ratios over the decode steps into this directory
    /// (hit_ratios.svg and .png).
    #[arg(long)]
    plot: Option<PathBuf>,
}

fn parse_replacer(s: &str) -> Result<ReplacerKind, String> {
    ReplacerKind::ALL
        .into_iter()
        .find(|k| k.name() == s.trim().to_ascii_lowercase())
        .ok_or_else(|| format!("unknown replacer {s:?}: expected lru, lfu, clock or sieve"))
}

pub(crate) fn parse_tokens(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mul) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1024),
        Some('m' | 'M') => (&t[..t.len() - 1], 1024 * 1024),
        _ => (t, 1),
    };
    let n: usize = num.parse().map_err(|_| format!("{s:?} is not a token count (e.g. 4096, 32K, 1M)"))?;
    match n.checked_mul(mul) {
        Some(v) if v > 0 => Ok(v),
        _ => Err(format!("token count {s:?} must be positive and fit in memory")),
    }
}

/// A count that must be at least 1 (threads, records, steps, repetitions).
pub(crate) fn parse_count(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1, got 0".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s:?} is not a count: expected a whole number of at least 1")),
    }
}

/// Refuses a synthetic context of `tokens` tokens whose run needs more bytes (`needed`, a
/// function of the token count) than the memory available, before anything is allocated.
fn check_memory(what: &str, tokens: usize, needed: impl Fn(usize) -> Option<u64>) -> Result<(), String> {
    memory::check_fits(what, tokens, memory::available_bytes(), needed).map_err(|e| e.to_string())
}

fn parse_tokens_or_zero(s: &str) -> Result<usize, String> {
    if s.trim() == "0" {
        return Ok(0);
    }
    parse_tokens(s)
}

pub(crate) fn parse_share(s: &str) -> Result<EstimateShare, String> {
    if s.trim().eq_ignore_ascii_case("rest") {
        return Ok(EstimateShare::Rest);
    }
    s.trim()
        .parse::<f64>()
        .map(EstimateShare::Fraction)
        .map_err(|_| format!("{s:?} is not an estimate share: a fraction such as 0.232, or `rest`"))
}

fn parse_mode(s: &str) -> Result<SelectionMode, String> {
    match s.trim() {
        "per-query-head" | "q" => Ok(SelectionMode::PerQueryHead),
        "per-kv-head" | "kv" => Ok(SelectionMode::PerKvHead),
        other => Err(format!("unknown selection mode {other:?}: expected per-query-head or per-kv-head")),
    }
}

fn parse_bench_method(s: &str) -> Result<Vec<BenchMethod>, String> {
    match s.trim() {
        "wave" => Ok(vec![BenchMethod::Wave]),
        "pq" => Ok(vec![BenchMethod::Pq]),
        "all" => Ok(vec![BenchMethod::Wave, BenchMethod::Pq]),
        other => Err(format!("unknown method {other:?}: expected wave, pq or all")),
    }
}

fn parse_method(s: &str) -> Result<Method, String> {
    s.parse().map_err(|e: attnstore::Error| e.to_string())
}

/// The codec of `--codec`, or the plain codec of `--dtype`.
fn codec_of(a: &ShapeArgs) -> Codec {
    a.codec.unwrap_or(Codec::from(a.dtype))
}

fn shape_of(a: &ShapeArgs) -> Result<AttnShape, String> {
    AttnShape::new(a.q_heads, a.kv_heads, a.head_dim).map_err(|e| e.to_string())
}

fn bench(args: BenchArgs) -> Result<(), String> {
    if let Some(dir) = &args.trace {
        let mut bases = Vec::new();
        for &estimate in &args.estimate {
            for &mode in &args.selection {
                bases.push(args.budget.budget().with_estimate(estimate).with_mode(mode));
            }
        }
        return model::bench_trace(dir, &bases, args.dense_layers, codec_of(&args.shape), args.json);
    }
    let shape = shape_of(&args.shape)?;
    for &share in &args.estimate {
        Budget::default()
            .with_retrieve(args.budget.retrieve)
            .with_estimate(share)
            .validate()
            .map_err(|e| e.to_string())?;
    }
    let cfg = BenchConfig {
        tokens: args.tokens,
        shape,
        dtype: codec_of(&args.shape).plain_dtype(),
        codec: codec_of(&args.shape),
        queries: args.queries,
        reps: args.reps,
        retrieve: args.budget.retrieve,
        retrieve_floor: args.budget.retrieve_floor,
        scales: args.scales.clone().unwrap_or_else(|| {
            if args.plot.is_some() {
                vec![0.25, 0.5, 1.0, 2.0]
            } else {
                vec![1.0]
            }
        }),
        estimates: args.estimate,
        modes: args.selection,
        seed: args.shape.seed,
        progress: std::io::stderr().is_terminal(),
        methods: {
            let mut m: Vec<BenchMethod> = args.method.into_iter().flatten().collect();
            m.dedup();
            m
        },
        pq_build_budget: args.pq_build_budget_ms.map(Duration::from_millis),
    };
    if let Some(&most) = cfg.tokens.iter().max() {
        check_memory("bench --tokens", most, |t| cfg.bytes_needed(t))?;
    }
    let json = args.json;
    if !json {
        println!(
            "attnstore bench on the CPU ({} threads): {} q heads / {} kv heads, d={}, {}, one layer, {} queries x {} reps",
            rayon::current_num_threads(),
            shape.q_heads,
            shape.kv_heads,
            shape.head_dim,
            cfg.codec,
            cfg.queries,
            cfg.reps
        );
    }
    let mut stdout = std::io::stdout();
    let rows = attnstore_bench::decode::run(&cfg, &mut |row| {
        if json {
            let _ = writeln!(stdout, "{}", row.json());
        } else {
            eprintln!("measured: {}", row.json());
        }
    })
    .map_err(|e| e.to_string())?;
    if !json {
        println!("{}", attnstore_bench::table(&rows));
        println!("JSON lines:");
        for r in &rows {
            println!("{}", r.json());
        }
    }
    if let Some(dir) = &args.plot {
        write_charts(dir, attnstore_bench::plot::bench_charts(&rows))?;
        // The tiers' hit ratios come from a short buffered run at the shortest length.
        let tokens = cfg.tokens.iter().copied().min().unwrap_or(32 * 1024);
        let codec = cfg.codec;
        let layout = attnstore::BlockLayout::new(2048).map_err(|e| e.to_string())?;
        let host_blocks = attnstore_bench::blocks_for_codec(&shape, codec, tokens, layout.block_bytes());
        let buffers = BufferSettings {
            gpu_blocks: host_blocks / 20,
            maintainer_idle: Some(Duration::from_micros(100)),
            ..BufferSettings::new(host_blocks)
        };
        let inspect = InspectConfig {
            tokens,
            shape,
            codec,
            steps: 100,
            exact_steps: 0,
            budget: args.budget.budget(),
            buffers,
            block: layout,
            seed: cfg.seed,
            progress: cfg.progress,
        };
        check_memory("bench --plot's buffered run", tokens, |t| inspect.bytes_needed(t))?;
        let report = attnstore_bench::inspect::run(&inspect).map_err(|e| format!("buffered run failed: {e}"))?;
        write_charts(dir, vec![hit_ratios(&report, &inspect)])?;
    }
    Ok(())
}

/// The hit-ratio chart of an inspection.
fn hit_ratios(report: &attnstore_bench::InspectReport, cfg: &InspectConfig) -> (String, attnstore_bench::plot::Chart) {
    let title = format!(
        "Tier hit ratios: {} decode steps, {} tokens, Gpu tier {} blocks",
        cfg.steps, cfg.tokens, cfg.buffers.gpu_blocks
    );
    ("hit_ratios".into(), attnstore_bench::plot::hit_ratio_chart(&report.tier_steps, &title))
}

/// Writes each chart as SVG and PNG into `dir` and names the files on stderr.
pub(crate) fn write_charts(
    dir: &std::path::Path,
    charts: Vec<(String, attnstore_bench::plot::Chart)>,
) -> Result<(), String> {
    for (stem, chart) in charts {
        for path in attnstore_bench::plot::write(dir, &stem, &chart).map_err(|e| e.to_string())? {
            eprintln!("wrote {}", path.display());
        }
    }
    Ok(())
}

fn explain(args: ExplainArgs) -> Result<(), String> {
    let shape = shape_of(&args.shape)?;
    let budget = if args.full {
        Budget::full()
    } else {
        args.budget.budget().with_estimate(args.estimate).with_mode(args.selection)
    };
    budget.validate().map_err(|e| e.to_string())?;
    let codec = codec_of(&args.shape);
    check_memory("explain --tokens", args.tokens, |t| {
        memory::run_bytes(&shape, t, memory::context_bytes(&shape, codec, &args.method, t))
    })?;
    let mut config = EngineConfig::default();
    if args.gpu {
        // Rows homed in a buffer manager (the GPU reads them there), a Gpu tier of 5%.
        let host = attnstore_bench::blocks_for_codec(&shape, codec, args.tokens, config.block.block_bytes());
        config.buffers =
            Some(BufferSettings { gpu_blocks: host / 20, maintainer_idle: None, ..BufferSettings::new(host) });
    }
    let engine = Engine::in_memory(config).map_err(|e| e.to_string())?;
    let spec = ContextSpec::new(shape, 1).with_dtype(args.shape.dtype).with_codec(codec).with_method(args.method);
    let ctx = engine.create_context(spec).map_err(|e| e.to_string())?;
    let synth = SynthContext::generate(SynthParams::new(shape, args.tokens, args.shape.seed));
    engine.prefill(ctx, 0, &synth.keys, &synth.values).map_err(|e| e.to_string())?;
    // EXPLAIN the plan a decode step gets once the index is ready (a PQ build runs in the
    // background; a plan made before it finishes would say so and attend exactly).
    engine.wait_index(ctx, 0, Duration::from_secs(600)).map_err(|e| e.to_string())?;
    if args.gpu {
        return explain_gpu(&engine, ctx, &synth, &budget, args.json);
    }
    let plan = engine.plan(&[Request::new(ctx, 0, synth.queries(0))], &budget).map_err(|e| e.to_string())?;
    if args.analyze && args.json {
        let (_, analysis) = engine.execute_analyze(&plan).map_err(|e| e.to_string())?;
        let planned: Vec<_> = plan.requests.iter().map(attnstore::PlannedRows::of).collect();
        let json = serde_json::json!({ "planned": planned, "analysis": analysis });
        println!("{json}");
        return Ok(());
    }
    print!("{}", if args.verbose { plan.explain_verbose() } else { plan.explain() });
    if args.analyze {
        let (_, analysis) = engine.execute_analyze(&plan).map_err(|e| e.to_string())?;
        print!("\n{}", analysis.explain(&plan));
    }
    Ok(())
}

/// `explain --analyze --gpu`: four warm-up steps (the maintainer admitting what each read),
/// then EXPLAIN ANALYZE of a GPU step.
#[cfg(feature = "cuda")]
fn explain_gpu(
    engine: &Engine,
    ctx: ContextId,
    synth: &SynthContext,
    budget: &Budget,
    json: bool,
) -> Result<(), String> {
    let err = |e: attnstore::Error| e.to_string();
    let manager = engine.buffer_manager().ok_or("no buffer manager")?.clone();
    for step in 1..=4 {
        let plan = engine.plan_gpu(&[Request::new(ctx, 0, synth.queries(step))], budget).map_err(err)?;
        engine.execute_gpu(&plan).map_err(err)?;
        manager.maintain(usize::MAX);
    }
    let plan = engine.plan_gpu(&[Request::new(ctx, 0, synth.queries(0))], budget).map_err(err)?;
    let (_, run, analysis) = engine.execute_gpu_analyze(&plan).map_err(err)?;
    if json {
        let planned: Vec<_> = plan.requests.iter().map(attnstore::PlannedRows::of).collect();
        println!("{}", serde_json::json!({ "planned": planned, "analysis": analysis, "gpu_run": format!("{run:?}") }));
        return Ok(());
    }
    print!("{}\n{}", plan.explain(), analysis.explain(&plan));
    println!("GPU run: {run:?}");
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn explain_gpu(_: &Engine, _: ContextId, _: &SynthContext, _: &Budget, _: bool) -> Result<(), String> {
    Err("--gpu needs a build with the GPU executor: cargo build --release -p attnstore-cli --features cuda".into())
}

/// Installs a Prometheus recorder (no HTTP listener) as the global metrics recorder.
fn install_prometheus() -> Result<metrics_exporter_prometheus::PrometheusHandle, String> {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|e| format!("installing the metrics recorder: {e}"))?;
    Ok(handle)
}

fn inspect(args: InspectArgs) -> Result<(), String> {
    let shape = shape_of(&args.shape)?;
    if !(0.0..=1.0).contains(&args.gpu_share) {
        return Err(format!("--gpu-share {} must be in 0..=1", args.gpu_share));
    }
    let budget = args.budget.budget();
    budget.validate().map_err(|e| e.to_string())?;
    let layout = attnstore::BlockLayout::new(args.block_bytes).map_err(|e| e.to_string())?;
    let block = layout.block_bytes();
    let host_blocks = match args.host_blocks {
        0 => attnstore_bench::blocks_for_codec(&shape, codec_of(&args.shape), args.tokens, block),
        n => n,
    };
    let buffers = BufferSettings {
        host_blocks,
        gpu_blocks: (host_blocks as f64 * args.gpu_share) as usize,
        replacer: args.replacer,
        spill_dir: args.spill_dir.clone(),
        maintainer_idle: (!args.no_maintainer).then(|| Duration::from_micros(100)),
        ..BufferSettings::new(host_blocks)
    };
    let cfg = InspectConfig {
        tokens: args.tokens,
        shape,
        codec: codec_of(&args.shape),
        steps: args.steps,
        exact_steps: args.exact_steps.min(args.steps),
        budget,
        buffers,
        block: layout,
        seed: args.shape.seed,
        progress: true,
    };
    check_memory("inspect --tokens", cfg.tokens, |t| cfg.bytes_needed(t))?;
    if args.prometheus {
        let handle = install_prometheus()?;
        attnstore_bench::inspect::run(&cfg).map_err(|e| format!("inspect failed: {e}"))?;
        print!("{}", handle.render());
        return Ok(());
    }
    let report = attnstore_bench::inspect::run(&cfg).map_err(|e| format!("inspect failed: {e}"))?;
    if !report.stats.gpu_on_device && !args.no_maintainer && cfg.buffers.gpu_blocks > 0 {
        eprintln!(
            "note: no GPU here, so the Gpu tier is host memory and the maintainer's admissions only cost CPU; \
             --no-maintainer measures the buffer manager without them"
        );
    }
    println!("{:<14} {:<24} {:>6} {:>12} {:>12} {:>10}", "what", "rows", "steps", "p50_us", "p99_us", "p50 ratio");
    for r in &report.rows {
        let field = |k: &str| r.get(k).map_or_else(String::new, |v| v.to_string().trim_matches('"').to_string());
        println!(
            "{:<14} {:<24} {:>6} {:>12} {:>12} {:>10}",
            field("what"),
            field("method"),
            field("steps"),
            field("p50_us"),
            field("p99_us"),
            field("ratio_p50")
        );
    }
    for r in &report.rows {
        println!("{}", r.json());
    }
    println!("largest relative difference between the two engines' outputs: {:.2e}", report.max_rel_diff);
    println!("\nEXPLAIN of the last sparse plan over the buffered context:\n{}", report.explain);
    println!("buffer manager:\n{}", report.stats);
    if let Some(dir) = &args.plot {
        write_charts(dir, vec![hit_ratios(&report, &cfg)])?;
    }
    Ok(())
}

fn check(dir: PathBuf) -> Result<(), String> {
    let report = attnstore::durable::check(&dir).map_err(|e| format!("check failed: {e}"))?;
    println!("{report}");
    match report.is_clean() {
        true => Ok(()),
        false => Err(format!("check found damage in {} (listed above)", dir.display())),
    }
}

fn recover(dir: PathBuf, point_in_time: bool) -> Result<(), String> {
    let recovery = match point_in_time {
        true => attnstore::durable::RecoveryMode::PointInTime,
        false => attnstore::durable::RecoveryMode::Strict,
    };
    let durable = attnstore::DurableConfig { create: false, recovery, ..attnstore::DurableConfig::default() };
    let engine = Engine::open_with(&dir, EngineConfig::default(), durable).map_err(|e| match point_in_time {
        true => format!("recovery failed: {e}"),
        false => format!(
            "recovery failed: {e}\n(`attnstore recover --point-in-time` cuts a damaged log at the damage, accepting the loss of what follows)"
        ),
    })?;
    if let Some(report) = engine.recovery_report() {
        println!("{report}");
    }
    Ok(())
}

fn bench_wal(args: BenchWalArgs) -> Result<(), String> {
    let cfg = WalBenchConfig {
        dir: args.dir,
        threads: args.threads,
        records_per_thread: args.records,
        record_bytes: args.record_bytes,
        pipeline: args.pipeline,
        batch_tokens: args.batch_tokens,
        context_tokens: args.tokens,
        layers: args.layers,
        shape: shape_of(&args.shape)?,
    };
    cfg.validate().map_err(|e| e.to_string())?;
    check_memory("bench-wal --tokens", cfg.context_tokens, |t| cfg.context_bytes_needed(t))?;
    println!("attnstore bench-wal in {} ({} CPU threads)", cfg.dir.display(), rayon::current_num_threads());
    attnstore_bench::wal::run(&cfg, &mut std::io::stdout()).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = init_logging(cli.log.as_deref()) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let metrics = match cli.metrics.as_ref().map(|_| install_prometheus()).transpose() {
        Ok(handle) => handle,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match cli.command {
        Command::Bench(a) => bench(a),
        Command::Explain(a) => explain(a),
        Command::Inspect(a) => inspect(a),
        Command::Check { dir } => check(dir),
        Command::Recover { dir, point_in_time } => recover(dir, point_in_time),
        Command::BenchWal(a) => bench_wal(a),
        Command::Generate(a) => model::generate(a),
        Command::Capture(a) => model::capture(a),
        Command::Eval(a) => model::eval(a),
        Command::Argmax(a) => model::argmax_dump(a),
        Command::SynthModel(a) => model::synth_model(a),
        Command::BenchRemote(a) => remote::bench_remote(a),
    };
    let result = match (cli.metrics, metrics) {
        (Some(path), Some(handle)) => result.and_then(|()| {
            std::fs::write(&path, handle.render()).map_err(|e| format!("--metrics {}: {e}", path.display()))
        }),
        _ => result,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
