#!/usr/bin/env bash
# Installs what lockstep's build, tests and demo need, and nothing twice.
# Usage: scripts/deps.sh [test|bench]
set -euo pipefail
# protobuf-compiler: raft-rs generates its message types with protoc at build time.
want=(gcc make libc6-dev coreutils python3 strace binutils python3-pymemcache python3-pylibmc libmemcached-tools memcached protobuf-compiler git postmark fio nginx-light redis-server redis-tools libpython3.11-testsuite parallel munge slurmctld slurmd slurm-client)
if [ "${1:-test}" = bench ]; then
    want+=(xz-utils bc bindfs zstd pigz)
fi
# scripts/sei_thirdparty.sh: memcached's source package, its build dependency and a
# deb-src entry for apt-get source (Debian images ship without one).
if [ "${1:-test}" = thirdparty ]; then
    want+=(dpkg-dev libevent-dev)
    src_list=/etc/apt/sources.list.d/lockstep-deb-src.sources
    if ! grep -rqs '^Types:.*deb-src\|^deb-src' /etc/apt/sources.list /etc/apt/sources.list.d/; then
        echo "deps: adding a deb-src entry ($src_list) for apt-get source"
        SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
        codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
        printf '%s\n' 'Types: deb-src' 'URIs: http://deb.debian.org/debian' "Suites: $codename" \
            'Components: main' 'Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg' |
            $SUDO tee "$src_list" >/dev/null
        $SUDO apt-get update -qq
    fi
fi
missing=()
for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "deps: installing ${missing[*]}"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
    # Debian starts memcached on port 11211 when it installs it; the tests start their own,
    # and `lockstep kv` wants that port by default.
    if [[ " ${missing[*]} " == *" memcached "* ]]; then
        $SUDO service memcached stop >/dev/null 2>&1 || true
    fi
    # Likewise nginx on port 80: the tests start their own master in the foreground.
    if [[ " ${missing[*]} " == *" nginx-light "* ]]; then
        $SUDO service nginx stop >/dev/null 2>&1 || true
    fi
    if [[ " ${missing[*]} " == *" redis-server "* ]]; then
        $SUDO service redis-server stop >/dev/null 2>&1 || true
    fi
    # The Slurm test starts its own munged, slurmctld and slurmd (own key, socket, ports).
    for service in slurmctld slurmd munge; do
        if [[ " ${missing[*]} " == *" $service "* ]]; then
            $SUDO service $service stop >/dev/null 2>&1 || true
        fi
    done
fi
if ! command -v cargo >/dev/null 2>&1; then
    if [ -x "$HOME/.cargo/bin/cargo" ]; then
        echo "deps: cargo is in ~/.cargo/bin; add it to PATH"
    else
        echo "deps: cargo not found; install Rust with rustup" >&2
        exit 1
    fi
fi
# `make test` checks the dependency graph with cargo-deny (deny.toml) and builds with the
# minimum Rust the workspace declares (rust-version in Cargo.toml).
if [ "${1:-test}" = test ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
    if ! cargo deny --version 2>/dev/null | grep -q '^cargo-deny 0\.20\.'; then
        echo "deps: installing cargo-deny 0.20.2 (about 2 minutes)"
        cargo install cargo-deny --version 0.20.2 --locked --quiet
    fi
    msrv=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' "$(dirname "$0")/../Cargo.toml")
    if ! rustup run "$msrv" rustc --version >/dev/null 2>&1; then
        echo "deps: installing Rust $msrv (the declared rust-version)"
        rustup toolchain install "$msrv" --profile minimal >/dev/null
    fi
fi
# The bench scripts draw their charts with matplotlib (bench/charts.py), for whichever
# python3 runs them (Debian's package serves only the system interpreter).
if [ "${1:-test}" = bench ] && ! python3 -c 'import matplotlib' 2>/dev/null; then
    echo "deps: installing matplotlib for $(command -v python3)"
    python3 -m pip install --quiet matplotlib 2>/dev/null ||
        { SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo; DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-matplotlib >/dev/null; }
fi
