//! `attnstore bench --plot DIR` writes its charts as SVG and PNG: the frontier per context
//! length with one line per method and the oracle's, latency against length, and the tiers'
//! hit ratios over a buffered run; `inspect --plot` the last of them.

use std::path::Path;
use std::process::Command;

fn check_chart(dir: &Path, stem: &str, wanted: &[&str]) {
    let svg = std::fs::read_to_string(dir.join(format!("{stem}.svg"))).unwrap();
    assert!(svg.starts_with("<svg"), "{stem}.svg is not SVG");
    for w in wanted {
        assert!(svg.contains(w), "{stem}.svg lacks {w:?}");
    }
    let png = std::fs::read(dir.join(format!("{stem}.png"))).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{stem}.png is not PNG");
    // The IHDR chunk: the raster has the SVG's size.
    let (w, h) =
        (u32::from_be_bytes(png[16..20].try_into().unwrap()), u32::from_be_bytes(png[20..24].try_into().unwrap()));
    assert_eq!((w, h), (900, 560), "{stem}.png");
}

#[test]
fn bench_plot_writes_the_frontier_latency_and_hit_ratio_charts() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_attnstore"))
        .args(["bench", "--tokens", "2K,3K", "--queries", "1", "--reps", "1", "--scales", "0.5,1", "--method", "wave"])
        .args(["--estimate", "rest", "--selection", "per-kv-head", "--json", "--plot"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // One decode row per scale for wave and for the oracle, per length.
    let stdout = String::from_utf8(out.stdout).unwrap();
    let decode = stdout.lines().filter(|l| l.contains("\"bench\":\"decode\"")).count();
    assert_eq!(decode, 2 * (1 + 2 + 2), "{stdout}");
    for stem in ["frontier_2K", "frontier_3K"] {
        check_chart(dir.path(), stem, &["Accuracy/cost frontier", "wave per-kv-head est rest", "oracle top-k"]);
    }
    check_chart(dir.path(), "latency", &["context length", "exact", "memory-read ceiling"]);
    check_chart(dir.path(), "hit_ratios", &["gpu tier, per step", "host tier, cumulative"]);
}

#[test]
fn inspect_plot_writes_the_hit_ratio_chart_and_a_bad_scale_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_attnstore"))
        .args(["inspect", "--tokens", "4K", "--steps", "5", "--exact-steps", "0", "--plot"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    check_chart(dir.path(), "hit_ratios", &["5 decode steps", "gpu tier, per step"]);
    let out = Command::new(env!("CARGO_BIN_EXE_attnstore")).args(["bench", "--scales", "0.5,-1"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("-1"), "{}", String::from_utf8_lossy(&out.stderr));
}
