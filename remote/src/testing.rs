//! Test support (compiled always, so benches and other crates' tests can use it): real
//! Redis servers, one or a Redis Cluster of masters with replicas, each on free loopback
//! ports in a temporary directory, stopped when dropped; tests may run in parallel. They
//! need Debian's `redis-server` and `redis-tools` (`.ci/run` installs them).

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
        let mut s = Self::in_dir(tmp.path(), 0, extra.iter().map(|s| s.to_string()).collect());
        s._tmp = Some(tmp);
        s.spawn_on_free_port()?;
        Ok(s)
    }

    fn in_dir(dir: &Path, port: u16, extra: Vec<String>) -> Self {
        Self { port, dir: dir.to_path_buf(), _tmp: None, args: extra, child: None }
    }

    /// Starts the server on a free port; tries a few, as a port found free may be taken
    /// by another test before the server binds it.
    fn spawn_on_free_port(&mut self) -> io::Result<()> {
        let mut last = None;
        for _ in 0..5 {
            self.port = free_port()?;
            match self.spawn() {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(e),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("tried at least once"))
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
                "--logfile",
                "redis.log",
                // Tests slow the server down with DEBUG SLEEP (Redis 7 refuses DEBUG otherwise).
                "--enable-debug-command",
                "local",
            ])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.args)
            .current_dir(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| match e.kind() {
                io::ErrorKind::NotFound => missing("redis-server"),
                _ => e,
            })?;
        let pid = format!("process_id:{}", child.id());
        let child = self.child.insert(child);
        // Ready when the server on the port is this process (another test's server may
        // have taken the port first: then this one exits).
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if let Some(status) = child.try_wait()? {
                self.child = None;
                let log = std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(3).collect();
                return Err(io::Error::other(format!(
                    "redis-server on port {port} exited ({status}): {}",
                    tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
                )));
            }
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok()
                && cli(self.port, &["INFO", "server"]).is_ok_and(|r| r.lines().any(|l| l.trim() == pid))
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.stop();
        Err(io::Error::new(io::ErrorKind::TimedOut, format!("redis-server on port {port} did not answer within 10 s")))
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether the server runs (it was not stopped).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Kills the server (its data is gone: nothing is persisted); its directory stays.
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
    // Declared first, so dropped first: the servers stop before their directories go.
    nodes: Vec<RedisServer>,
    _tmp: tempfile::TempDir,
}

impl RedisCluster {
    /// `masters` masters with `replicas` replicas each (node timeout 1.5 s, so a killed
    /// master fails over within a few seconds), slots assigned, `cluster_state:ok`.
    pub fn start(masters: usize, replicas: usize) -> io::Result<Self> {
        Self::start_with(masters, replicas, &[])
    }

    /// A cluster whose nodes are started with `extra` arguments too (later ones win: e.g.
    /// `--cluster-node-timeout 10000` for a master that sleeps without failing over).
    pub fn start_with(masters: usize, replicas: usize, extra: &[&str]) -> io::Result<Self> {
        let tmp = tempfile::tempdir()?;
        let mut nodes = Vec::new();
        for i in 0..masters * (1 + replicas) {
            let dir = tmp.path().join(format!("node{i}"));
            std::fs::create_dir_all(&dir)?;
            let cluster = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout"];
            let args = cluster.iter().chain(&["1500"]).chain(extra).map(|s| s.to_string()).collect();
            let mut node = RedisServer::in_dir(&dir, 0, args);
            node.spawn_on_free_port()?;
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
        let c = Self { nodes, _tmp: tmp };
        c.wait_ok()?;
        Ok(c)
    }

    /// Waits until every running node says `cluster_state:ok`.
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

    /// Every node, masters and replicas, stopped ones too.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
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

    /// Waits until every master's replicas have received all it wrote (`WAIT` from
    /// `redis-cli` cannot tell: it waits for the writes of its own connection only).
    pub fn wait_replicated(&self) -> io::Result<()> {
        let field = |info: &str, name: &str| -> Option<u64> {
            info.lines().find_map(|l| l.trim().strip_prefix(name)).and_then(|v| v.parse().ok())
        };
        wait_for(Duration::from_secs(10), "replicas caught up with their masters", || {
            self.master_ports().into_iter().all(|port| {
                let Ok(info) = cli(port, &["INFO", "replication"]) else { return false };
                let Some(offset) = field(&info, "master_repl_offset:") else { return false };
                let replicas: Vec<&str> = info.lines().filter(|l| l.starts_with("slave")).collect();
                !replicas.is_empty()
                    && replicas.iter().all(|l| {
                        l.split(',').any(|kv| kv.strip_prefix("offset=").and_then(|v| v.parse().ok()) == Some(offset))
                    })
            })
        })
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
