#!/usr/bin/env bash
# The whole suite, from a fresh machine: installs what is missing (redis-server), then checks
# formatting and lints, runs every test (unit, integration, doc, benches in test mode) and
# builds the examples.
set -euo pipefail
cd "$(dirname "$0")/.."

install_redis() {
    if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then
        return
    fi
    echo "==> installing redis-server (Debian package)"
    if ! command -v apt-get >/dev/null; then
        echo "redis-server is missing and apt-get is not available: install Redis 6.2+ and retry" >&2
        exit 1
    fi
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server redis-tools >/dev/null
}

install_redis
# The tests start their own servers on free loopback ports; none is needed running.
redis-server --version

echo "==> cargo fmt --check"
cargo fmt --all -- --check

echo "==> cargo clippy (all targets, all features)"
cargo clippy --workspace --all-targets --all-features -- -D warnings

echo "==> cargo test (all targets, all features)"
cargo test --workspace --all-targets --all-features

echo "==> cargo test --doc"
cargo test --doc --all-features

echo "==> cargo doc (warnings are errors: every public item documented, every link resolves)"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --all-features -p hierarchical-throttle
