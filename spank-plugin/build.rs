//! Generates Rust bindings for the installed `slurm/spank.h` (and `slurm_version.h`, for
//! `SLURM_VERSION_NUMBER`), so the plugin matches the Slurm it is built against.

use std::path::{Path, PathBuf};

fn main() {
    let include = std::env::var("SLURM_INCLUDE_DIR").unwrap_or_else(|_| "/usr/include".to_string());
    let spank = Path::new(&include).join("slurm/spank.h");
    println!("cargo:rerun-if-changed={}", spank.display());
    println!("cargo:rerun-if-env-changed=SLURM_INCLUDE_DIR");
    if !spank.is_file() {
        panic!(
            "\n\npowerflex-spank: {} not found.\nInstall Slurm's development headers (Debian: apt-get install libslurm-dev), \
             or point SLURM_INCLUDE_DIR at the directory holding slurm/spank.h.\n",
            spank.display()
        );
    }
    let wrapper = "#include <slurm/spank.h>\n#include <slurm/slurm_version.h>\n";
    let bindings = bindgen::Builder::default()
        .header_contents("wrapper.h", wrapper)
        .clang_arg(format!("-I{include}"))
        .allowlist_function("spank_.*")
        .allowlist_function("slurm_error")
        .allowlist_function("slurm_info")
        .allowlist_function("slurm_verbose")
        .allowlist_type("spank_.*")
        .allowlist_type("spank_t")
        .allowlist_var("SLURM_VERSION_NUMBER")
        .allowlist_var("ESPANK_.*")
        .allowlist_var("S_.*")
        .allowlist_var("SPANK_.*")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .layout_tests(false)
        .generate()
        .unwrap_or_else(|e| {
            panic!(
                "\n\npowerflex-spank: bindgen could not process {}: {e}\nbindgen needs libclang (Debian: apt-get install libclang-dev clang).\n",
                spank.display()
            )
        });
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap_or_default()).join("spank_bindings.rs");
    bindings
        .write_to_file(&out)
        .unwrap_or_else(|e| panic!("powerflex-spank: cannot write {}: {e}", out.display()));
}
