#!/usr/bin/env bash
# The whole suite, from a fresh machine: installs what is missing (redis-server), then checks
# formatting and lints, runs every test (unit, integration, doc, benches in test mode) and
# builds the examples.
set -euo pipefail
cd "$(dirname "$0")/.."

# What the tests need beyond Rust: redis-server and redis-cli (real servers, a cluster, a
# sentinel), OpenSSL's headers for the `tls` feature, and the openssl tool that makes the TLS
# test's certificates.
install_missing() {
    local missing=()
    command -v redis-server >/dev/null || missing+=(redis-server)
    command -v redis-cli >/dev/null || missing+=(redis-tools)
    command -v openssl >/dev/null || missing+=(openssl)
    command -v pkg-config >/dev/null || missing+=(pkg-config)
    pkg-config --exists openssl 2>/dev/null || missing+=(libssl-dev)
    [ ${#missing[@]} -eq 0 ] && return
    echo "==> installing ${missing[*]} (Debian packages)"
    if ! command -v apt-get >/dev/null; then
        echo "missing ${missing[*]} and apt-get is not available: install them (Redis 6.2+) and retry" >&2
        exit 1
    fi
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

install_missing
# The tests start their own servers on free loopback ports; none is needed running.
redis-server --version

echo "==> cargo fmt --check"
cargo fmt --all -- --check

echo "==> cargo clippy (all targets, all features)"
cargo clippy --workspace --all-targets --all-features -- -D warnings

echo "==> cargo test (all targets, all features)"
cargo test --workspace --all-targets --all-features

echo "==> the fleet simulation in release (2,000 seeds; the debug run above has 60)"
cargo test --release --all-features -p hierarchical-throttle-suite --test simulation

echo "==> cargo test --doc"
cargo test --doc --all-features

echo "==> cargo doc (warnings are errors: every public item documented, every link resolves)"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --all-features -p hierarchical-throttle
