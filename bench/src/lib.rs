//! attnstore-bench: the measuring side of attnstore, kept out of the engine library so that
//! the engine depends on neither progress bars nor JSON. The `attnstore` command's `bench`,
//! `inspect` and `bench-wal` runs live here, with what they share: seeded synthetic KV with
//! the structure of real post-RoPE attention ([`synth`]), the memory a synthetic run needs
//! ([`memory`]) and bench rows printed as a table and as JSON lines ([`report`]). Every
//! figure is measured against a baseline in the same run (`docs/bench.md`). The runs use
//! the engine's public API only.
//!
//! ```
//! use attnstore_bench::{SynthContext, SynthParams};
//! use attnstore::{AttnShape, Budget, ContextSpec, Engine, EngineConfig, Request};
//!
//! let shape = AttnShape::new(4, 2, 16).unwrap();
//! let synth = SynthContext::generate(SynthParams::new(shape, 1000, 7));
//! let engine = Engine::in_memory(EngineConfig::default()).unwrap();
//! let ctx = engine.create_context(ContextSpec::new(shape, 1)).unwrap();
//! engine.prefill(ctx, 0, &synth.keys, &synth.values).unwrap();
//! let plan = engine.plan(&[Request::new(ctx, 0, synth.queries(0))], &Budget::full()).unwrap();
//! assert_eq!(engine.execute(&plan).unwrap()[0].len(), shape.query_len());
//! ```

pub mod decode;
mod error;
pub mod inspect;
pub mod memory;
pub mod plot;
pub mod report;
pub mod synth;
pub mod wal;

pub use decode::{BenchConfig, BenchMethod};
pub use error::{Error, Result};
pub use inspect::{blocks_for_codec, blocks_for_context, InspectConfig, InspectReport};
pub use report::{table, Row};
pub use synth::{SynthContext, SynthParams};
pub use wal::WalBenchConfig;
