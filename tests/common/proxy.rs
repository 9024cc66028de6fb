//! A TCP proxy on a free loopback port that adds faults between hosts and a real Redis: latency
//! on every chunk, stalls (nothing forwarded), and dropped connections.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the proxy does to the traffic now.
#[derive(Debug, Default)]
struct Faults {
    latency_micros: AtomicU64,
    stalled: AtomicBool,
    /// Bumped to drop every open connection.
    generation: AtomicU64,
}

/// The proxy; stops accepting when dropped.
pub struct FaultProxy {
    pub port: u16,
    faults: Arc<Faults>,
    accept: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Forwards a free loopback port to `upstream_port`.
    pub async fn start(upstream_port: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let faults = Arc::new(Faults::default());
        let shared = faults.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let faults = shared.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(("127.0.0.1", upstream_port)).await {
                        relay(client, server, faults).await;
                    }
                });
            }
        });
        Self {
            port,
            faults,
            accept,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Every chunk, each way, waits `latency` before it is forwarded.
    pub fn latency(&self, latency: Duration) {
        self.faults
            .latency_micros
            .store(latency.as_micros() as u64, Ordering::SeqCst);
    }

    /// Nothing is forwarded while stalled (connections stay open).
    pub fn stall(&self, stalled: bool) {
        self.faults.stalled.store(stalled, Ordering::SeqCst);
    }

    /// Closes every open connection.
    pub fn drop_connections(&self) {
        self.faults.generation.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn relay(client: TcpStream, server: TcpStream, faults: Arc<Faults>) {
    let generation = faults.generation.load(Ordering::SeqCst);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::select! {
        _ = pump(client_read, server_write, &faults, generation) => {}
        _ = pump(server_read, client_write, &faults, generation) => {}
    }
}

async fn pump(
    mut from: impl AsyncReadExt + Unpin,
    mut to: impl AsyncWriteExt + Unpin,
    faults: &Faults,
    generation: u64,
) {
    let mut buf = vec![0u8; 16 * 1024];
    let alive = || faults.generation.load(Ordering::SeqCst) == generation;
    loop {
        let read = tokio::select! {
            read = from.read(&mut buf) => read,
            _ = until_dropped(faults, generation) => return,
        };
        let n = match read {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let latency = Duration::from_micros(faults.latency_micros.load(Ordering::SeqCst));
        tokio::time::sleep(latency).await;
        while faults.stalled.load(Ordering::SeqCst) && alive() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if !alive() || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Resolves once the connections of `generation` are to be dropped.
async fn until_dropped(faults: &Faults, generation: u64) {
    while faults.generation.load(Ordering::SeqCst) == generation {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}
