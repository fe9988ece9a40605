//! attnstore: a storage engine for the attention KV cache of long-context LLM inference.
//!
//! The KV cache is treated as a database: contexts are stored per layer in an access method
//! (the wave index by default, PQCache's product quantization, or none), a decode step asks for attention with [`Request`]s, the
//! planner turns them into a [`Plan`] of zones (steady / retrieve / estimate) that
//! [`Plan::explain`] prints, and [`Engine::execute`] runs it. [`Engine::open`] makes the
//! engine durable: KV goes to checksummed data files, a write-ahead log with group commit
//! makes each batch visible, checkpoints write a manifest, and reopening recovers.

#![deny(unsafe_code)]

mod analyze;
mod budget;
mod buffers;
mod catalog;
mod config;
mod context;
pub mod durable;
mod engine;
mod error;
mod exec;
mod explain;
#[cfg(feature = "cuda")]
mod gpu;
#[cfg(feature = "cuda")]
mod gpu_io;
#[cfg(feature = "cuda")]
mod gpu_prefill;
mod metrics;
mod plan;
pub mod remote;
mod spec;

pub use analyze::{Analysis, PlannedRows};
pub use attnstore_buffer::{BlockLayout, BlockLocation, BufferStats, ReplacerKind, Tier, TierStats};
pub use attnstore_index::{BuildReport, IndexStats, PqLayout, PqParams, SelectionMode, WaveParams};
pub use attnstore_kernels::{AttnShape, Codec, CodecOverrides, DType, HackParams, KeyLayout, Kv43Params, LayerCodecs};
pub use budget::{Budget, EstimateShare};
pub use buffers::BufferSettings;
pub use config::EngineConfig;
pub use context::ContextId;
pub use durable::{CheckReport, DurableConfig, IndexRebuild, RecoveryReport, StoredBatch};
pub use engine::{AppendTicket, Engine};
pub use error::{Error, ErrorKind, Result};
pub use exec::{execute_head, RequestActual, ZoneActual};
#[cfg(feature = "cuda")]
pub use gpu::GpuRun;
#[cfg(feature = "cuda")]
pub use gpu_io::{DeviceRequest, IoDType};
pub use plan::{DeviceSelection, Plan, PlanCost, Request, RequestPlan, Strategy};
pub use spec::{ContextSpec, LayerKind, Method};
