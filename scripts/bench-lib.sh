# Helpers the end-to-end benchmark scripts share (sourced, not run).

# Installs the Debian package $2 unless the command $1 is there.
need() {
    command -v "$1" >/dev/null && return
    echo "==> installing $2 (Debian package)"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$2" >/dev/null
}

# A loopback port nothing listens on.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
