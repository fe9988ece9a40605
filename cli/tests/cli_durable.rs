//! `attnstore check` and `attnstore recover` on a real directory: what they print, and
//! that corruption makes `check` fail naming the file and offset.

use std::process::Command;

use attnstore::durable::{DATA_DIR, WAL_DIR};
use attnstore::{AttnShape, ContextSpec, Engine, EngineConfig, Method};

fn attnstore(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_attnstore")).args(args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn check_verifies_and_describes_a_directory_recover_cuts_a_torn_tail_and_corruption_fails_check() {
    let dir = tempfile::tempdir().unwrap();
    let shape = AttnShape::new(4, 2, 8).unwrap();
    {
        let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
        let ctx = engine.create_context(ContextSpec::new(shape, 2).with_method(Method::Flat)).unwrap();
        let kv = vec![0.5; shape.kv_len(10)];
        engine.prefill(ctx, 0, &kv, &kv).unwrap();
        engine.checkpoint().unwrap();
        engine.append(ctx, 0, &kv[..shape.kv_len(1)], &kv[..shape.kv_len(1)]).unwrap();
    }
    let path = dir.path().to_str().unwrap();
    let (ok, text) = attnstore(&["check", path]);
    assert!(ok, "{text}");
    assert!(text.contains("manifest: generation 1"), "{text}");
    assert!(text.contains("context 1: 4 q heads / 2 kv heads, d=8, 2 layers, codec f16, flat"), "{text}");
    assert!(text.contains("context 1 layer 0: 11 tokens in 2 chunks"), "{text}");

    // Cut the log short: that is damage, not a crash (log files are preallocated). Check and
    // recover refuse, naming the file; recover --point-in-time cuts and says what it cut.
    let log = attnstore_wal::list_log_files(&dir.path().join(WAL_DIR)).unwrap().pop().unwrap().1;
    let log_name = log.file_name().unwrap().to_string_lossy().into_owned();
    let written = std::fs::read(&log).unwrap();
    let end = written.iter().rposition(|&b| b != 0).unwrap() + 1;
    std::fs::OpenOptions::new().write(true).open(&log).unwrap().set_len(end as u64 - 3).unwrap();
    let (ok, text) = attnstore(&["check", path]);
    assert!(!ok && text.contains(&log_name) && text.contains("cut short"), "{text}");
    let (ok, text) = attnstore(&["recover", path]);
    assert!(!ok && text.contains(&log_name) && text.contains("--point-in-time"), "{text}");
    let (ok, text) = attnstore(&["recover", "--point-in-time", path]);
    assert!(ok && text.contains("POINT-IN-TIME RECOVERY") && text.contains(&log_name), "{text}");
    assert!(text.contains("10 tokens"), "the cut append is gone: {text}");
    let (ok, text) = attnstore(&["check", path]);
    assert!(ok && text.ends_with("ok\n"), "{text}");

    // A flipped bit in a data file: check fails and names the file and offset.
    let data = dir.path().join(DATA_DIR).join("ctx-0000000001-layer-0000.kv");
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[40] ^= 1;
    std::fs::write(&data, bytes).unwrap();
    let (ok, text) = attnstore(&["check", path]);
    assert!(!ok, "{text}");
    assert!(text.contains("ctx-0000000001-layer-0000.kv: corrupt at offset 0"), "{text}");
}

#[test]
fn check_and_recover_refuse_a_directory_that_is_not_an_engine_directory_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_str().unwrap();
    for command in ["check", "recover"] {
        let (ok, text) = attnstore(&[command, path]);
        assert!(!ok && text.contains("not an attnstore engine directory") && text.contains("empty"), "{text}");
    }
    std::fs::write(dir.path().join("notes.txt"), b"mine").unwrap();
    for command in ["check", "recover"] {
        let (ok, text) = attnstore(&[command, path]);
        assert!(!ok && text.contains("notes.txt"), "{text}");
    }
    let missing = dir.path().join("missing");
    let (ok, text) = attnstore(&["recover", missing.to_str().unwrap()]);
    assert!(!ok && text.contains("does not exist"), "{text}");
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from("notes.txt")], "nothing was written");
}
