//! Run with: cargo run --release -p hierarchical-throttle-bench --example delay_proxy -- LISTEN_PORT TARGET DELAY_US
//!
//! A TCP proxy that puts a store a network hop away: every chunk of bytes, in each direction,
//! is forwarded `DELAY_US` microseconds after it arrived (1,000 by default: a round trip of
//! about 2 ms on top of the target's own), in order, without limiting throughput (chunks in
//! flight overlap, as on a real link). For `scripts/bench-e2e-zipf.sh`, in front of Redis.
//!
//! Plain threads and the operating system's sleep: a runtime's timer would round each delay up
//! to its millisecond tick. A connection costs four threads; a store client keeps a few.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

type Error = Box<dyn std::error::Error + Send + Sync>;

fn main() -> Result<(), Error> {
    let mut args = std::env::args().skip(1);
    let port: u16 = args.next().ok_or("LISTEN_PORT")?.parse()?;
    let target = args.next().ok_or("TARGET")?;
    let delay = Duration::from_micros(args.next().map_or(Ok(1_000), |d| d.parse())?);
    let listener = TcpListener::bind(("127.0.0.1", port))?;
    println!(
        "delaying {target} by {delay:?} each way on {}",
        listener.local_addr()?
    );
    for client in listener.incoming() {
        let Ok(client) = client else { continue };
        let Ok(server) = TcpStream::connect(&target) else {
            continue;
        };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let (Ok(client_out), Ok(server_out)) = (client.try_clone(), server.try_clone()) else {
            continue;
        };
        pump(client, server_out, delay);
        pump(server, client_out, delay);
    }
    Ok(())
}

/// Forwards what `from` reads to `to`, each chunk `delay` after it was read: a reading thread
/// stamps the chunks, a writing thread sends each when due.
fn pump(mut from: TcpStream, mut to: TcpStream, delay: Duration) {
    let (chunks, due) = mpsc::channel::<(Instant, Vec<u8>)>();
    thread::spawn(move || {
        for (at, chunk) in due {
            if let Some(wait) = at.checked_duration_since(Instant::now()) {
                thread::sleep(wait);
            }
            if to.write_all(&chunk).is_err() {
                return;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
    thread::spawn(move || {
        let mut buffer = vec![0u8; 64 * 1024];
        while let Ok(n) = from.read(&mut buffer) {
            if n == 0
                || chunks
                    .send((Instant::now() + delay, buffer[..n].to_vec()))
                    .is_err()
            {
                break;
            }
        }
    });
}
