//! The remote tier on real Redis servers started by the tests: the store's round trips,
//! bounded waits, reconnection; the tier's publish/attach, damaged and evicted values,
//! servers killed and restarted mid-run, a slow server during decode steps, and a Redis
//! Cluster losing a master. Each test skips (saying why) where redis-server is missing.

use attnstore::remote::{ModelId, RemoteConfig, RemoteErrorKind, RemoteStore, RemoteTier};
use attnstore::{AttnShape, Budget, ContextId, ContextSpec, Engine, EngineConfig, Method, Request, WaveParams};
use attnstore_remote::testing::{available, RedisCluster, RedisServer};
use attnstore_remote::{RedisConfig, RedisStore};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOKENS: usize = 2048;
const CHUNK: usize = 128;

fn skip() -> bool {
    if available() {
        return false;
    }
    eprintln!("SKIPPED: redis-server / redis-cli not installed (.ci/run installs Debian's redis-server)");
    true
}

fn config(ms: u64) -> RedisConfig {
    RedisConfig { timeout: Duration::from_millis(ms), ..RedisConfig::default() }
}

fn keys(n: usize, tag: &str) -> Vec<String> {
    (0..n).map(|i| format!("{tag}:{i}")).collect()
}

#[test]
fn values_round_trip_and_missing_keys_are_none() {
    if skip() {
        return;
    }
    let server = RedisServer::start().unwrap();
    let store = RedisStore::connect(&server.url(), config(2000)).unwrap();
    let sizes = [0usize, 1, 200_000, 7];
    let entries: Vec<(String, Vec<u8>)> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| (format!("k{i}"), (0..n).map(|b| (b * 7 + i) as u8).collect()))
        .collect();
    store.set_many(&entries).unwrap();
    let mut asked: Vec<String> = entries.iter().map(|(k, _)| k.clone()).collect();
    asked.push("absent".into());
    let got = store.get_many(&asked).unwrap();
    for ((_, v), g) in entries.iter().zip(&got) {
        assert_eq!(g.as_ref(), Some(v));
    }
    assert_eq!(got[4], None);
    assert_eq!(store.exists_many(&asked).unwrap(), vec![true, true, true, true, false]);
    // More keys than one pipeline holds.
    let many: Vec<(String, Vec<u8>)> = keys(300, "many").into_iter().map(|k| (k.clone(), k.into_bytes())).collect();
    store.set_many(&many).unwrap();
    let got = store.get_many(&keys(300, "many")).unwrap();
    assert!(got.iter().zip(&many).all(|(g, (_, v))| g.as_ref() == Some(v)));
}

#[test]
fn refusals_and_values_of_another_type_are_server_errors_and_the_connection_stays() {
    if skip() {
        return;
    }
    let server = RedisServer::start().unwrap();
    let store = RedisStore::connect(&server.url(), config(2000)).unwrap();
    store.set_many(&[("a".into(), b"1".to_vec())]).unwrap();
    server.cli(&["LPUSH", "list", "x"]).unwrap();
    let err = store.get_many(&["a".into(), "list".into()]).unwrap_err();
    assert_eq!(err.kind, RemoteErrorKind::Server, "{err}");
    assert!(err.message.contains("WRONGTYPE"), "{err}");
    assert_eq!(store.exists_many(&["list".into(), "none".into()]).unwrap(), vec![true, false]);
    // Out of memory, nothing evictable: SET is refused.
    server.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]).unwrap();
    server.cli(&["CONFIG", "SET", "maxmemory", "1"]).unwrap();
    let err = store.set_many(&[("b".into(), vec![7; 1000])]).unwrap_err();
    assert_eq!(err.kind, RemoteErrorKind::Server, "{err}");
    assert!(err.message.contains("OOM"), "{err}");
    assert_eq!(store.get_many(&["a".into(), "b".into()]).unwrap(), vec![Some(b"1".to_vec()), None]);
    server.cli(&["CONFIG", "SET", "maxmemory", "0"]).unwrap();
    store.set_many(&[("b".into(), vec![7; 1000])]).unwrap();
    assert_eq!(store.get_many(&["b".into()]).unwrap(), vec![Some(vec![7; 1000])]);
}

#[test]
fn a_sleeping_server_times_out_within_the_bound_and_a_restarted_one_is_reconnected() {
    if skip() {
        return;
    }
    let mut server = RedisServer::start().unwrap();
    let store = Arc::new(RedisStore::connect(&server.url(), config(300)).unwrap());
    store.set_many(&[("a".into(), b"1".to_vec())]).unwrap();
    let sleeper = put_to_sleep(server.port(), 3);
    let start = Instant::now();
    let err = store.get_many(&["a".into()]).unwrap_err();
    assert_eq!(err.kind, RemoteErrorKind::Timeout, "{err}");
    assert!(start.elapsed() < Duration::from_millis(1500), "waited {:?}", start.elapsed());
    sleeper.join().unwrap();
    assert_eq!(store.get_many(&["a".into()]).unwrap(), vec![Some(b"1".to_vec())], "works once the sleep ends");
    server.stop();
    let err = store.get_many(&["a".into()]).unwrap_err();
    assert_eq!(err.kind, RemoteErrorKind::Connection, "{err}");
    server.restart().unwrap();
    assert_eq!(store.get_many(&["a".into()]).unwrap(), vec![None], "reconnected; the restarted server is empty");
}

/// Deterministic KV of `tokens` tokens (`kv_heads × tokens × head_dim`).
fn kv(shape: AttnShape, tokens: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut x = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    let mut next = || {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let n = shape.kv_heads * tokens * shape.head_dim;
    ((0..n).map(|_| next()).collect(), (0..n).map(|_| next()).collect())
}

fn shape() -> AttnShape {
    AttnShape::new(4, 2, 16).unwrap()
}

fn spec() -> ContextSpec {
    ContextSpec::new(shape(), 2).with_method(Method::Wave(WaveParams {
        segment_tokens: 512,
        decode_segment_tokens: 256,
        ..WaveParams::default()
    }))
}

fn ids(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) % 50_000).collect()
}

/// A published context: its engine, id, and the answers of a few queries.
struct Published {
    engine: Engine,
    ctx: ContextId,
    kv: (Vec<f32>, Vec<f32>),
}

fn build() -> Published {
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let ctx = engine.create_context(spec()).unwrap();
    let kv = kv(shape(), TOKENS, 5);
    for l in 0..2 {
        engine.prefill(ctx, l, &kv.0, &kv.1).unwrap();
    }
    Published { engine, ctx, kv }
}

fn answers(engine: &Engine, ctx: ContextId) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    for l in 0..2 {
        for budget in [Budget::default().with_retrieve_floor(64), Budget::full()] {
            let q: Vec<f32> = (0..shape().query_len()).map(|i| ((i * 13 + l) % 7) as f32 * 0.3 - 0.9).collect();
            let plan = engine.plan(&[Request::new(ctx, l, q)], &budget).unwrap();
            out.push(engine.execute(&plan).unwrap().remove(0));
        }
    }
    out
}

fn tier(store: Arc<dyn RemoteStore>) -> RemoteTier {
    RemoteTier::new(store, RemoteConfig { chunk_tokens: CHUNK, values_per_call: 16, ..RemoteConfig::default() })
        .unwrap()
}

fn publish(t: &RemoteTier, p: &Published, model: &ModelId) {
    t.publish(&p.engine, p.ctx, model, &ids(TOKENS), vec![p.kv.clone(), p.kv.clone()]).unwrap();
    assert!(t.flush(Duration::from_secs(60)));
}

#[test]
fn publish_then_attach_through_redis_and_damage_of_every_kind_shortens_the_prefix() {
    if skip() {
        return;
    }
    let server = RedisServer::start().unwrap();
    let store: Arc<dyn RemoteStore> = Arc::new(RedisStore::connect(&server.url(), config(2000)).unwrap());
    let model = ModelId::of_bytes(b"redis test model");
    let p = build();
    let t = tier(Arc::clone(&store));
    publish(&t, &p, &model);
    assert_eq!(t.stats().publishes_done, 1);
    let second = Engine::in_memory(EngineConfig::default()).unwrap();
    let got = t.attach(&second, spec(), &model, &ids(TOKENS)).unwrap().unwrap();
    assert_eq!((got.tokens, got.layouts_used), (TOKENS, 2));
    assert_eq!(answers(&second, got.context), answers(&p.engine, p.ctx), "same answers in the second engine");
    // Another model's identity matches nothing.
    assert!(t.attach(&second, spec(), &ModelId::of_bytes(b"other"), &ids(TOKENS)).unwrap().is_none());

    let rows: Vec<String> =
        server.cli(&["--scan", "--pattern", "*:kv:*:1:g:*"]).unwrap().lines().map(str::to_owned).collect();
    assert_eq!(rows.len(), TOKENS / CHUNK);
    // Find the key of a chunk by deleting each in turn is slow; instead damage one and see
    // where the prefix ends (it must end exactly there and be counted).
    let victim = &rows[rows.len() / 2];
    let prefix_with = |what: &str, t: &RemoteTier| {
        let e = Engine::in_memory(EngineConfig::default()).unwrap();
        let got = t.attach(&e, spec(), &model, &ids(TOKENS)).unwrap();
        let n = got.as_ref().map_or(0, |g| g.tokens);
        if let Some(g) = got {
            // Whatever was attached answers like the same rows prefilled.
            let fresh = Engine::in_memory(EngineConfig::default()).unwrap();
            let ctx = fresh.create_context(ContextSpec::new(shape(), 1).with_method(Method::Flat)).unwrap();
            let cut: (Vec<f32>, Vec<f32>) = {
                let d = shape().head_dim;
                let pick = |x: &[f32]| -> Vec<f32> {
                    (0..shape().kv_heads).flat_map(|h| x[h * TOKENS * d..(h * TOKENS + n) * d].to_vec()).collect()
                };
                (pick(&p.kv.0), pick(&p.kv.1))
            };
            fresh.prefill(ctx, 0, &cut.0, &cut.1).unwrap();
            let q: Vec<f32> = (0..shape().query_len()).map(|i| (i % 5) as f32 * 0.2).collect();
            let a = e.execute(&e.plan(&[Request::new(g.context, 0, q.clone())], &Budget::full()).unwrap()).unwrap();
            let b = fresh.execute(&fresh.plan(&[Request::new(ctx, 0, q)], &Budget::full()).unwrap()).unwrap();
            let err: f32 = a[0].iter().zip(&b[0]).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
            assert!(err < 1e-5, "{what}: attached rows differ ({err})");
        }
        n
    };
    let full = prefix_with("intact", &t);
    assert_eq!(full, TOKENS);
    let original = server.cli(&["--no-raw", "STRLEN", victim]).unwrap();
    // A flipped byte (SETRANGE).
    server.cli(&["SETRANGE", victim, "100", "\u{1}"]).unwrap();
    let t1 = tier(Arc::clone(&store));
    let short = prefix_with("flipped", &t1);
    assert!(short < TOKENS && short % CHUNK == 0, "{short}");
    assert_eq!((t1.stats().corrupt, t1.stats().misses), (1, 0));
    // A truncated value: the same chunk, so the same prefix.
    let dump = server.cli(&["--no-raw", "GETRANGE", victim, "0", "50"]).unwrap();
    assert!(!dump.is_empty() && !original.is_empty());
    server.cli(&["SET", victim, "truncated"]).unwrap();
    let t2 = tier(Arc::clone(&store));
    assert_eq!(prefix_with("truncated", &t2), short);
    assert_eq!(t2.stats().corrupt, 1);
    // A deleted key.
    server.cli(&["DEL", victim]).unwrap();
    let t3 = tier(Arc::clone(&store));
    assert_eq!(prefix_with("deleted", &t3), short);
    assert_eq!((t3.stats().corrupt, t3.stats().misses), (0, 1));
    // A republish repairs it (only the missing value is written).
    publish(&t3, &p, &model);
    assert_eq!(t3.stats().values_out, 1);
    assert_eq!(prefix_with("repaired", &t3), TOKENS);
}

#[test]
fn evicted_values_shorten_the_prefix_and_are_counted() {
    if skip() {
        return;
    }
    let server = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"]).unwrap();
    let store: Arc<dyn RemoteStore> = Arc::new(RedisStore::connect(&server.url(), config(2000)).unwrap());
    let model = ModelId::of_bytes(b"redis test model");
    let p = build();
    let t = tier(Arc::clone(&store));
    publish(&t, &p, &model);
    // Then the server gets less memory than it holds: least recently used keys go first.
    let used: u64 = server
        .cli(&["INFO", "memory"])
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    server.cli(&["CONFIG", "SET", "maxmemory", &(used - 200_000).to_string()]).unwrap();
    server.cli(&["SET", "trigger", "eviction"]).unwrap();
    let evicted: u64 = server
        .cli(&["INFO", "stats"])
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("evicted_keys:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    assert!(evicted > 0, "the publish filled the server past maxmemory");
    let e = Engine::in_memory(EngineConfig::default()).unwrap();
    let got = t.attach(&e, spec(), &model, &ids(TOKENS)).unwrap();
    let n = got.as_ref().map_or(0, |g| g.tokens);
    assert!(n < TOKENS, "{n}");
    assert!(t.stats().misses >= 1);
}

#[test]
fn a_server_killed_mid_publish_and_mid_attach_loses_nothing_local_and_serves_nothing_wrong() {
    if skip() {
        return;
    }
    let mut server = RedisServer::start().unwrap();
    let store: Arc<dyn RemoteStore> = Arc::new(RedisStore::connect(&server.url(), config(500)).unwrap());
    let model = ModelId::of_bytes(b"redis test model");
    let p = build();
    let before = answers(&p.engine, p.ctx);
    let t = tier(Arc::clone(&store));
    // Killed while the publish runs: it stops at a failed call.
    t.publish(&p.engine, p.ctx, &model, &ids(TOKENS), vec![p.kv.clone(), p.kv.clone()]).unwrap();
    server.stop();
    assert!(t.flush(Duration::from_secs(30)));
    let s = t.stats();
    assert_eq!(s.publishes_done + s.publishes_failed, 1);
    // Attach against the dead server: nothing, counted, quickly.
    let e = Engine::in_memory(EngineConfig::default()).unwrap();
    assert!(t.attach(&e, spec(), &model, &ids(TOKENS)).unwrap().is_none());
    assert!(t.stats().connection_failures >= 1);
    assert!(e.contexts().is_empty(), "a failed attach leaves no context behind");
    // Restarted empty: nothing is served, and publishing works again.
    server.restart().unwrap();
    assert!(t.attach(&e, spec(), &model, &ids(TOKENS)).unwrap().is_none());
    publish(&t, &p, &model);
    // Killed between the attach's reads: whatever it attached is right (checked values only).
    let t2 = tier(Arc::clone(&store));
    let killer = {
        let port = server.port();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(2));
            let _ =
                std::process::Command::new("redis-cli").args(["-p", &port.to_string(), "SHUTDOWN", "NOSAVE"]).output();
        })
    };
    let got = t2.attach(&e, spec(), &model, &ids(TOKENS)).unwrap();
    killer.join().unwrap();
    if let Some(g) = got {
        assert!(g.tokens <= TOKENS && g.tokens % CHUNK == 0);
    }
    assert_eq!(answers(&p.engine, p.ctx), before, "the local context is untouched");
}

#[test]
fn a_slow_server_never_blocks_decode_steps() {
    if skip() {
        return;
    }
    let server = RedisServer::start().unwrap();
    let store: Arc<dyn RemoteStore> = Arc::new(RedisStore::connect(&server.url(), config(5000)).unwrap());
    let model = ModelId::of_bytes(b"redis test model");
    let p = build();
    let t = tier(Arc::clone(&store));
    let sleeper = put_to_sleep(server.port(), 3);
    t.publish(&p.engine, p.ctx, &model, &ids(TOKENS), vec![p.kv.clone(), p.kv.clone()]).unwrap();
    // The writer waits on the sleeping server; decode steps go on.
    for step in 0..20 {
        let (k, v) = kv(shape(), 1, 100 + step);
        p.engine.append(p.ctx, 0, &k, &v).unwrap();
        let plan =
            p.engine.plan(&[Request::new(p.ctx, 0, vec![0.1; shape().query_len()])], &Budget::default()).unwrap();
        p.engine.execute(&plan).unwrap();
    }
    assert!(!t.flush(Duration::ZERO), "the publish is still waiting for the server");
    sleeper.join().unwrap();
    assert!(t.flush(Duration::from_secs(30)));
    assert_eq!(t.stats().publishes_done, 1);
}

#[test]
fn a_cluster_losing_a_master_keeps_serving_what_it_holds() {
    if skip() {
        return;
    }
    let mut cluster = RedisCluster::start(3, 1).unwrap();
    let store = Arc::new(RedisStore::connect(&cluster.url(), config(2000)).unwrap());
    // Keys spread over every master's slots.
    let many: Vec<(String, Vec<u8>)> =
        keys(500, "spread").into_iter().map(|k| (k.clone(), k.clone().into_bytes())).collect();
    store.set_many(&many).unwrap();
    let got = store.get_many(&keys(500, "spread")).unwrap();
    assert!(got.iter().zip(&many).all(|(g, (_, v))| g.as_ref() == Some(v)));
    let model = ModelId::of_bytes(b"redis test model");
    let p = build();
    let t = tier(Arc::clone(&store) as Arc<dyn RemoteStore>);
    publish(&t, &p, &model);
    let e = Engine::in_memory(EngineConfig::default()).unwrap();
    let got = t.attach(&e, spec(), &model, &ids(TOKENS)).unwrap().unwrap();
    assert_eq!(got.tokens, TOKENS);
    assert_eq!(answers(&e, got.context), answers(&p.engine, p.ctx));
    // Let the replicas catch up, then kill a master: its replica takes over.
    cluster.wait_replicated().unwrap();
    let victim = cluster.master_ports()[0];
    cluster.kill_master_and_wait_failover(victim).unwrap();
    // The first call after the failover may still go to the killed master (a connection
    // error, and its connections are dropped); a later one reads every value, those of the
    // lost master's slots from its promoted replica.
    let mut read = store.get_many(&keys(500, "spread"));
    for _ in 0..3 {
        if read.is_ok() {
            break;
        }
        assert_eq!(read.as_ref().unwrap_err().kind, RemoteErrorKind::Connection, "{read:?}");
        std::thread::sleep(Duration::from_millis(200));
        read = store.get_many(&keys(500, "spread"));
    }
    assert!(read.unwrap().iter().zip(&many).all(|(g, (_, v))| g.as_ref() == Some(v)));
    let e2 = Engine::in_memory(EngineConfig::default()).unwrap();
    // The first calls after a failover may fail while the client learns the new map; the
    // attach then finds a shorter prefix, never a wrong one. Once it has, all is there.
    let mut tokens = 0;
    for _ in 0..5 {
        if let Some(g) = t.attach(&e2, spec(), &model, &ids(TOKENS)).unwrap() {
            tokens = g.tokens;
            if tokens == TOKENS {
                assert_eq!(answers(&e2, g.context), answers(&p.engine, p.ctx));
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(tokens, TOKENS, "every value survived on the promoted replicas");
    // Writes work after the failover.
    store.set_many(&[("after".into(), b"x".to_vec())]).unwrap();
    assert_eq!(store.get_many(&["after".into()]).unwrap(), vec![Some(b"x".to_vec())]);
}

/// Waits until `port` is asleep (`DEBUG SLEEP` sent by another thread): a probe times out.
/// Sends `DEBUG SLEEP secs` to the server on `port` from another thread and returns once it
/// sleeps (a probe call times out); join the handle to wait for it to wake.
fn put_to_sleep(port: u16, secs: u32) -> std::thread::JoinHandle<()> {
    let sleeper = std::thread::spawn(move || {
        let _ = std::process::Command::new("redis-cli")
            .args(["-p", &port.to_string(), "DEBUG", "SLEEP", &secs.to_string()])
            .output();
    });
    wait_asleep(port);
    sleeper
}

fn wait_asleep(port: u16) {
    let probe = RedisStore::connect(&format!("redis://127.0.0.1:{port}"), config(100)).unwrap();
    let waiting = Instant::now();
    while !matches!(probe.exists_many(&["probe".into()]), Err(e) if e.kind == RemoteErrorKind::Timeout) {
        assert!(waiting.elapsed() < Duration::from_secs(5), "the server never slept (DEBUG SLEEP refused?)");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_cluster_bounds_a_sleeping_master_and_follows_slots_that_moved() {
    if skip() {
        return;
    }
    // A node timeout longer than the sleep below: the sleeping master is not failed over.
    let cluster = RedisCluster::start_with(3, 1, &["--cluster-node-timeout", "10000"]).unwrap();
    let store = RedisStore::connect(&cluster.url(), config(300)).unwrap();
    assert!(store.describe().starts_with("redis cluster (seeds: 127.0.0.1:"), "{}", store.describe());
    let all = keys(200, "moving");
    let entries: Vec<(String, Vec<u8>)> = all.iter().map(|k| (k.clone(), k.clone().into_bytes())).collect();
    store.set_many(&entries).unwrap();
    let reads_back = |store: &RedisStore| {
        let got = store.get_many(&all).unwrap();
        assert!(got.iter().zip(&entries).all(|(g, (_, v))| g.as_ref() == Some(v)));
    };

    // One master asleep: the call fails once its pipeline's bound has passed, not once
    // per key that master serves.
    let sleeper = put_to_sleep(cluster.master_ports()[0], 3);
    let start = Instant::now();
    let err = store.get_many(&all).unwrap_err();
    assert_eq!(err.kind, RemoteErrorKind::Timeout, "{err}");
    assert!(start.elapsed() < Duration::from_millis(1000), "waited {:?}", start.elapsed());
    sleeper.join().unwrap();
    reads_back(&store);

    // A manual failover: the old master answers MOVED for its slots (its connection
    // works); the store follows and reads its slot map again.
    let master = cluster.master_ports()[0];
    let replica = cluster
        .nodes()
        .iter()
        .find(|n| {
            let role = n.cli(&["ROLE"]).unwrap();
            let role: Vec<&str> = role.lines().collect();
            role.first() == Some(&"slave") && role.get(2) == Some(&master.to_string().as_str())
        })
        .expect("every master has a replica")
        .port();
    let waiting = Instant::now();
    let mut asked = None;
    while cluster.master_ports().contains(&master) || !cluster.master_ports().contains(&replica) {
        // Under a loaded machine (tests in parallel on 2 cores) the handshake can take a while,
        // and a manual failover whose replica does not catch up in time is aborted by the
        // server: ask again every 10 s.
        assert!(waiting.elapsed() < Duration::from_secs(45), "the manual failover did not happen");
        if asked.is_none_or(|t: Instant| t.elapsed() > Duration::from_secs(10)) {
            assert_eq!(cluster.cli(replica, &["CLUSTER", "FAILOVER"]).unwrap().trim(), "OK");
            asked = Some(Instant::now());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    reads_back(&store);
    let rewritten: Vec<(String, Vec<u8>)> = all.iter().map(|k| (k.clone(), b"new".to_vec())).collect();
    store.set_many(&rewritten).unwrap();
    assert!(store.get_many(&all).unwrap().iter().all(|g| g.as_deref() == Some(&b"new"[..])));
}
