//! attnstore's remote tier on Redis (and Valkey, which speaks its protocol): a
//! [`RemoteStore`] over one server or a Redis Cluster, through the `redis` crate's blocking
//! client. Every call is pipelined, bounded by [`RedisConfig::timeout`], and reconnects by
//! itself after a failure (a restarted server is picked up by the next call). The engine
//! owns the keys and checks every value (`attnstore::remote`); this crate only moves bytes.
//! [`testing`] starts real servers on loopback ports for tests and benchmarks.

pub mod testing;

use attnstore::remote::{RemoteError, RemoteErrorKind, RemoteStore};
use parking_lot::Mutex;
use redis::cluster::{ClusterClient, ClusterConnection};
use std::time::Duration;

/// Settings of a [`RedisStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedisConfig {
    /// Bound of connecting, and of each read and write of a call.
    pub timeout: Duration,
    /// Commands per pipeline (a call with more keys sends several).
    pub max_values_per_pipeline: usize,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self { timeout: Duration::from_secs(2), max_values_per_pipeline: 64 }
    }
}

enum Client {
    Single(redis::Client),
    Cluster(ClusterClient),
}

enum Connection {
    Single(redis::Connection),
    Cluster(Box<ClusterConnection>),
}

/// A [`RemoteStore`] on one Redis server or a Redis Cluster.
pub struct RedisStore {
    client: Client,
    config: RedisConfig,
    /// The connection, made on first use and after a failure dropped it.
    conn: Mutex<Option<Connection>>,
    describe: String,
}

/// The kind of a redis error: timeouts, then anything that means the connection is gone,
/// then what the server said.
fn error(e: &redis::RedisError) -> RemoteError {
    let kind = if e.is_timeout() {
        RemoteErrorKind::Timeout
    } else if e.is_connection_refusal() || e.is_connection_dropped() || e.is_io_error() {
        RemoteErrorKind::Connection
    } else {
        RemoteErrorKind::Server
    };
    RemoteError::new(kind, e.to_string())
}

impl RedisStore {
    /// Connects to `url`: `redis://HOST:PORT` for one server, or several such addresses
    /// separated by commas (optionally after `cluster:`) for the seeds of a Redis Cluster.
    /// The first connection is made now, so a wrong address or a server that is down is
    /// an error here.
    pub fn connect(url: &str, config: RedisConfig) -> Result<Self, RemoteError> {
        if config.timeout.is_zero() || config.max_values_per_pipeline == 0 {
            return Err(RemoteError::new(
                RemoteErrorKind::Server,
                "the timeout and the values per pipeline must be positive",
            ));
        }
        let bad = |e: redis::RedisError| RemoteError::new(RemoteErrorKind::Server, format!("{url}: {e}"));
        let explicit = url.strip_prefix("cluster:");
        let seeds: Vec<&str> = explicit.unwrap_or(url).split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
        let (client, describe) = if explicit.is_some() || seeds.len() > 1 {
            let c = ClusterClient::builder(seeds.clone())
                .connection_timeout(config.timeout)
                .response_timeout(config.timeout)
                .retries(3)
                .max_retry_wait(config.timeout.as_millis().min(500) as u64)
                .build()
                .map_err(bad)?;
            (Client::Cluster(c), format!("redis cluster (seeds {})", seeds.join(", ")))
        } else {
            let single = seeds.first().copied().unwrap_or(url);
            (Client::Single(redis::Client::open(single).map_err(bad)?), format!("redis {single}"))
        };
        let store = Self { client, config, conn: Mutex::new(None), describe };
        *store.conn.lock() = Some(store.open()?);
        Ok(store)
    }

    fn open(&self) -> Result<Connection, RemoteError> {
        let t = Some(self.config.timeout);
        match &self.client {
            Client::Single(c) => {
                let con = c.get_connection_with_timeout(self.config.timeout).map_err(|e| error(&e))?;
                con.set_read_timeout(t).map_err(|e| error(&e))?;
                con.set_write_timeout(t).map_err(|e| error(&e))?;
                Ok(Connection::Single(con))
            }
            Client::Cluster(c) => Ok(Connection::Cluster(Box::new(c.get_connection().map_err(|e| error(&e))?))),
        }
    }

    /// Runs `command` with each of `args`' items appended to it (one pipeline per
    /// [`RedisConfig::max_values_per_pipeline`]) and returns the replies in order. A
    /// failure drops the connection; the next call makes a new one.
    fn pipelined<A, T>(
        &self,
        command: &str,
        args: &[A],
        add: impl Fn(&mut redis::Cmd, &A),
    ) -> Result<Vec<T>, RemoteError>
    where
        T: redis::FromRedisValue,
    {
        let mut guard = self.conn.lock();
        let mut out = Vec::with_capacity(args.len());
        for part in args.chunks(self.config.max_values_per_pipeline) {
            if guard.is_none() {
                *guard = Some(self.open()?);
            }
            let con = guard.as_mut().expect("connected above");
            let commands = part.iter().map(|a| {
                let mut cmd = redis::cmd(command);
                add(&mut cmd, a);
                cmd
            });
            let replies: redis::RedisResult<Vec<T>> = match con {
                Connection::Single(c) => {
                    let mut p = redis::pipe();
                    for cmd in commands {
                        p.add_command(cmd);
                    }
                    p.query(c)
                }
                Connection::Cluster(c) => {
                    let mut p = redis::cluster::cluster_pipe();
                    for cmd in commands {
                        p.add_command(cmd);
                    }
                    p.query(c)
                }
            };
            match replies {
                Ok(r) if r.len() == part.len() => out.extend(r),
                Ok(r) => {
                    return Err(RemoteError::new(
                        RemoteErrorKind::Server,
                        format!("{} replies to a pipeline of {}", r.len(), part.len()),
                    ))
                }
                Err(e) => {
                    let e = error(&e);
                    if e.kind != RemoteErrorKind::Server {
                        *guard = None;
                    }
                    return Err(e);
                }
            }
        }
        Ok(out)
    }
}

impl RemoteStore for RedisStore {
    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>, RemoteError> {
        self.pipelined("GET", keys, |c, k| {
            c.arg(k);
        })
    }

    fn exists_many(&self, keys: &[String]) -> Result<Vec<bool>, RemoteError> {
        let n: Vec<i64> = self.pipelined("EXISTS", keys, |c, k| {
            c.arg(k);
        })?;
        Ok(n.into_iter().map(|n| n > 0).collect())
    }

    fn set_many(&self, entries: &[(String, Vec<u8>)]) -> Result<(), RemoteError> {
        let _: Vec<redis::Value> = self.pipelined("SET", entries, |c, (k, v)| {
            c.arg(k).arg(v.as_slice());
        })?;
        Ok(())
    }
}
