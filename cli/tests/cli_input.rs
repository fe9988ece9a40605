//! Bad command-line input is refused up front with a message that says what was wrong and
//! what was expected: a non-zero exit, never a panic or an abort, and before any model is
//! loaded or any large context allocated (every case here returns in well under a second).

use std::process::Command;

/// Runs `attnstore args` and returns its exit code and stdout + stderr.
fn attnstore(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_attnstore")).args(args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code(), text)
}

/// Asserts that `args` fail with an ordinary error exit (1, or clap's 2 for a bad value),
/// not a signal or a panic, and that the message contains every one of `expected`.
fn refused(args: &[&str], expected: &[&str]) -> String {
    let (code, text) = attnstore(args);
    assert!(matches!(code, Some(1 | 2)), "attnstore {args:?} exited with {code:?}:\n{text}");
    assert!(!text.contains("panicked"), "attnstore {args:?} panicked:\n{text}");
    for e in expected {
        assert!(text.contains(e), "attnstore {args:?}: expected {e:?} in:\n{text}");
    }
    text
}

/// A model path that does not exist: a command that reached the model would say so.
const NO_MODEL: &str = "/nonexistent/attnstore-test-model.gguf";

#[test]
fn bench_wal_refuses_zero_records_threads_and_other_empty_counts() {
    for flag in ["--records", "--threads", "--pipeline", "--batch-tokens", "--layers"] {
        refused(&["bench-wal", flag, "0"], &[flag, "must be at least 1, got 0"]);
    }
    refused(&["bench-wal", "--records", "many"], &["--records", "not a count"]);
}

#[test]
fn bench_refuses_zero_queries_and_reps() {
    refused(&["bench", "--queries", "0"], &["--queries", "at least 1"]);
    refused(&["bench", "--reps", "0"], &["--reps", "at least 1"]);
    refused(&["inspect", "--steps", "0"], &["--steps", "at least 1"]);
}

#[test]
fn eval_refuses_depths_outside_0_to_1_too_few_gen_tokens_and_bad_scales_before_loading_the_model() {
    let text = refused(&["eval", "--passkey-depths", "0.5,2", "--model", NO_MODEL], &["passkey depth 2", "0..=1"]);
    assert!(!text.contains("not found"), "{text}");
    refused(&["eval", "--passkey-depths", "NaN", "--model", NO_MODEL], &["outside 0..=1"]);
    refused(&["eval", "--gen-tokens", "0", "--model", NO_MODEL], &["--gen-tokens", "at least 2"]);
    refused(&["eval", "--gen-tokens", "1", "--model", NO_MODEL], &["at least 2"]);
    refused(&["eval", "--scales", "1,-1", "--model", NO_MODEL], &["budget scale -1", "positive"]);
    let text = refused(&["eval", "--methods", "exact", "--model", NO_MODEL], &["nothing to compare"]);
    assert!(!text.contains("not found"), "the model was looked for first: {text}");
    refused(&["eval", "--scales", "100", "--model", NO_MODEL], &["budget scale 100", "invalid budget"]);
}

#[test]
fn generate_checks_budget_prompt_and_counts_before_loading_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let prompt = dir.path().join("prompt.txt");
    std::fs::write(&prompt, "Say hello.").unwrap();
    let blank = dir.path().join("blank.txt");
    std::fs::write(&blank, " \n\t\n").unwrap();
    let (prompt, blank) = (prompt.to_str().unwrap(), blank.to_str().unwrap());

    // Each of these would otherwise report the missing model first.
    let cases: [(&[&str], &[&str]); 5] = [
        (&["--prompt-file", prompt, "--retrieve", "2"], &["invalid budget"]),
        (&["--prompt-file", blank], &["blank.txt is empty"]),
        (&["--prompt-file", "/nonexistent/prompt.txt"], &["prompt file /nonexistent/prompt.txt"]),
        (&["--prompt-file", prompt, "--max-tokens", "0"], &["--max-tokens", "at least 1"]),
        (&["--prompt-file", prompt, "--chunk", "0"], &["--chunk", "at least 1"]),
    ];
    for (args, expected) in cases {
        let args: Vec<&str> = ["generate", "--model", NO_MODEL].iter().chain(args).copied().collect();
        let text = refused(&args, expected);
        assert!(!text.contains("not found"), "the model was looked for first: {text}");
    }
    // A valid request gets as far as the model.
    refused(&["generate", "--model", NO_MODEL, "--prompt-file", prompt], &["not found"]);
}

/// Whether `/proc/meminfo` tells the memory available (the memory check is skipped where it
/// does not, and then these cases would really allocate).
fn meminfo_readable() -> bool {
    std::fs::read_to_string("/proc/meminfo").is_ok_and(|m| m.contains("MemAvailable:"))
}

#[test]
fn a_synthetic_context_larger_than_memory_is_refused_before_it_is_allocated() {
    if !meminfo_readable() {
        eprintln!("no MemAvailable in /proc/meminfo: the memory check is skipped, so is this test");
        return;
    }
    // 2^40 tokens of 8 KV heads x 128 dims: petabytes of f32 keys and values.
    let huge = "1048576M";
    for (args, what) in [
        (vec!["bench", "--tokens", huge], "bench --tokens"),
        (vec!["bench", "--tokens", &format!("1K,{huge}")], "bench --tokens"),
        (vec!["explain", "--tokens", huge], "explain --tokens"),
        (vec!["inspect", "--tokens", huge], "inspect --tokens"),
        (vec!["bench-wal", "--tokens", huge, "--records", "1", "--threads", "1"], "bench-wal --tokens"),
    ] {
        let text = refused(&args, &[what, "1099511627776 tokens need about", "TiB", "(MemAvailable)", "at most about"]);
        assert!(!text.contains("memory allocation"), "{text}");
    }
}

#[test]
fn inspect_block_bytes_are_a_multiple_of_64_and_of_512_with_a_spill_dir() {
    refused(&["inspect", "--tokens", "1K", "--block-bytes", "100"], &["multiple of 64", "got 100"]);
    let dir = tempfile::tempdir().unwrap();
    let spill = dir.path().to_str().unwrap();
    refused(
        &["inspect", "--tokens", "1K", "--host-blocks", "64", "--spill-dir", spill, "--block-bytes", "576"],
        &["512", "576"],
    );
}

#[test]
fn help_texts_say_what_the_code_accepts() {
    let (_, text) = attnstore(&["inspect", "--help"]);
    assert!(text.contains("multiple of 64") && text.contains("multiple of 512"), "{text}");
    let (_, text) = attnstore(&["eval", "--help"]);
    assert!(text.contains("oracle") && text.contains("exact, which adds rows only with an encoded --codec"), "{text}");
    let (_, text) = attnstore(&["bench", "--help"]);
    assert!(text.contains("PQ") && text.contains("--trace") && text.contains("memory-read"), "{text}");
}
