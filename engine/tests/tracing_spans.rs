//! The engine's tracing spans: an embedding application that installs a subscriber sees
//! plan, execute, ingest, open (recovery), checkpoint, maintainer rounds, block reads and
//! WAL group flushes, with their fields. (One test in its own binary: it installs the
//! process-wide subscriber, so spans on rayon and maintainer threads are seen too.)

mod common;
use common::synth::{SynthContext, SynthParams};

use std::sync::{Arc, Mutex};

use attnstore::{AttnShape, Budget, BufferSettings, ContextSpec, Engine, EngineConfig, Request};
use tracing::span::{Attributes, Id};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

/// Records the name of every span opened.
struct Names(Arc<Mutex<Vec<String>>>);

impl<S: Subscriber> Layer<S> for Names {
    fn on_new_span(&self, attrs: &Attributes<'_>, _id: &Id, _ctx: Context<'_, S>) {
        self.0.lock().unwrap().push(attrs.metadata().name().to_string());
    }
}

#[test]
fn an_installed_subscriber_sees_the_engines_spans() {
    let names = Arc::new(Mutex::new(Vec::new()));
    let subscriber = tracing_subscriber::registry()
        .with(Names(Arc::clone(&names)))
        .with(tracing_subscriber::filter::LevelFilter::TRACE);
    tracing::subscriber::set_global_default(subscriber).unwrap();

    let shape = AttnShape::new(4, 2, 16).unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape, 3000, 7));
    let dir = tempfile::tempdir().unwrap();
    let spill = tempfile::tempdir().unwrap();
    // A small arena with a spill folder: exact plans read blocks back from Disk.
    let buffers = BufferSettings {
        maintainer_idle: None,
        spill_dir: Some(spill.path().to_path_buf()),
        gpu_blocks: 16,
        ..BufferSettings::new(32)
    };
    let config = || EngineConfig { buffers: Some(buffers.clone()), ..EngineConfig::default() };
    let ctx = {
        let engine = Engine::open(dir.path(), config()).unwrap();
        let ctx = engine.create_context(ContextSpec::new(shape, 1)).unwrap();
        let (k, v) = synth.slice(0, 2900);
        engine.prefill(ctx, 0, &k, &v).unwrap();
        let (k, v) = synth.slice(2900, 3000);
        engine.append(ctx, 0, &k, &v).unwrap();
        let plan = engine.plan(&[Request::new(ctx, 0, synth.queries(0))], &Budget::full()).unwrap();
        engine.execute(&plan).unwrap();
        engine.execute_analyze(&plan).unwrap();
        engine.buffer_manager().unwrap().maintain(usize::MAX);
        engine.checkpoint().unwrap();
        ctx
    };
    let engine = Engine::open(dir.path(), config()).unwrap();
    assert_eq!(engine.stats(ctx, 0).unwrap().tokens, 3000);

    let seen = names.lock().unwrap().clone();
    for name in [
        "open",
        "prefill",
        "append",
        "plan",
        "execute",
        "execute_analyze",
        "maintain",
        "read_blocks",
        "checkpoint",
        "wal_group",
    ] {
        assert!(seen.iter().any(|n| n == name), "no {name} span in {seen:?}");
    }
    assert_eq!(seen.iter().filter(|n| *n == "open").count(), 2);
}
