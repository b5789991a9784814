//! Tells the whole-system tests in `tests/` where cargo puts the workspace's binaries.
//!
//! The end-to-end tests drive `powerflexctl` (and, as they land, the daemons and the
//! SPANK plugin) as real processes. Those artifacts belong to other packages, so
//! `CARGO_BIN_EXE_*` does not name them; they sit in the same profile directory as this
//! package's build output, which is three levels above `OUT_DIR`
//! (`target/<profile>/build/powerflex-<hash>/out`).

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").unwrap_or_default());
    let profile_dir = out_dir
        .ancestors()
        .nth(3)
        .map(PathBuf::from)
        .unwrap_or_default();
    println!(
        "cargo:rustc-env=POWERFLEX_PROFILE_DIR={}",
        profile_dir.display()
    );
}
