//! Real redis-server processes for tests, on free loopback ports, in the target's temp dir.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A redis-server this test started; killed when dropped.
pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
    cluster: bool,
    /// The primary this server replicates, if it is a replica.
    replica_of: Option<u16>,
    /// Serves TLS only, with the certificates in its directory.
    tls: bool,
}

fn require(binary: &str) {
    let version = if binary == "openssl" {
        "version"
    } else {
        "--version"
    };
    let found = Command::new(binary)
        .arg(version)
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "`{binary}` is not installed: run ./scripts/test.sh, which installs redis-server, \
         redis-tools and openssl (apt-get), or install it yourself"
    );
}

/// A port free on 127.0.0.1, and for a cluster node also its bus port (+10000).
fn free_port(cluster: bool) -> u16 {
    loop {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
        let port = listener.local_addr().expect("local address").port();
        if port == 6379
            || (cluster
                && (port > 55_000 || TcpListener::bind(("127.0.0.1", port + 10_000)).is_err()))
        {
            continue;
        }
        return port;
    }
}

impl RedisServer {
    pub fn start() -> Self {
        Self::launch(free_port(false), false)
    }

    /// A free loopback port for a server to be started on later.
    pub fn unused_port() -> u16 {
        free_port(false)
    }

    /// A server on `port`.
    pub fn start_on(port: u16) -> Self {
        Self::launch(port, false)
    }

    fn launch(port: u16, cluster: bool) -> Self {
        require("redis-server");
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("redis-{port}"));
        std::fs::create_dir_all(&dir).expect("create the server's directory");
        let mut server = Self {
            child: None,
            port,
            dir,
            cluster,
            replica_of: None,
            tls: false,
        };
        server.spawn();
        server
    }

    /// A server that speaks TLS only, with a certificate for 127.0.0.1 signed by a certificate
    /// authority made for it; returns it and the authority's certificate (PEM).
    pub fn start_tls() -> (Self, Vec<u8>) {
        require("redis-server");
        let port = free_port(false);
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("redis-tls-{port}"));
        std::fs::create_dir_all(&dir).expect("create the server's directory");
        make_certificates(&dir);
        let mut server = Self {
            child: None,
            port,
            dir: dir.clone(),
            cluster: false,
            replica_of: None,
            tls: true,
        };
        server.spawn();
        let ca = std::fs::read(dir.join("ca.crt")).expect("read the authority's certificate");
        (server, ca)
    }

    /// A replica of the server on `primary`, on a free port.
    pub fn start_replica_of(primary: u16) -> Self {
        require("redis-server");
        let port = free_port(false);
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("redis-{port}"));
        std::fs::create_dir_all(&dir).expect("create the server's directory");
        let mut server = Self {
            child: None,
            port,
            dir,
            cluster: false,
            replica_of: Some(primary),
            tls: false,
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let mut cmd = Command::new("redis-server");
        let (port, tls_port) = match self.tls {
            true => ("0".to_owned(), self.port.to_string()),
            false => (self.port.to_string(), "0".to_owned()),
        };
        if self.tls {
            let file = |name: &str| self.dir.join(name).display().to_string();
            cmd.args(["--tls-port", &tls_port])
                .args(["--tls-cert-file", &file("server.crt")])
                .args(["--tls-key-file", &file("server.key")])
                .args(["--tls-ca-cert-file", &file("ca.crt")])
                .args(["--tls-auth-clients", "no"]);
        }
        cmd.args([
            "--port",
            &port,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--logfile", "", "--enable-debug-command", "yes"])
        .arg("--dir")
        .arg(&self.dir);
        if let Some(primary) = self.replica_of {
            cmd.args(["--replicaof", "127.0.0.1", &primary.to_string()]);
        }
        if self.cluster {
            cmd.args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"]);
            cmd.args(["--cluster-config-file", "nodes.conf"]);
            let _ = std::fs::remove_file(self.dir.join("nodes.conf"));
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        // The server says when it listens: read its log until then.
        let what = format!("redis-server on port {}", self.port);
        wait_until_logged(&mut child, "Ready to accept connections", &what);
        self.child = Some(child);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A store on this server, by Redis's own clock.
    pub async fn store(&self) -> hierarchical_throttle::global::redis::RedisGlobalStore<String> {
        hierarchical_throttle::global::redis::RedisGlobalStore::connect(&self.url())
            .await
            .expect("connect to the test's redis-server")
    }

    /// A store on this server whose buckets refill by `clock`, set far from zero first (a
    /// bucket's times are then never negative), for exact fleet tests.
    pub async fn store_on(
        &self,
        clock: &hierarchical_throttle::clock::ManualClock,
    ) -> hierarchical_throttle::global::redis::RedisGlobalStore<String> {
        clock.set(Duration::from_secs(1_000_000));
        hierarchical_throttle::global::redis::RedisGlobalStore::connect(&self.url())
            .await
            .expect("connect to the test's redis-server")
            .with_clock_override(clock.clone())
    }

    /// Kills the server at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("server running").id();
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
    }

    /// Freezes the server (SIGSTOP): it accepts connections and answers nothing.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// Runs a redis-cli command against this server and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        require("redis-cli");
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("run redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A Redis Cluster of three primaries this test started.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> Self {
        let nodes: Vec<_> = (0..3)
            .map(|_| RedisServer::launch(free_port(true), true))
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addresses)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        // The nodes agree on the slot map shortly after creation; wait for it, bounded.
        let deadline = Instant::now() + Duration::from_secs(20);
        while !nodes
            .iter()
            .all(|n| n.cli(&["cluster", "info"]).contains("cluster_state:ok"))
        {
            assert!(
                Instant::now() < deadline,
                "the cluster did not become ready"
            );
            std::thread::yield_now();
        }
        Self { nodes }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }
}

/// A Redis Sentinel this test started, watching one primary as `name` (quorum 1, a primary
/// down after 500 ms); killed when dropped.
pub struct Sentinel {
    child: Child,
    pub port: u16,
}

impl Sentinel {
    pub fn start(name: &str, primary: u16) -> Self {
        require("redis-server");
        let port = free_port(false);
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("sentinel-{port}"));
        std::fs::create_dir_all(&dir).expect("create the sentinel's directory");
        let config = dir.join("sentinel.conf");
        std::fs::write(
            &config,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\n\
                 sentinel monitor {name} 127.0.0.1 {primary} 1\n\
                 sentinel down-after-milliseconds {name} 500\n\
                 sentinel failover-timeout {name} 2000\n",
                dir.display()
            ),
        )
        .expect("write sentinel.conf");
        let mut child = Command::new("redis-server")
            .arg(&config)
            .args(["--sentinel", "--logfile", ""])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server --sentinel");
        let what = format!("redis-server --sentinel on port {port}");
        wait_until_logged(&mut child, "+monitor master", &what);
        Self { child, port }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Runs a redis-cli command against this sentinel and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("run redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads `child`'s log until a line holds `marker` (it is ready), then goes on reading it in
/// the background so that a talkative server never blocks on the pipe; kills it and panics
/// with the log if it exits first.
fn wait_until_logged(child: &mut Child, marker: &str, what: &str) {
    let stdout = child.stdout.take().expect("piped stdout");
    let mut log = String::new();
    let mut lines = BufReader::new(stdout).lines();
    let ready = lines.by_ref().map_while(Result::ok).any(|line| {
        log.push_str(&line);
        log.push('\n');
        line.contains(marker)
    });
    if !ready {
        let _ = child.kill();
        let _ = child.wait();
        panic!("{what} exited before it was ready:\n{log}");
    }
    std::thread::spawn(move || lines.for_each(drop));
}

/// A certificate authority and a server certificate for IP 127.0.0.1 it signed, in `dir`
/// (`ca.crt`, `server.crt`, `server.key`), made with the `openssl` tool.
fn make_certificates(dir: &std::path::Path) {
    require("openssl");
    std::fs::write(dir.join("ext.cnf"), "subjectAltName=IP:127.0.0.1\n").expect("write ext.cnf");
    let steps: [&[&str]; 3] = [
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "1",
            "-subj",
            "/CN=test authority",
        ],
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=127.0.0.1",
        ],
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "1",
            "-extfile",
            "ext.cnf",
        ],
    ];
    for args in steps {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("run openssl");
        assert!(
            out.status.success(),
            "openssl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
