//! Run with: cargo run --release -p hierarchical-throttle-suite --example fleet
//!
//! A fleet of three axum hosts on three loopback ports, throttled by one limit shared through
//! one Redis (from `REDIS_URL`, or a redis-server this example starts on a free port). A load
//! above the limit runs for a few seconds; the example prints, per host and in total, what was
//! admitted against what the limit allows, and how many Redis calls it took.

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use hierarchical_throttle::global::redis::RedisGlobalStore;
use hierarchical_throttle::{HierarchicalThrottleLayer, Limit, key};
use http::Request;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

const HOSTS: usize = 3;
const RATE: u64 = 200;
const LOAD: Duration = Duration::from_secs(5);
const CLIENTS_PER_HOST: [usize; HOSTS] = [8, 4, 2];

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let (url, _redis) = redis_url().await?;
    println!("redis: {url}; limit: {RATE} per second, burst {RATE}, for key `tenant-1`");
    let limit = Limit::per_second(RATE).burst(RATE)?;

    let mut layers = Vec::new();
    let mut addresses = Vec::new();
    for _ in 0..HOSTS {
        // Each host has its own connection, as separate processes would.
        let store: RedisGlobalStore<String> = RedisGlobalStore::connect(&url).await?;
        let layer = HierarchicalThrottleLayer::builder()
            .key_ref(|req: &Request<Body>| key::header_str(req, "x-api-key"))
            .limit(limit)
            .global_store(store)
            .build()?;
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        addresses.push(listener.local_addr()?);
        tokio::spawn(async move { axum::serve(listener, app).await });
        layers.push(layer);
    }

    let served: Vec<_> = (0..HOSTS).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let refused: Vec<_> = (0..HOSTS).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let start = Instant::now();
    let mut clients = Vec::new();
    for (host, &count) in CLIENTS_PER_HOST.iter().enumerate() {
        for _ in 0..count {
            let (addr, served, refused) =
                (addresses[host], served[host].clone(), refused[host].clone());
            clients.push(tokio::spawn(async move {
                let mut conn = TcpStream::connect(addr).await?;
                while start.elapsed() < LOAD {
                    match get_status(&mut conn, addr).await? {
                        200 => served.fetch_add(1, Ordering::Relaxed),
                        _ => refused.fetch_add(1, Ordering::Relaxed),
                    };
                }
                Ok::<_, Error>(())
            }));
        }
    }
    for client in clients {
        client.await??;
    }
    let elapsed = start.elapsed();

    let allowed = RATE + (RATE as f64 * elapsed.as_secs_f64()) as u64;
    let (mut total_served, mut total_requests, mut total_calls) = (0, 0, 0);
    println!("\nhost  address           requests   admitted  refused  redis calls");
    for host in 0..HOSTS {
        let (s, r) = (
            served[host].load(Ordering::Relaxed),
            refused[host].load(Ordering::Relaxed),
        );
        let calls = layers[host].stats().global_calls;
        println!(
            "{host:>4}  {:<16}  {:>8}  {s:>9}  {r:>7}  {calls:>11}",
            addresses[host],
            s + r
        );
        (total_served, total_requests, total_calls) = (
            total_served + s,
            total_requests + s + r,
            total_calls + calls,
        );
    }
    println!(
        "\ntotal: {total_requests} requests in {elapsed:.1?}; admitted {total_served} of {allowed} allowed \
         ({:.1}%); {total_calls} redis calls ({:.1} per 1000 requests)",
        100.0 * total_served as f64 / allowed as f64,
        1000.0 * total_calls as f64 / total_requests as f64
    );
    Ok(())
}

/// One keep-alive GET; returns the status code.
async fn get_status(conn: &mut TcpStream, addr: SocketAddr) -> Result<u16, Error> {
    let request = format!("GET / HTTP/1.1\r\nhost: {addr}\r\nx-api-key: tenant-1\r\n\r\n");
    conn.write_all(request.as_bytes()).await?;
    let mut reader = BufReader::new(conn);
    let mut line = String::new();
    reader.read_line(&mut line).await?;
    let status = line
        .split_whitespace()
        .nth(1)
        .ok_or("no status line")?
        .parse()?;
    let mut length = 0;
    loop {
        line.clear();
        reader.read_line(&mut line).await?;
        if line == "\r\n" || line.is_empty() {
            break;
        }
        if let Some(value) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            length = value.trim().parse()?;
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).await?;
    Ok(status)
}

/// `REDIS_URL`, or a redis-server started here on a free port (stopped when dropped).
async fn redis_url() -> Result<(String, Option<tokio::process::Child>), Error> {
    if let Ok(url) = std::env::var("REDIS_URL") {
        return Ok((url, None));
    }
    let port = TcpListener::bind("127.0.0.1:0").await?.local_addr()?.port();
    let mut child = tokio::process::Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--logfile",
            "",
        ])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("set REDIS_URL or install redis-server: {e}"))?;
    let mut log = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
    while let Some(line) = log.next_line().await? {
        if line.contains("Ready to accept connections") {
            tokio::spawn(async move { while let Ok(Some(_)) = log.next_line().await {} });
            return Ok((format!("redis://127.0.0.1:{port}"), Some(child)));
        }
    }
    Err("redis-server exited before it was ready".into())
}
