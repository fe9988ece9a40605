//! attnstore-index: access methods over one layer's KV.
//!
//! An access method stores the KV of every KV head of one layer, chooses for a query which
//! tokens are attended exactly, which are estimated and which are dropped (a [`HeadPlan`]),
//! and names the rows such a plan reads ([`HeadRows`]); the engine's executor reads them and
//! computes the partials. Rows an index does not keep itself go to a [`RowHome`] the engine
//! provides: this crate knows vectors, not tiers. [`WaveIndex`] is RetroInfer's segmented cluster
//! index; [`PqIndex`] is PQCache's product-quantization index; [`FlatIndex`] keeps tokens in arrival order and answers exactly or by an exact
//! top-k (the oracle the approximate methods are measured against).

#![deny(unsafe_code)]

mod build;
mod codec;
mod directory;
mod encoded;
mod error;
mod flat;
mod home;
mod kv43_pieces;
mod method;
mod pq;
mod rows;
mod segment;
mod wave;
mod window;

pub use build::{BuildHandle, BuildReport};
pub use codec::{EncodedRows, RowCodec};
pub use directory::Directory;
pub use encoded::{EncodedHead, EncodedHome, EncodedSegment, SteadyHead};
pub use error::{Error, Result};
pub use flat::FlatIndex;
pub use home::{HomeError, RowHome};
pub use method::{
    AccessMethod, Clustered, HeadPlan, IndexLayout, IndexStats, RowSource, RowSpan, RowStorage, Selection,
    SelectionMode, Snapshots, SteadyRows, ZoneBudget,
};
pub use pq::{BuildShape, IterationChoice, IterationModel, PackedCodes, PqIndex, PqLayout, PqParams, PqSnapshot};
pub use rows::{EstimateZone, HeadRows, HomedClusters, HomedGroups, PlainRows, Run, SelectionRows};
pub use wave::{HeadLayout, SegmentLayout, WaveIndex, WaveLayout, WaveParams};
pub use window::WindowIndex;
