//! `attnstore inspect --prometheus` prints the metrics of its run in the Prometheus text
//! format, parsed here with a Prometheus parser: plan and execute latency, requests per
//! method and strategy, and the buffered engine's tiers.

use std::process::Command;

#[test]
fn inspect_prints_metrics_that_a_prometheus_parser_reads() {
    let out = Command::new(env!("CARGO_BIN_EXE_attnstore"))
        .args(["inspect", "--tokens", "4K", "--steps", "3", "--exact-steps", "1", "--no-maintainer", "--prometheus"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).unwrap();
    let sample = |name: &str, labels: &[(&str, &str)]| {
        scrape
            .samples
            .iter()
            .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .unwrap_or_else(|| panic!("no {name} {labels:?} in\n{text}"))
    };
    let value = |s: &prometheus_parse::Sample| match s.value {
        prometheus_parse::Value::Counter(v)
        | prometheus_parse::Value::Gauge(v)
        | prometheus_parse::Value::Untyped(v) => v,
        ref other => panic!("{other:?}"),
    };
    // Each sparse step plans and executes on both engines; exact steps once more each.
    let sparse = value(sample("attnstore_requests_total", &[("method", "wave"), ("strategy", "sparse")]));
    assert!(sparse >= 6.0, "{sparse}\n{text}");
    assert!(value(sample("attnstore_buffer_used_blocks", &[("tier", "host")])) > 0.0, "{text}");
    assert!(value(sample("attnstore_buffer_hits_total", &[("tier", "host")])) > 0.0, "{text}");
    assert!(scrape.samples.iter().any(|s| s.metric.starts_with("attnstore_plan_seconds")), "{text}");
}

#[test]
fn the_global_metrics_flag_writes_the_wal_and_request_metrics_of_any_command() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("metrics.prom");
    let out = Command::new(env!("CARGO_BIN_EXE_attnstore"))
        .arg("--metrics")
        .arg(&file)
        .args(["bench-wal", "--records", "40", "--threads", "2", "--record-bytes", "512", "--tokens", "2K"])
        .args(["--kv-heads", "2", "--q-heads", "4", "--head-dim", "32", "--dir"])
        .arg(dir.path().join("wal"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&file).unwrap();
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap();
    let counter = |name: &str| {
        scrape
            .samples
            .iter()
            .find(|s| s.metric == name)
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
                ref other => panic!("{other:?}"),
            })
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
    };
    // Every durable commit of the bench ended in a group fsync.
    assert!(counter("attnstore_wal_fsyncs_total") >= 1.0, "{text}");
    for summary in ["attnstore_wal_group_records", "attnstore_wal_fsync_seconds", "attnstore_wal_commit_wait_seconds"] {
        assert!(scrape.samples.iter().any(|s| s.metric.starts_with(summary)), "no {summary} in\n{text}");
    }
}
