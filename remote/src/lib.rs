//! attnstore's remote tier on Redis (and Valkey, which speaks its protocol): a
//! [`RemoteStore`](attnstore::remote::RemoteStore) over one server or a Redis Cluster,
//! through the `redis` crate's blocking connections. The engine owns the keys and checks
//! every value (`attnstore::remote`); this crate only moves bytes: pipelined, every
//! pipeline bounded by [`RedisConfig::timeout`], reconnecting by itself after a failure.
//!
//! - `store.rs`: [`RedisStore`], the addresses it takes, and what each reply means;
//! - `cluster.rs`: which master serves each key, one pipeline per master, redirections;
//! - `node.rs`: one connection, and the deadlines every network wait takes;
//! - [`testing`]: real servers and clusters on loopback ports, for tests and benches.
//!
//! ```
//! use attnstore::remote::RemoteStore;
//! use attnstore_remote::{testing::RedisServer, RedisConfig, RedisStore};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # if !attnstore_remote::testing::available() { return Ok(()); }
//! let server = RedisServer::start()?;
//! let store = RedisStore::connect(&server.url(), RedisConfig::default())?;
//! store.set_many(&[("k".into(), b"v".to_vec())])?;
//! assert_eq!(store.get_many(&["k".into(), "absent".into()])?, vec![Some(b"v".to_vec()), None]);
//! assert_eq!(store.describe(), format!("redis 127.0.0.1:{}", server.port()));
//! # Ok(())
//! # }
//! ```

mod cluster;
mod node;
mod store;
pub mod testing;

pub use store::{RedisConfig, RedisStore};
