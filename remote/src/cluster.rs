//! Redis Cluster routing: which master serves each key (the slot map, from `CLUSTER
//! SLOTS`), one pipeline per master per round, and the redirections a moving cluster
//! answers with (`MOVED`, `ASK`). Every node's pipeline is written before any reply is read,
//! and all of a round's reads share one deadline, so a stalled master costs the timeout
//! once per call, not once per key (the `redis` crate's own cluster pipeline waits per key).

use crate::node::{pack, Addr, Node};
use attnstore::remote::{RemoteError, RemoteErrorKind};
use redis::{ConnectionAddr, ConnectionInfo, ServerErrorKind, Value};
use std::collections::HashMap;
use std::time::Instant;

/// Hash slots of a Redis Cluster.
const SLOTS: usize = 16384;

/// Rounds of redirections followed within one pipeline before giving up (a slot that
/// keeps moving).
const REDIRECT_ROUNDS: usize = 3;

/// CRC16-CCITT (XMODEM), the key hash of the Redis Cluster specification.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc
}

/// The slot of `key`: only its hash tag (the part between the first `{` and the next `}`)
/// counts when it has a non-empty one.
pub(crate) fn key_slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        rest.iter().position(|&b| b == b'}').filter(|&len| len > 0).map(|len| &rest[..len])
    });
    crc16(tagged.unwrap_or(key)) % SLOTS as u16
}

/// Which master serves each slot, and every node the cluster named (where to ask again).
#[derive(Debug)]
struct SlotMap {
    masters: Vec<Addr>,
    /// Index into `masters` per slot; [`SlotMap::NONE`] where no master serves it.
    owner: Vec<u16>,
    /// Masters and replicas, masters first.
    nodes: Vec<Addr>,
}

impl SlotMap {
    const NONE: u16 = u16::MAX;

    /// Reads a `CLUSTER SLOTS` reply from `queried`: `[[start, end, [host, port, id, ..],
    /// replicas..], ..]`. An empty or unknown (`?`) host is the queried node's.
    fn parse(reply: &Value, queried: &Addr) -> Result<Self, String> {
        let Value::Array(ranges) = reply else { return Err(format!("not an array: {reply:?}")) };
        let mut map = Self { masters: Vec::new(), owner: vec![Self::NONE; SLOTS], nodes: Vec::new() };
        let mut replicas = Vec::new();
        for range in ranges {
            let bad = || format!("bad slot range {range:?}");
            let Value::Array(items) = range else { return Err(bad()) };
            let (Some(Value::Int(start)), Some(Value::Int(end))) = (items.first(), items.get(1)) else {
                return Err(bad());
            };
            let (start, end) = (*start, *end);
            if start < 0 || start > end || end >= SLOTS as i64 || items.len() < 3 {
                return Err(bad());
            }
            let master = node_addr(&items[2], queried).ok_or_else(bad)?;
            let index = match map.masters.iter().position(|m| *m == master) {
                Some(i) => i,
                None => {
                    map.masters.push(master);
                    map.masters.len() - 1
                }
            };
            map.owner[start as usize..=end as usize].fill(index as u16);
            replicas.extend(items[3..].iter().filter_map(|r| node_addr(r, queried)));
        }
        map.nodes = map.masters.clone();
        for r in replicas {
            if !map.nodes.contains(&r) {
                map.nodes.push(r);
            }
        }
        Ok(map)
    }

    fn master(&self, slot: u16) -> Option<&Addr> {
        self.masters.get(usize::from(self.owner[usize::from(slot)]))
    }
}

/// `[host, port, ..]` of a `CLUSTER SLOTS` node entry.
fn node_addr(entry: &Value, queried: &Addr) -> Option<Addr> {
    let Value::Array(fields) = entry else { return None };
    let host = match fields.first()? {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok()?,
        Value::SimpleString(s) => s.clone(),
        Value::Nil => String::new(),
        _ => return None,
    };
    let port = match fields.get(1)? {
        Value::Int(p) => u16::try_from(*p).ok()?,
        _ => return None,
    };
    let host = if host.is_empty() || host == "?" { queried.host.clone() } else { host };
    Some(Addr { host, port })
}

/// Where a command goes again: a `MOVED` (the slot's new master) or an `ASK` (one
/// command, preceded by `ASKING`, while the slot migrates).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Redirect {
    addr: Addr,
    asking: bool,
}

/// The redirection `reply` (from `from`) asks for, if it is one that can be followed.
fn redirect(reply: &Value, from: &Addr) -> Option<Redirect> {
    let Value::ServerError(e) = reply else { return None };
    let asking = match e.kind()? {
        ServerErrorKind::Moved => false,
        ServerErrorKind::Ask => true,
        _ => return None,
    };
    let mut words = e.details()?.split_ascii_whitespace();
    words.next()?.parse::<u16>().ok().filter(|&slot| usize::from(slot) < SLOTS)?;
    let (host, port) = words.next()?.rsplit_once(':')?;
    let host = if host.is_empty() || host == "?" { from.host.clone() } else { host.to_owned() };
    Some(Redirect { addr: Addr { host, port: port.parse().ok()? }, asking })
}

/// Whether `reply` says the cluster's layout is changing (the slot map may be stale).
fn unsettled(reply: &Value) -> bool {
    matches!(reply, Value::ServerError(e) if matches!(e.kind(),
        Some(ServerErrorKind::ClusterDown | ServerErrorKind::TryAgain | ServerErrorKind::MasterDown)))
}

/// The commands of one round bound for one node.
struct Pipeline {
    addr: Addr,
    /// The commands in the wire format.
    packed: Vec<u8>,
    /// Per command: its index in the call, and whether `ASKING` precedes it.
    commands: Vec<(usize, bool)>,
}

/// The connections to a Redis Cluster: the slot map, and one connection per node used.
pub(crate) struct Cluster {
    /// The addresses given; the first one's settings (user, password) serve every node.
    seeds: Vec<ConnectionInfo>,
    map: Option<SlotMap>,
    /// Whether `map` is to be read again before the next round.
    stale: bool,
    nodes: HashMap<Addr, Node>,
}

impl Cluster {
    /// A cluster reached through `seeds` (TCP addresses, at least one); nothing connected.
    pub fn new(seeds: Vec<ConnectionInfo>) -> Self {
        Self { seeds, map: None, stale: true, nodes: HashMap::new() }
    }

    /// The connection to `addr`, made now if there is none.
    fn node(&mut self, addr: &Addr, deadline: Instant) -> Result<&mut Node, RemoteError> {
        use std::collections::hash_map::Entry;
        match self.nodes.entry(addr.clone()) {
            Entry::Occupied(o) => Ok(o.into_mut()),
            Entry::Vacant(v) => {
                let info = self.seeds[0].clone().set_addr(ConnectionAddr::Tcp(addr.host.clone(), addr.port));
                Ok(v.insert(Node::connect(&info, deadline)?))
            }
        }
    }

    /// Drops every connection and reads the slot map again before the next round: after a
    /// failed exchange nothing is known of what the nodes still have to send.
    pub fn forget(&mut self) {
        self.nodes.clear();
        self.stale = true;
    }

    /// Reads the slot map from the first node that answers: nodes connected now, then the
    /// nodes the last map named, then the seeds.
    pub fn refresh(&mut self, deadline: Instant) -> Result<(), RemoteError> {
        let mut candidates: Vec<Addr> = self.nodes.keys().cloned().collect();
        candidates.extend(self.map.iter().flat_map(|m| m.nodes.iter().cloned()));
        candidates.extend(self.seeds.iter().filter_map(Addr::of));
        let mut tried = Vec::new();
        let mut last = None;
        for addr in candidates {
            if tried.contains(&addr) {
                continue;
            }
            tried.push(addr.clone());
            match self.ask_slots(&addr, deadline) {
                Ok(map) => {
                    self.map = Some(map);
                    self.stale = false;
                    return Ok(());
                }
                Err(e) => last = Some(e),
            }
        }
        let last = last.unwrap_or_else(|| RemoteError::new(RemoteErrorKind::Connection, "no seed address"));
        let names: Vec<String> = tried.iter().map(Addr::to_string).collect();
        Err(RemoteError::new(
            last.kind,
            format!("no cluster node gave its slot map (tried {}): {}", names.join(", "), last.message),
        ))
    }

    fn ask_slots(&mut self, addr: &Addr, deadline: Instant) -> Result<SlotMap, RemoteError> {
        let mut packed = Vec::new();
        pack(&[b"CLUSTER", b"SLOTS"], &mut packed);
        let reply = self.node(addr, deadline)?.exchange(&packed, 1, deadline);
        let reply = match reply {
            Ok(mut r) => r.remove(0),
            Err(e) => {
                self.nodes.remove(addr);
                return Err(e);
            }
        };
        if let Value::ServerError(e) = &reply {
            return Err(RemoteError::new(RemoteErrorKind::Server, format!("{addr}: CLUSTER SLOTS: {e}")));
        }
        let map = SlotMap::parse(&reply, addr)
            .map_err(|m| RemoteError::new(RemoteErrorKind::Server, format!("{addr}: CLUSTER SLOTS: {m}")))?;
        if map.masters.is_empty() {
            return Err(RemoteError::new(RemoteErrorKind::Server, format!("{addr}: no slot is assigned")));
        }
        Ok(map)
    }

    /// Runs one pipeline: command `i` (written by `write(i, ..)`) is about `keys[i]` and
    /// goes to the master of its slot; redirections are followed; everything before
    /// `deadline`. The replies in order (error replies are values). On an error every
    /// connection is dropped (the next call connects again).
    pub fn run(
        &mut self,
        keys: &[&[u8]],
        write: &dyn Fn(usize, &mut Vec<u8>),
        deadline: Instant,
    ) -> Result<Vec<Value>, RemoteError> {
        let out = self.rounds(keys, write, deadline);
        if out.is_err() {
            self.forget();
        }
        out
    }

    fn rounds(
        &mut self,
        keys: &[&[u8]],
        write: &dyn Fn(usize, &mut Vec<u8>),
        deadline: Instant,
    ) -> Result<Vec<Value>, RemoteError> {
        let mut replies = vec![Value::Nil; keys.len()];
        let mut todo: Vec<(usize, Option<Redirect>)> = (0..keys.len()).map(|i| (i, None)).collect();
        for _ in 0..REDIRECT_ROUNDS {
            if todo.is_empty() {
                return Ok(replies);
            }
            if self.stale || self.map.is_none() {
                self.refresh(deadline)?;
            }
            let map = self.map.as_ref().expect("refreshed above");
            let mut pipelines: Vec<Pipeline> = Vec::new();
            for (i, to) in todo.drain(..) {
                let (addr, asking) = match to {
                    Some(r) => (r.addr, r.asking),
                    None => {
                        let slot = key_slot(keys[i]);
                        let master = map.master(slot).ok_or_else(|| {
                            RemoteError::new(
                                RemoteErrorKind::Server,
                                format!("slot {slot} is served by no master (cluster down?)"),
                            )
                        })?;
                        (master.clone(), false)
                    }
                };
                let p = match pipelines.iter().position(|p| p.addr == addr) {
                    Some(p) => p,
                    None => {
                        pipelines.push(Pipeline { addr, packed: Vec::new(), commands: Vec::new() });
                        pipelines.len() - 1
                    }
                };
                let p = &mut pipelines[p];
                if asking {
                    pack(&[b"ASKING"], &mut p.packed);
                }
                write(i, &mut p.packed);
                p.commands.push((i, asking));
            }
            // Every pipeline goes out before any reply is read: the masters work at once.
            for p in &pipelines {
                self.node(&p.addr, deadline)?.send(&p.packed, deadline)?;
            }
            for Pipeline { addr, commands, .. } in &pipelines {
                let node = self.nodes.get_mut(addr).expect("connected when its pipeline was sent");
                for &(i, asking) in commands {
                    if asking {
                        if let Value::ServerError(e) = node.recv(deadline)? {
                            return Err(RemoteError::new(RemoteErrorKind::Server, format!("{addr}: ASKING: {e}")));
                        }
                    }
                    let reply = node.recv(deadline)?;
                    if let Some(r) = redirect(&reply, addr) {
                        // A slot moved: the next round reads the whole map again (more
                        // slots than this one moved with it, as after a failover).
                        self.stale |= !r.asking;
                        todo.push((i, Some(r)));
                    } else {
                        self.stale |= unsettled(&reply);
                        replies[i] = reply;
                    }
                }
            }
        }
        if todo.is_empty() {
            return Ok(replies);
        }
        Err(RemoteError::new(
            RemoteErrorKind::Server,
            format!("{} keys still redirected after {REDIRECT_ROUNDS} rounds (slots moving?)", todo.len()),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(host: &str, port: u16) -> Addr {
        Addr { host: host.into(), port }
    }

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn key_slots_follow_the_cluster_specification() {
        // The specification's CRC16 check value, and slots redis-cli reports.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"bar"), 5061);
        // Only a non-empty hash tag counts.
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") % 16384);
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
    }

    #[test]
    fn cluster_slots_replies_become_a_slot_map() {
        let queried = addr("10.0.0.1", 7000);
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                Value::Array(vec![bulk("10.0.0.1"), Value::Int(7000), bulk("id1")]),
                Value::Array(vec![bulk("10.0.0.4"), Value::Int(7003), bulk("id4")]),
            ]),
            Value::Array(vec![
                Value::Int(5461),
                Value::Int(16383),
                Value::Array(vec![bulk(""), Value::Int(7001), bulk("id2")]),
            ]),
        ]);
        let map = SlotMap::parse(&reply, &queried).unwrap();
        assert_eq!(map.master(0), Some(&addr("10.0.0.1", 7000)));
        assert_eq!(map.master(5460), Some(&addr("10.0.0.1", 7000)));
        assert_eq!(map.master(5461), Some(&addr("10.0.0.1", 7001)), "an empty host is the queried node's");
        assert_eq!(map.nodes.len(), 3);
        assert!(
            SlotMap::parse(&Value::Array(vec![Value::Array(vec![Value::Int(5), Value::Int(2)])]), &queried).is_err()
        );
        assert!(SlotMap::parse(&Value::Int(3), &queried).is_err());
    }

    #[test]
    fn slots_without_a_master_are_none() {
        let reply = Value::Array(vec![Value::Array(vec![
            Value::Int(0),
            Value::Int(99),
            Value::Array(vec![bulk("h"), Value::Int(1)]),
        ])]);
        let map = SlotMap::parse(&reply, &addr("h", 1)).unwrap();
        assert_eq!(map.master(99), Some(&addr("h", 1)));
        assert!(map.master(100).is_none());
    }

    #[test]
    fn moved_and_ask_replies_are_redirections() {
        let from = addr("10.0.0.1", 7000);
        let parse = |text: &str| redis::parse_redis_value(text.as_bytes()).unwrap();
        let moved = redirect(&parse("-MOVED 3999 10.0.0.2:6381\r\n"), &from).unwrap();
        assert_eq!(moved, Redirect { addr: addr("10.0.0.2", 6381), asking: false });
        let ask = redirect(&parse("-ASK 3999 :6381\r\n"), &from).unwrap();
        assert_eq!(ask, Redirect { addr: addr("10.0.0.1", 6381), asking: true });
        assert!(redirect(&parse("-MOVED nonsense\r\n"), &from).is_none());
        assert!(redirect(&parse("-ERR wrong\r\n"), &from).is_none());
        assert!(unsettled(&parse("-CLUSTERDOWN The cluster is down\r\n")));
        assert!(!unsettled(&parse("-OOM no\r\n")));
    }
}
