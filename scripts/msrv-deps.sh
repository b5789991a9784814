#!/usr/bin/env bash
# The part of the MSRV (rust-version in Cargo.toml) this machine can check without a
# second toolchain: no crate a workspace member builds with declares a rust-version above
# that member's. The
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
packages = {p["id"]: p for p in meta["packages"]}
members = [packages[i] for i in meta["workspace_members"]]
edges = {
    n["id"]: [
        d["pkg"]
        for d in n["deps"]
        if any(k.get("kind") != "dev" for k in d["dep_kinds"])
    ]
    for n in meta["resolve"]["nodes"]
}
# Each member against its own rust-version, over what it builds with (normal and build
# dependencies, transitively): powerflex-grid and the root package (the test bed) need a newer Rust than the
# rest because openleadr-client/-wire do; that must not raise the others.
above = set()
for member in members:
    if not member.get("rust_version"):
        continue
    msrv = version(member["rust_version"])
    seen, todo = set(), list(edges.get(member["id"], []))
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo.extend(edges.get(pid, []))
        p = packages[pid]
        if p.get("rust_version") and version(p["rust_version"]) > msrv:
            above.add((member["name"], member["rust_version"], p["name"], p["version"], p["rust_version"]))
for m, mv, name, ver, rv in sorted(above):
    print(f"{name} {ver} needs Rust {rv}, above {m}'"'"'s rust-version {mv}", file=sys.stderr)
if above:
    sys.exit(1)
shown = ", ".join(sorted(f"{m['"'"'name'"'"']} {m['"'"'rust_version'"'"']}" for m in members if m.get("rust_version")))
print(f"every locked crate builds on the rust-version of each member that uses it ({shown})", file=sys.stderr)
'
