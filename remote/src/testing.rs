//! Real Redis servers for tests and benchmarks: one server, or a Redis Cluster of masters
//! with replicas, each on free loopback ports in a temporary directory, stopped when
//! dropped. They need Debian's `redis-server` and `redis-tools` (`.ci/run` installs them).

use std::io;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn missing(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("{what} not found: install Debian's redis-server and redis-tools packages (.ci/run does)"),
    )
}

/// Whether `redis-server` and `redis-cli` are installed (tests skip, saying why, when not).
pub fn available() -> bool {
    ["redis-server", "redis-cli"].iter().all(|p| Command::new(p).arg("--version").output().is_ok())
}

/// A free loopback port below 55000 whose cluster bus port (+10000) is free too.
fn free_port() -> io::Result<u16> {
    for _ in 0..200 {
        let l = TcpListener::bind("127.0.0.1:0")?;
        let port = l.local_addr()?.port();
        if port < 55000 && TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return Ok(port);
        }
    }
    Err(io::Error::other("no free loopback port pair found"))
}

/// Runs `redis-cli -p port args...` and returns what it printed.
fn cli(port: u16, args: &[&str]) -> io::Result<String> {
    let out =
        Command::new("redis-cli").args(["-p", &port.to_string()]).args(args).output().map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => missing("redis-cli"),
            _ => e,
        })?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Waits until `check` holds, for up to `limit`.
fn wait_for(limit: Duration, what: &str, mut check: impl FnMut() -> bool) -> io::Result<()> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if check() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(io::Error::new(io::ErrorKind::TimedOut, format!("{what} within {limit:?}")))
}

/// One `redis-server` process on a loopback port; killed when dropped.
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    args: Vec<String>,
    child: Option<Child>,
}

impl RedisServer {
    /// A server without persistence on a free port.
    pub fn start() -> io::Result<Self> {
        Self::start_with(&[])
    }

    /// A server started with `extra` arguments too (e.g. `--maxmemory 1mb`).
    pub fn start_with(extra: &[&str]) -> io::Result<Self> {
        let tmp = tempfile::tempdir()?;
        let dir = tmp.path().to_path_buf();
        let mut s = Self {
            port: free_port()?,
            dir,
            _tmp: Some(tmp),
            args: extra.iter().map(|s| s.to_string()).collect(),
            child: None,
        };
        s.spawn()?;
        Ok(s)
    }

    fn in_dir(dir: &Path, port: u16, extra: Vec<String>) -> Self {
        Self { port, dir: dir.to_path_buf(), _tmp: None, args: extra, child: None }
    }

    fn spawn(&mut self) -> io::Result<()> {
        let port = self.port.to_string();
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                // Tests slow the server down with DEBUG SLEEP (Redis 7 refuses DEBUG otherwise).
                "--enable-debug-command",
                "local",
            ])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| match e.kind() {
                io::ErrorKind::NotFound => missing("redis-server"),
                _ => e,
            })?;
        self.child = Some(child);
        let port = self.port;
        wait_for(Duration::from_secs(10), "redis-server answering PING", || {
            TcpStream::connect(("127.0.0.1", port)).is_ok() && cli(port, &["PING"]).is_ok_and(|r| r.trim() == "PONG")
        })
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Kills the server (its data is gone: nothing is persisted).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again, empty, on the same port.
    pub fn restart(&mut self) -> io::Result<()> {
        self.stop();
        self.spawn()
    }

    /// Runs `redis-cli` against it (e.g. `["DEBUG", "SLEEP", "3"]`) and returns its output.
    pub fn cli(&self, args: &[&str]) -> io::Result<String> {
        cli(self.port, args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A Redis Cluster of masters with replicas on loopback ports; stopped when dropped.
pub struct RedisCluster {
    _tmp: tempfile::TempDir,
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// `masters` masters with `replicas` replicas each, slots assigned, `cluster_state:ok`.
    pub fn start(masters: usize, replicas: usize) -> io::Result<Self> {
        let tmp = tempfile::tempdir()?;
        let mut nodes = Vec::new();
        for i in 0..masters * (1 + replicas) {
            let dir = tmp.path().join(format!("node{i}"));
            std::fs::create_dir_all(&dir)?;
            let extra =
                ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1500"];
            let mut node = RedisServer::in_dir(&dir, free_port()?, extra.iter().map(|s| s.to_string()).collect());
            node.spawn()?;
            nodes.push(node);
        }
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&out.stdout)
            )));
        }
        let c = Self { _tmp: tmp, nodes };
        c.wait_ok()?;
        Ok(c)
    }

    /// Waits until every running node says `cluster_state:ok` and knows `masters` masters
    /// with slots.
    fn wait_ok(&self) -> io::Result<()> {
        wait_for(Duration::from_secs(30), "cluster_state:ok on every node", || {
            self.nodes
                .iter()
                .filter(|n| n.child.is_some())
                .all(|n| n.cli(&["CLUSTER", "INFO"]).is_ok_and(|i| i.contains("cluster_state:ok")))
        })
    }

    /// The seeds as a `--remote` URL (every node, comma-separated).
    pub fn url(&self) -> String {
        self.nodes.iter().map(RedisServer::url).collect::<Vec<_>>().join(",")
    }

    /// Ports of the nodes that are masters now.
    pub fn master_ports(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some() && n.cli(&["ROLE"]).is_ok_and(|r| r.starts_with("master")))
            .map(|n| n.port)
            .collect()
    }

    /// Runs `redis-cli` against node `port` of the cluster (`-c`: follows redirections).
    pub fn cli(&self, port: u16, args: &[&str]) -> io::Result<String> {
        let mut all = vec!["-c"];
        all.extend_from_slice(args);
        cli(port, &all)
    }

    /// Kills the master on `port` and waits until one of its replicas is promoted and the
    /// cluster is `ok` again.
    pub fn kill_master_and_wait_failover(&mut self, port: u16) -> io::Result<()> {
        let before = self.master_ports().len();
        let node = self.nodes.iter_mut().find(|n| n.port == port).ok_or_else(|| io::Error::other("no such node"))?;
        node.stop();
        wait_for(Duration::from_secs(30), "a replica promoted", || {
            self.master_ports().len() == before && !self.master_ports().contains(&port)
        })?;
        self.wait_ok()
    }
}
