//! `include/attnstore.h` is what cbindgen generates from `src/lib.rs` now (regenerate with
//! `ATTNSTORE_UPDATE_HEADER=1 cargo test -p attnstore-capi --test header`).

#[test]
fn the_c_header_is_current() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let config = cbindgen::Config::from_file(format!("{dir}/cbindgen.toml")).unwrap();
    let mut generated = Vec::new();
    cbindgen::Builder::new().with_crate(dir).with_config(config).generate().unwrap().write(&mut generated);
    let path = format!("{dir}/include/attnstore.h");
    if std::env::var_os("ATTNSTORE_UPDATE_HEADER").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{path} is stale: run ATTNSTORE_UPDATE_HEADER=1 cargo test -p attnstore-capi --test header"
    );
}
