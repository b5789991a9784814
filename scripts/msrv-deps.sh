#!/usr/bin/env bash
# The part of the MSRV (rust-version in Cargo.toml) this machine can check without a
# second toolchain: no crate in Cargo.lock declares a rust-version above ours. The
# resolver ("3", MSRV-aware) keeps it so on `cargo update`; this catches a lock file
# merged from elsewhere. (clippy's incompatible_msrv lint, part of `clippy -D warnings`,
# checks our own use of the standard library against the same rust-version.)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo metadata --format-version 1 --locked | python3 -c '
import json, sys

def version(text):
    parts = [int(p) for p in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))

meta = json.load(sys.stdin)
ours = {p["id"]: p for p in meta["packages"] if p["id"] in meta["workspace_members"]}
msrv = min(version(p["rust_version"]) for p in ours.values() if p.get("rust_version"))
resolved = {n["id"] for n in meta["resolve"]["nodes"]}
above = sorted(
    (p["name"], p["version"], p["rust_version"])
    for p in meta["packages"]
    if p["id"] in resolved and p.get("rust_version") and version(p["rust_version"]) > msrv
)
shown = ".".join(map(str, msrv))
for name, ver, rv in above:
    print(f"{name} {ver} needs Rust {rv}, above the workspace rust-version {shown}", file=sys.stderr)
if above:
    sys.exit(1)
print(f"every locked crate builds on Rust {shown} by its own rust-version", file=sys.stderr)
'
