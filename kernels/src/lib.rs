//! attnstore-kernels: the numeric operations of attnstore.
//!
//! One op API with a CPU implementation (f32 accumulation, rayon threads, loops written so
//! LLVM vectorizes them). The CUDA backend joins behind the `cuda` feature. Everything above
//! this crate (indexes, engine) calls these ops and never hand-rolls attention math.

#![deny(unsafe_code)]

pub mod arena_wave;
mod backend;
mod codec;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod element;
mod error;
mod kv43_lists;
pub mod layout;
pub mod random;
mod shape;
mod view;

pub use arena_wave::{ArenaGroups, ArenaWave, GroupSummary, HeadClusters, GROUP_PAGES};
pub use backend::{Backend, BlockRows, CpuBackend};
pub use codec::{Codec, CodecOverrides, LayerCodecs, MAX_CODEC_OVERRIDES};
pub use cpu::hack::{HackParams, KeyLayout};
pub use cpu::hack_rows::{HackArrays, HackRows, HackScratch, HackView};
pub use cpu::kv43::{Kv43Arrays, Kv43Head, Kv43Params, Kv43Rows};
pub use cpu::partial::Partial;
pub use element::{first_non_finite, narrow_vec, DType, Element};
pub use error::{Error, Result};
pub use kv43_lists::{Kv43ClusterTable, Kv43Lists};
pub use shape::AttnShape;
pub use view::HeadsView;
