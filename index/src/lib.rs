//! attnstore-index: access methods over one layer's KV.
//!
//! An access method stores the KV of every KV head of one layer, chooses for a query which
//! tokens are attended exactly, which are estimated and which are dropped (a [`HeadPlan`]),
//! and computes the partials of such a plan. [`WaveIndex`] is RetroInfer's segmented cluster
//! index; [`PqIndex`] is PQCache's product-quantization index; [`FlatIndex`] keeps tokens in arrival order and answers exactly or by an exact
//! top-k (the oracle the approximate methods are measured against).

#![deny(unsafe_code)]

mod blocks;
mod directory;
mod encoded;
mod error;
mod flat;
mod method;
mod pq;
mod segment;
mod wave;
mod window;

pub use blocks::{blocks_per_tier, BlockStore};
pub use directory::Directory;
pub use encoded::{EncodedHead, EncodedHome, EncodedSegment, SteadyHead};
pub use error::{Error, Result};
pub use flat::FlatIndex;
pub use method::{
    AccessMethod, ArenaLayer, GpuHackGroup, GpuHackWork, GpuHeadWork, HeadPlan, IndexLayout, IndexStats, RowSpan,
    Selection, SelectionMode, SteadyRows, ZoneBudget,
};
pub use pq::{
    BuildHandle, BuildReport, BuildShape, IterationChoice, IterationModel, PackedCodes, PqIndex, PqLayout, PqParams,
    PqSnapshot,
};
pub use wave::{HeadLayout, SegmentLayout, WaveIndex, WaveLayout, WaveParams};
pub use window::WindowIndex;
