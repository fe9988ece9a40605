//! [`RedisStore`]: the engine's [`RemoteStore`] on one Redis server or a Redis Cluster.
//! Keys go out in pipelines of [`RedisConfig::max_values_per_pipeline`] commands (`GET`,
//! `EXISTS`, `SET`), each bounded by [`RedisConfig::timeout`]; replies are checked here,
//! so a reply of the wrong kind is an error, never a panic or a wrong value.

use crate::cluster::Cluster;
use crate::node::{pack, show, Addr, Node};
use attnstore::remote::{RemoteError, RemoteErrorKind, RemoteStore};
use parking_lot::Mutex;
use redis::{ConnectionInfo, IntoConnectionInfo, Value};
use std::time::{Duration, Instant};

/// Settings of a [`RedisStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedisConfig {
    /// Bound of each pipeline: connecting (when a connection is needed), writing the
    /// commands and reading every reply. A call of more commands than one pipeline holds
    /// waits at most this long per pipeline.
    pub timeout: Duration,
    /// Commands per pipeline (a call with more keys sends several, one after the other).
    pub max_values_per_pipeline: usize,
}

impl Default for RedisConfig {
    /// 2 s per pipeline, 64 commands per pipeline.
    fn default() -> Self {
        Self { timeout: Duration::from_secs(2), max_values_per_pipeline: 64 }
    }
}

/// The store's connections.
enum Link {
    /// One server; `None` after a failure (the next call connects again).
    Single { info: ConnectionInfo, node: Option<Node> },
    /// A cluster's nodes (it drops them itself after a failure).
    Cluster(Cluster),
}

/// A [`RemoteStore`] on one Redis server or a Redis Cluster, over the `redis` crate's
/// blocking connections.
///
/// Every pipeline finishes within [`RedisConfig::timeout`] or fails with
/// [`RemoteErrorKind::Timeout`]; a server that cannot be reached, or whose connection
/// broke, is [`RemoteErrorKind::Connection`]; a refusal (out of memory, a value of another
/// type, a cluster that is down) or an unexpected reply is [`RemoteErrorKind::Server`]. A
/// failed exchange drops its connections and a later call makes new ones, so a restarted
/// server or a failed-over cluster is picked up by itself. Calls from several threads take
/// turns on the connections.
pub struct RedisStore {
    config: RedisConfig,
    link: Mutex<Link>,
    describe: String,
}

fn refused(message: String) -> RemoteError {
    RemoteError::new(RemoteErrorKind::Server, message)
}

/// The addresses in `url` and whether they are a cluster's seeds (see [`RedisStore::connect`]).
fn parse_url(url: &str) -> Result<(bool, Vec<ConnectionInfo>), RemoteError> {
    let explicit = url.trim().strip_prefix("cluster:");
    let seeds: Vec<&str> = explicit.unwrap_or(url).split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    if seeds.is_empty() {
        return Err(refused(format!("{url:?}: no address (expected redis://HOST:PORT)")));
    }
    let infos = seeds
        .iter()
        .map(|s| {
            let full = if s.contains("://") { (*s).to_owned() } else { format!("redis://{s}") };
            full.as_str().into_connection_info().map_err(|e| refused(format!("{s:?}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let cluster = explicit.is_some() || infos.len() > 1;
    if cluster {
        if let Some(s) = seeds.iter().zip(&infos).find(|(_, i)| Addr::of(i).is_none()) {
            return Err(refused(format!("{:?}: a cluster seed must be a TCP address (redis://HOST:PORT)", s.0)));
        }
    }
    Ok((cluster, infos))
}

impl RedisStore {
    /// Connects to `url`, which is one of
    /// - `redis://HOST:PORT` — one server (any URL the `redis` crate takes, e.g. with
    ///   `user:password@` or a database `/N`);
    /// - `redis://HOST:PORT,redis://HOST:PORT,...` — seeds of a Redis Cluster (any of its
    ///   nodes; the client learns the rest from them);
    /// - `cluster:redis://HOST:PORT[,...]` — the same, also with a single seed.
    ///
    /// The scheme may be left out (`127.0.0.1:7000,127.0.0.1:7001`). A cluster's nodes are
    /// reached with the first seed's user and password. The first connection (for a
    /// cluster: its slot map) is made now, so a wrong address or a server that is down is
    /// an error here.
    pub fn connect(url: &str, config: RedisConfig) -> Result<Self, RemoteError> {
        if config.timeout.is_zero() || config.max_values_per_pipeline == 0 {
            return Err(refused(format!(
                "timeout {:?} and max_values_per_pipeline {} must be positive",
                config.timeout, config.max_values_per_pipeline
            )));
        }
        let (cluster, infos) = parse_url(url)?;
        let deadline = Instant::now() + config.timeout;
        let name = |i: &ConnectionInfo| Addr::of(i).map_or_else(|| format!("{:?}", i.addr()), |a| a.to_string());
        let (link, describe) = if cluster {
            let names: Vec<String> = infos.iter().map(name).collect();
            let mut c = Cluster::new(infos);
            c.refresh(deadline)?;
            (Link::Cluster(c), format!("redis cluster (seeds: {})", names.join(", ")))
        } else {
            let info = infos.into_iter().next().expect("parse_url returns at least one address");
            let node = Node::connect(&info, deadline)?;
            let describe = format!("redis {}", name(&info));
            (Link::Single { info, node: Some(node) }, describe)
        };
        Ok(Self { config, link: Mutex::new(link), describe })
    }

    /// The store's settings.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// Sends command `i` (about `keys[i]`, written by `write(i, ..)`) for every key, in
    /// pipelines, and returns the replies in order. Error replies are values: the caller
    /// decides what they mean.
    fn call(&self, keys: &[&[u8]], write: impl Fn(usize, &mut Vec<u8>)) -> Result<Vec<Value>, RemoteError> {
        let mut link = self.link.lock();
        let mut out = Vec::with_capacity(keys.len());
        let per = self.config.max_values_per_pipeline;
        for (n, part) in keys.chunks(per).enumerate() {
            let deadline = Instant::now() + self.config.timeout;
            let write_part = |i: usize, buf: &mut Vec<u8>| write(n * per + i, buf);
            let replies = match &mut *link {
                Link::Single { info, node } => {
                    let replies = exchange(info, node, part.len(), &write_part, deadline);
                    if replies.is_err() {
                        // What the server still has to send is unknown: start afresh.
                        *node = None;
                    }
                    replies?
                }
                Link::Cluster(c) => c.run(part, &write_part, deadline)?,
            };
            out.extend(replies);
        }
        Ok(out)
    }
}

/// Bytes of packed commands written to the socket at a time: a pipeline of megabyte values
/// goes out through one small buffer (no copy of the whole pipeline, no page faults of a
/// fresh one per call) while the server reads it.
const SEND_BUFFER: usize = 1 << 20;

/// One pipeline of `count` commands to a single server, connecting first if needed. The
/// commands are written as they are packed, then every reply is read (replies of
/// commands already written wait in the socket's buffer meanwhile).
fn exchange(
    info: &ConnectionInfo,
    node: &mut Option<Node>,
    count: usize,
    write: &dyn Fn(usize, &mut Vec<u8>),
    deadline: Instant,
) -> Result<Vec<Value>, RemoteError> {
    if node.is_none() {
        *node = Some(Node::connect(info, deadline)?);
    }
    let node = node.as_mut().expect("connected above");
    let mut packed = Vec::with_capacity(SEND_BUFFER);
    for i in 0..count {
        write(i, &mut packed);
        if packed.len() >= SEND_BUFFER {
            node.send(&packed, deadline)?;
            packed.clear();
        }
    }
    node.exchange(&packed, count, deadline)
}

/// The error for `reply` to `command` on `key`: a refusal or a reply of the wrong kind.
fn unexpected(command: &str, key: &str, reply: &Value) -> RemoteError {
    match reply {
        Value::ServerError(e) => refused(format!("{command} {key}: {e}")),
        other => refused(format!("{command} {key}: unexpected reply {}", show(other))),
    }
}

impl RemoteStore for RedisStore {
    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>, RemoteError> {
        let bytes: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let replies = self.call(&bytes, |i, buf| pack(&[b"GET", bytes[i]], buf))?;
        replies
            .into_iter()
            .zip(keys)
            .map(|(reply, key)| match reply {
                Value::Nil => Ok(None),
                Value::BulkString(v) => Ok(Some(v)),
                other => Err(unexpected("GET", key, &other)),
            })
            .collect()
    }

    fn exists_many(&self, keys: &[String]) -> Result<Vec<bool>, RemoteError> {
        let bytes: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let replies = self.call(&bytes, |i, buf| pack(&[b"EXISTS", bytes[i]], buf))?;
        replies
            .into_iter()
            .zip(keys)
            .map(|(reply, key)| match reply {
                Value::Int(n) if n >= 0 => Ok(n > 0),
                other => Err(unexpected("EXISTS", key, &other)),
            })
            .collect()
    }

    fn set_many(&self, entries: &[(String, Vec<u8>)]) -> Result<(), RemoteError> {
        let bytes: Vec<&[u8]> = entries.iter().map(|(k, _)| k.as_bytes()).collect();
        let replies = self.call(&bytes, |i, buf| pack(&[b"SET", bytes[i], &entries[i].1], buf))?;
        for (reply, (key, _)) in replies.iter().zip(entries) {
            match reply {
                Value::Okay => {}
                Value::SimpleString(s) if s == "OK" => {}
                other => return Err(unexpected("SET", key, other)),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_address_is_a_server_and_several_or_a_prefix_are_a_cluster() {
        let (cluster, infos) = parse_url("redis://127.0.0.1:6379").unwrap();
        assert!(!cluster);
        assert_eq!(Addr::of(&infos[0]).unwrap().to_string(), "127.0.0.1:6379");
        let (cluster, infos) = parse_url("redis://10.0.0.1:7000, 10.0.0.2:7001,").unwrap();
        assert!(cluster);
        assert_eq!(infos.len(), 2);
        assert_eq!(Addr::of(&infos[1]).unwrap().to_string(), "10.0.0.2:7001");
        let (cluster, infos) = parse_url("cluster:redis://10.0.0.1:7000").unwrap();
        assert!(cluster && infos.len() == 1);
        assert!(parse_url("").is_err());
        assert!(parse_url("cluster:").is_err());
        assert!(parse_url("http://x:1").is_err());
    }

    #[test]
    fn bad_settings_and_addresses_fail_at_connect() {
        let zero = RedisConfig { timeout: Duration::ZERO, ..RedisConfig::default() };
        assert_eq!(RedisStore::connect("redis://127.0.0.1:1", zero).err().unwrap().kind, RemoteErrorKind::Server);
        let e = RedisStore::connect("redis://127.0.0.1:1", RedisConfig::default()).err().unwrap();
        assert_eq!(e.kind, RemoteErrorKind::Connection, "{e}");
        let e = RedisStore::connect("127.0.0.1:1,127.0.0.1:2", RedisConfig::default()).err().unwrap();
        assert_eq!(e.kind, RemoteErrorKind::Connection, "{e}");
    }

    #[test]
    fn the_store_is_shared_between_threads() {
        fn shared<T: Send + Sync>() {}
        shared::<RedisStore>();
    }
}
