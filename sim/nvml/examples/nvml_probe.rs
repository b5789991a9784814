//! A tiny NVML client over `nvml-wrapper`, used by the simulator's tests to exercise the
//! library from a separate process (another user, another node directory):
//!
//! ```text
//! nvml_probe LIB list            # one JSON object per GPU
//! nvml_probe LIB set INDEX MW    # set a power limit, print the outcome
//! ```
//! Prints `{"error": "<NvmlError variant>"}` when NVML refuses, and exits 0 either way.

use nvml_wrapper::Nvml;
use std::ffi::OsStr;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: nvml_probe LIB list | nvml_probe LIB set INDEX MW");
        std::process::exit(2);
    }
    let nvml = match Nvml::builder().lib_path(OsStr::new(&args[1])).init() {
        Ok(n) => n,
        Err(e) => {
            println!("{}", serde_json::json!({ "error": format!("{e:?}") }));
            return;
        }
    };
    match args[2].as_str() {
        "list" => {
            let count = nvml.device_count().unwrap_or(0);
            for i in 0..count {
                match nvml.device_by_index(i) {
                    Ok(d) => println!(
                        "{}",
                        serde_json::json!({
                            "index": i,
                            "uuid": d.uuid().ok(),
                            "name": d.name().ok(),
                            "limit_mw": d.power_management_limit().ok(),
                        })
                    ),
                    Err(e) => println!(
                        "{}",
                        serde_json::json!({ "index": i, "error": format!("{e:?}") })
                    ),
                }
            }
        }
        "set" if args.len() == 5 => {
            let index: u32 = args[3].parse().unwrap_or(u32::MAX);
            let mw: u32 = args[4].parse().unwrap_or(0);
            let outcome = nvml
                .device_by_index(index)
                .and_then(|mut d| d.set_power_management_limit(mw));
            match outcome {
                Ok(()) => println!("{}", serde_json::json!({ "ok": true })),
                Err(e) => println!("{}", serde_json::json!({ "error": format!("{e:?}") })),
            }
        }
        other => {
            eprintln!("unknown command {other}");
            std::process::exit(2);
        }
    }
}
