//! The remote tier on the command line: the store behind `--remote URL` and
//! `attnstore bench-remote`, which measures publish and attach against the store's own
//! pipelined SET/GET of the same values, and attach against prefill + index build.

use attnstore::remote::{ModelId, RemoteConfig, RemoteStore, RemoteTier};
use attnstore::{Budget, ContextSpec, Engine, EngineConfig, Request};
use attnstore_bench::synth::{SynthContext, SynthParams};
use attnstore_remote::{RedisConfig, RedisStore};
use clap::Args;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Options of the remote tier shared by the commands that use it.
#[derive(Args, Clone)]
pub struct RemoteArgs {
    /// A Redis server (`redis://HOST:PORT`) or a Redis Cluster (seeds separated by commas):
    /// attach the longest published prefix of the prompt from it, and publish the prompt to
    /// it in the background.
    #[arg(long)]
    pub remote: Option<String>,
    /// Tokens per published chunk (the unit of reuse).
    #[arg(long, default_value_t = 256, value_parser = crate::parse_count)]
    pub remote_chunk: usize,
    /// Bound of every remote call, in milliseconds.
    #[arg(long, default_value_t = 2000, value_parser = crate::parse_count)]
    pub remote_timeout_ms: usize,
}

impl RemoteArgs {
    /// The tier over `url`, or why not.
    pub fn tier(&self, url: &str) -> Result<RemoteTier, String> {
        let config =
            RedisConfig { timeout: Duration::from_millis(self.remote_timeout_ms as u64), ..RedisConfig::default() };
        let store = RedisStore::connect(url, config).map_err(|e| format!("--remote {url}: {e}"))?;
        let tier_config = RemoteConfig { chunk_tokens: self.remote_chunk, ..RemoteConfig::default() };
        RemoteTier::new(Arc::new(store), tier_config).map_err(|e| e.to_string())
    }
}

/// `attnstore bench-remote`.
#[derive(Args)]
pub struct BenchRemoteArgs {
    /// The store: `redis://HOST:PORT` or cluster seeds separated by commas. Without it a
    /// Redis server is started on a free loopback port for the run (Debian's
    /// `redis-server`).
    #[arg(long)]
    url: Option<String>,
    /// Tokens of the synthetic context (K and M suffixes allowed).
    #[arg(long, default_value = "128K", value_parser = crate::parse_tokens)]
    tokens: usize,
    #[command(flatten)]
    shape: crate::ShapeArgs,
    /// Tokens per chunk (one value per chunk: 256 tokens of 8 × 128 f16 KV are 1 MiB).
    #[arg(long, default_value_t = 256, value_parser = crate::parse_count)]
    chunk: usize,
    /// Runs of each measurement (ratios are reported as min / median / max).
    #[arg(long, default_value_t = 5, value_parser = crate::parse_count)]
    repeat: usize,
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[0], v[v.len() / 2], v[v.len() - 1])
}

/// Writes `count` values of `size` bytes under fresh keys and reads them back, pipelined
/// like the tier (`per_call` per call): (write MB/s, read MB/s).
fn raw_pipeline(
    store: &dyn RemoteStore,
    run: usize,
    count: usize,
    size: usize,
    per_call: usize,
    url: &str,
) -> Result<(f64, f64, String, String), String> {
    let value = vec![0x5au8; size];
    let keys: Vec<String> = (0..count).map(|i| format!("bench-raw:{run}:{i}")).collect();
    let cpu = Cpu::now(url);
    let start = Instant::now();
    for part in keys.chunks(per_call) {
        let entries: Vec<(String, Vec<u8>)> = part.iter().map(|k| (k.clone(), value.clone())).collect();
        store.set_many(&entries).map_err(|e| e.to_string())?;
    }
    let write = (count * size) as f64 / start.elapsed().as_secs_f64() / 1e6;
    let written = Cpu::now(url);
    let cpu_write = written.since(&cpu);
    let start = Instant::now();
    let mut got = 0;
    for part in keys.chunks(per_call) {
        got += store.get_many(part).map_err(|e| e.to_string())?.iter().flatten().map(Vec::len).sum::<usize>();
    }
    let read = got as f64 / start.elapsed().as_secs_f64() / 1e6;
    let cpu_read = Cpu::now(url).since(&written);
    if got != count * size {
        return Err(format!("raw pipeline read back {got} bytes of {}", count * size));
    }
    Ok((write, read, cpu_write, cpu_read))
}

/// CPU seconds used so far: by this process (`/proc/self/stat`, 100 ticks a second) and by
/// the server at `url` (`INFO cpu` through `redis-cli`; `None` for a cluster or without
/// `redis-cli`). Phases are told apart by differences.
#[derive(Clone, Copy)]
struct Cpu {
    client: Option<f64>,
    server: Option<f64>,
}

impl Cpu {
    fn now(url: &str) -> Self {
        let client = std::fs::read_to_string("/proc/self/stat").ok().and_then(|s| {
            // Fields after the command name (which may hold spaces) close with ')'.
            let rest = &s[s.rfind(')')? + 2..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some((f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?) / 100.0)
        });
        let server = single_node(url).and_then(|(host, port)| {
            let out =
                std::process::Command::new("redis-cli").args(["-h", host, "-p", port, "INFO", "cpu"]).output().ok()?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let field = |name: &str| -> Option<f64> {
                text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.trim().parse().ok())
            };
            Some(field("used_cpu_sys")? + field("used_cpu_user")?)
        });
        Self { client, server }
    }

    /// What was used since `earlier`, as `client X s + server Y s`.
    fn since(&self, earlier: &Cpu) -> String {
        let part = |a: Option<f64>, b: Option<f64>| a.zip(b).map_or("?".to_string(), |(a, b)| format!("{:.2}", a - b));
        format!("CPU client {} s + server {} s", part(self.client, earlier.client), part(self.server, earlier.server))
    }
}

/// Host and port of a single-server `redis://HOST:PORT` url.
fn single_node(url: &str) -> Option<(&str, &str)> {
    let hostport = url.strip_prefix("redis://")?;
    if hostport.contains(',') {
        return None;
    }
    hostport.trim_end_matches('/').rsplit_once(':')
}

/// `redis-benchmark` SET and GET of `size`-byte values (one connection, pipelines of
/// `pipeline`), MB/s; `None` when it is not installed or the store is a cluster.
fn redis_benchmark(url: &str, count: usize, size: usize, pipeline: usize) -> Option<(f64, f64)> {
    let (host, port) = single_node(url)?;
    let out = std::process::Command::new("redis-benchmark")
        .args(["-h", host, "-p", port, "-t", "set,get", "-c", "1", "-q", "--csv"])
        .args(["-n", &count.to_string(), "-d", &size.to_string(), "-P", &pipeline.to_string()])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rate = |name: &str| -> Option<f64> {
        let line = text.lines().find(|l| l.starts_with(&format!("\"{name}\"")))?;
        line.split(',').nth(1)?.trim_matches('"').parse::<f64>().ok()
    };
    Some((rate("SET")? * size as f64 / 1e6, rate("GET")? * size as f64 / 1e6))
}

/// `attnstore bench-remote`.
pub fn bench_remote(args: BenchRemoteArgs) -> Result<(), String> {
    let shape = crate::shape_of(&args.shape)?;
    // A server of the run's own is emptied before each run, so every run starts alike.
    let mut server = None;
    let url = match &args.url {
        Some(u) => u.clone(),
        None => {
            let s =
                attnstore_remote::testing::RedisServer::start_with(&["--maxmemory", "0"]).map_err(|e| e.to_string())?;
            server.insert(s).url()
        }
    };
    let store: Arc<dyn RemoteStore> =
        Arc::new(RedisStore::connect(&url, RedisConfig::default()).map_err(|e| format!("{url}: {e}"))?);
    println!(
        "attnstore bench-remote: {} at {} tokens, {shape:?}, chunks of {} tokens",
        store.describe(),
        args.tokens,
        args.chunk
    );
    let synth = SynthContext::generate(SynthParams::new(shape, args.tokens, args.shape.seed));
    let spec = ContextSpec::new(shape, 1).with_dtype(args.shape.dtype).with_codec(crate::codec_of(&args.shape));
    let ids: Vec<u32> = (0..args.tokens as u32).map(|i| i.wrapping_mul(2_654_435_761) % 100_000).collect();
    let model = ModelId::of_bytes(b"bench-remote synthetic model");
    let q = synth.queries(0);
    let first_attention = |engine: &Engine, ctx| -> Result<Vec<f32>, String> {
        let plan = engine.plan(&[Request::new(ctx, 0, q.clone())], &Budget::default()).map_err(|e| e.to_string())?;
        Ok(engine.execute(&plan).map_err(|e| e.to_string())?.remove(0))
    };
    let (mut publish_ratio, mut fetch_ratio, mut attach_speedup) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..args.repeat {
        if let Some(s) = &server {
            s.cli(&["FLUSHALL"]).map_err(|e| format!("FLUSHALL: {e}"))?;
        }
        // Baseline: prefill (clustering) and the first attention.
        let a = Engine::in_memory(EngineConfig::default()).map_err(|e| e.to_string())?;
        let start = Instant::now();
        let ctx = a.create_context(spec.clone()).map_err(|e| e.to_string())?;
        a.prefill(ctx, 0, &synth.keys, &synth.values).map_err(|e| e.to_string())?;
        let want = first_attention(&a, ctx)?;
        let prefill_s = start.elapsed().as_secs_f64();
        // Publish under a namespace of this run (so nothing is already there).
        let config =
            RemoteConfig { namespace: format!("bench{run}"), chunk_tokens: args.chunk, ..RemoteConfig::default() };
        let tier = RemoteTier::new(Arc::clone(&store), config.clone()).map_err(|e| e.to_string())?;
        let kv = vec![(synth.keys.clone(), synth.values.clone())];
        let cpu = Cpu::now(&url);
        let start = Instant::now();
        tier.publish(&a, ctx, &model, &ids, kv).map_err(|e| e.to_string())?;
        if !tier.flush(Duration::from_secs(600)) {
            return Err("the publish did not finish in 600 s".into());
        }
        let publish_s = start.elapsed().as_secs_f64();
        let cpu_publish = Cpu::now(&url).since(&cpu);
        let ps = tier.stats();
        if ps.publishes_done != 1 {
            return Err(format!("the publish failed: {}", ps.summary()));
        }
        drop(a);
        // Attach in a second engine, and the first attention there.
        let b = Engine::in_memory(EngineConfig::default()).map_err(|e| e.to_string())?;
        let tier = RemoteTier::new(Arc::clone(&store), config).map_err(|e| e.to_string())?;
        let cpu = Cpu::now(&url);
        let start = Instant::now();
        let attached =
            tier.attach(&b, spec.clone(), &model, &ids).map_err(|e| e.to_string())?.ok_or("nothing attached")?;
        let got = first_attention(&b, attached.context)?;
        let attach_s = start.elapsed().as_secs_f64();
        let cpu_attach = Cpu::now(&url).since(&cpu);
        if got != want {
            return Err("the attached context's first attention differs from the published one's".into());
        }
        let s = tier.stats();
        let value_bytes = ps.bytes_out / ps.values_out.max(1);
        let (raw_w, raw_r, cpu_raw_w, cpu_raw_r) = raw_pipeline(
            &*store,
            run,
            ps.values_out as usize,
            value_bytes as usize,
            RemoteConfig::default().values_per_call,
            &url,
        )?;
        let fetch_s = attached.fetch_time.as_secs_f64();
        let (pub_mb, fetch_mb) = (ps.bytes_out as f64 / publish_s / 1e6, s.bytes_in as f64 / fetch_s / 1e6);
        println!(
            "run {run}: prefill + index build + first attention {prefill_s:.2} s; publish {:.2} s ({} values of {} KB, \
             {pub_mb:.0} MB/s; raw SET pipeline {raw_w:.0} MB/s); attach + first attention {attach_s:.2} s ({} tokens, \
             {} layouts; fetch and check {fetch_s:.2} s, {fetch_mb:.0} MB/s; raw GET pipeline {raw_r:.0} MB/s; \
             restore {:.2} s); speed-up {:.1}x",
            publish_s,
            ps.values_out,
            value_bytes / 1000,
            attached.tokens,
            attached.layouts_used,
            attached.build_time.as_secs_f64(),
            prefill_s / attach_s
        );
        println!(
            "       publish {cpu_publish}; raw SET {cpu_raw_w}; attach + first attention {cpu_attach}; raw GET {cpu_raw_r}"
        );
        publish_ratio.push(pub_mb / raw_w);
        fetch_ratio.push(fetch_mb / raw_r);
        attach_speedup.push(prefill_s / attach_s);
        if run == 0 {
            if let Some((w, r)) = redis_benchmark(&url, ps.values_out as usize, value_bytes as usize, 64) {
                println!("redis-benchmark (1 connection, pipelines of 64, same value size): SET {w:.0} MB/s, GET {r:.0} MB/s");
            }
        }
    }
    let line = |name: &str, v: Vec<f64>| {
        let (lo, mid, hi) = median(v);
        println!("{name}: min {lo:.2} / median {mid:.2} / max {hi:.2}");
    };
    line("publish throughput / raw SET pipeline", publish_ratio);
    line("attach fetch throughput (read, checked, widened) / raw GET pipeline", fetch_ratio);
    line("prefill + index build + first attention / attach + first attention", attach_speedup);
    Ok(())
}
