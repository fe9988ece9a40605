//! One connection to one Redis server, and the only place that waits on the network: every
//! connect, write and read takes the deadline of the pipeline it belongs to, so a stalled
//! server costs at most that bound. How `redis` failures become [`RemoteError`]s is here
//! too: an exchange that failed leaves its connection in an unknown state, and the caller
//! drops it.

use attnstore::remote::{RemoteError, RemoteErrorKind};
use redis::{ConnectionAddr, ConnectionInfo, Value};
use std::fmt;
use std::time::{Duration, Instant};

/// A server's address (`host:port`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Addr {
    pub host: String,
    pub port: u16,
}

impl fmt::Display for Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

impl Addr {
    /// The address `info` connects to; `None` for a Unix socket (not a cluster node).
    pub fn of(info: &ConnectionInfo) -> Option<Self> {
        match info.addr() {
            ConnectionAddr::Tcp(host, port) => Some(Self { host: host.clone(), port: *port }),
            _ => None,
        }
    }
}

/// The error of a failed `redis` operation: timeouts first, then anything that means the
/// connection is gone, then the rest (protocol errors, refused authentication).
pub(crate) fn failure(what: &str, e: &redis::RedisError) -> RemoteError {
    let kind = if e.is_timeout() {
        RemoteErrorKind::Timeout
    } else if e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() {
        RemoteErrorKind::Connection
    } else {
        RemoteErrorKind::Server
    };
    RemoteError::new(kind, format!("{what}: {e}"))
}

/// Time left before `deadline`, or a timeout error naming `what` was waited for.
fn left(deadline: Instant, what: &dyn fmt::Display) -> Result<Duration, RemoteError> {
    let now = Instant::now();
    if now >= deadline {
        return Err(RemoteError::new(RemoteErrorKind::Timeout, format!("{what}: no answer within the timeout")));
    }
    Ok(deadline - now)
}

/// An open connection to one server.
pub(crate) struct Node {
    con: redis::Connection,
    /// What error messages call it (`host:port`).
    name: String,
}

impl Node {
    /// Connects to `info` (TCP connect and handshake) before `deadline`.
    pub fn connect(info: &ConnectionInfo, deadline: Instant) -> Result<Self, RemoteError> {
        let name = Addr::of(info).map_or_else(|| format!("{:?}", info.addr()), |a| a.to_string());
        let client = redis::Client::open(info.clone()).map_err(|e| failure(&name, &e))?;
        let con = client.get_connection_with_timeout(left(deadline, &name)?).map_err(|e| failure(&name, &e))?;
        Ok(Self { con, name })
    }

    /// Writes `packed` (commands in the wire format, [`pack`]) before `deadline`.
    pub fn send(&mut self, packed: &[u8], deadline: Instant) -> Result<(), RemoteError> {
        let wait = left(deadline, &self.name)?;
        self.con.set_write_timeout(Some(wait)).map_err(|e| failure(&self.name, &e))?;
        self.con.send_packed_command(packed).map_err(|e| failure(&self.name, &e))
    }

    /// Reads the next reply before `deadline`. An error reply is a value
    /// ([`Value::ServerError`]), not an error: the connection is still in step.
    pub fn recv(&mut self, deadline: Instant) -> Result<Value, RemoteError> {
        // The socket's timeout bounds each read of the reply; setting it to what is left
        // before every reply keeps a pipeline of many replies within one deadline.
        let wait = left(deadline, &self.name)?;
        self.con.set_read_timeout(Some(wait)).map_err(|e| failure(&self.name, &e))?;
        self.con.recv_response().map_err(|e| failure(&self.name, &e))
    }

    /// Sends `packed`, the last of the commands whose `replies` replies it then reads, all
    /// before `deadline` (`packed` may be empty: every command was sent already).
    pub fn exchange(&mut self, packed: &[u8], replies: usize, deadline: Instant) -> Result<Vec<Value>, RemoteError> {
        if !packed.is_empty() {
            self.send(packed, deadline)?;
        }
        (0..replies).map(|_| self.recv(deadline)).collect()
    }
}

/// Appends the command made of `parts` to `out` in the wire format (RESP: an array of
/// bulk strings), so that values go from the caller's buffer to the socket's with one copy.
pub(crate) fn pack(parts: &[&[u8]], out: &mut Vec<u8>) {
    out.extend_from_slice(format!("*{}\r\n", parts.len()).as_bytes());
    for p in parts {
        out.extend_from_slice(format!("${}\r\n", p.len()).as_bytes());
        out.extend_from_slice(p);
        out.extend_from_slice(b"\r\n");
    }
}

/// A reply for an error message: its debug form, cut short (a value may be megabytes).
pub(crate) fn show(v: &Value) -> String {
    let mut s = format!("{v:?}");
    if s.len() > 80 {
        let cut = (0..=80).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
        s.truncate(cut);
        s.push('…');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_writes_an_array_of_bulk_strings() {
        let mut out = Vec::new();
        pack(&[b"SET", b"k", b""], &mut out);
        assert_eq!(out, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n");
    }

    #[test]
    fn a_passed_deadline_is_a_timeout() {
        let e = left(Instant::now() - Duration::from_millis(1), &"x").unwrap_err();
        assert_eq!(e.kind, RemoteErrorKind::Timeout);
    }

    #[test]
    fn long_replies_are_cut_in_messages() {
        let s = show(&Value::BulkString(vec![b'a'; 10_000]));
        assert!(s.chars().count() <= 81, "{s}");
    }
}
