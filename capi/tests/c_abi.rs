//! The C test (`tests/c/basic.c`) compiled against `include/attnstore.h` and this crate's
//! static library with the system C compiler, then run: exit code 0 when its checks hold.
//! Without a C compiler (`cc`) it skips with a printed reason.

use std::path::PathBuf;
use std::process::Command;

/// The static library cargo built beside this test's executable.
fn static_lib() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let profile = deps.parent().unwrap();
    for dir in [profile, deps] {
        let lib = dir.join("libattnstore_capi.a");
        if lib.exists() {
            return lib;
        }
    }
    // The newest: builds with other features leave libraries of their own beside it.
    let found = std::fs::read_dir(deps)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libattnstore_capi") && n.ends_with(".a"))
        })
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok());
    found.unwrap_or_else(|| panic!("no libattnstore_capi.a near {}", exe.display()))
}

#[test]
fn the_c_test_compiles_against_the_header_and_passes() {
    if Command::new("cc").arg("--version").output().is_err() {
        eprintln!("skipped: no C compiler (cc) on this machine");
        return;
    }
    let dir = env!("CARGO_MANIFEST_DIR");
    let out = std::env::temp_dir().join(format!("attnstore-c-abi-{}", std::process::id()));
    // A `cuda` build's library has `attnstore_attend_device`: the test checks it too.
    let cuda: &[&str] = if cfg!(feature = "cuda") { &["-DATTNSTORE_CUDA"] } else { &[] };
    let built = Command::new("cc")
        .args(cuda)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-I"])
        .arg(format!("{dir}/include"))
        .arg(format!("{dir}/tests/c/basic.c"))
        .arg(static_lib())
        .args(["-lpthread", "-ldl", "-lm", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(built.status.success(), "cc failed:\n{}", String::from_utf8_lossy(&built.stderr));
    let run = Command::new(&out).output().unwrap();
    let _ = std::fs::remove_file(&out);
    assert!(
        run.status.success(),
        "the C test failed:\n{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(String::from_utf8_lossy(&run.stdout).contains("all checks passed"));
}
