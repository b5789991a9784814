//! `powerflex-sim`: make and inspect SIMULATED GPU nodes, inject faults, and show the
//! workload library.
//!
//! Exit codes: 0 success; 1 the request failed (bad state directory, unknown model or
//! profile, I/O); 2 usage error.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use powerflex_sim::profiles::{reproduction, Library};
use powerflex_sim::state::{Fault, Node};

#[derive(Debug, Parser)]
#[command(
    name = "powerflex-sim",
    version,
    about = "SIMULATED GPU nodes for powerflex: create, inspect, inject faults, list workload profiles"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Format {
    Table,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create a simulated node: GPUs idle at their default power limit.
    Init {
        /// State directory of the node (what POWERFLEX_SIM_DIR will point at).
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
        /// Device model: H200 or H100.
        #[arg(long, default_value = "H200", value_parser = device_model)]
        model: String,
        /// Number of GPUs.
        #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=64))]
        gpus: u32,
        /// Node name (GPU UUIDs derive from it, so nodes differ).
        #[arg(long, default_value = "node0")]
        node: String,
        /// Recreate the node if the directory already holds one.
        #[arg(long)]
        force: bool,
    },
    /// Show every GPU of a node: limit, draw, energy, job, fault.
    Status {
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
        /// Output: a table for people, JSON for scripts.
        #[arg(long, value_enum, default_value = "table")]
        format: Format,
    },
    /// Inject a fault on one GPU (or clear it with --kind none).
    Fault {
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
        /// GPU index.
        #[arg(long)]
        gpu: u32,
        /// gpu-lost (every call fails GPU_IS_LOST), timeout (every call TIMEOUT),
        /// no-permission (setting the limit fails NO_PERMISSION), or none.
        #[arg(long, value_parser = ["gpu-lost", "timeout", "no-permission", "none"])]
        kind: String,
    },
    /// The workload library: each profile's target PFI against the PFI its physics gives.
    Profiles {
        /// Regenerate the library from the paper's table (needs --write).
        #[arg(long, value_name = "FILE", requires = "write")]
        paper: Option<PathBuf>,
        /// Write the regenerated library to FILE.
        #[arg(long, value_name = "FILE", requires = "paper")]
        write: Option<PathBuf>,
        /// Real measured curves (a curves CSV) to add table profiles from, scaled to H200.
        #[arg(long, value_name = "FILE", requires = "paper")]
        real: Option<PathBuf>,
        /// Output: a table for people, JSON for scripts.
        #[arg(long, value_enum, default_value = "table")]
        format: Format,
    },
}

/// `--model`: a known device model, checked by clap so a typo exits 2.
fn device_model(key: &str) -> Result<String, String> {
    match powerflex_sim::models::find(key) {
        Some(m) => Ok(m.key.to_string()),
        None => Err(format!(
            "unknown device model; accepted: {}",
            powerflex_sim::models::known_names()
        )),
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("powerflex-sim: error: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(cli: Cli) -> Result<String, Box<dyn std::error::Error>> {
    match cli.command {
        Command::Init {
            dir,
            model,
            gpus,
            node,
            force,
        } => {
            let n = Node::init(&dir, &node, &model, gpus, force)?;
            Ok(format!(
                "SIMULATED node {} in {}: {} x {} at {} mW\n",
                n.info().node,
                dir.display(),
                n.gpu_count(),
                n.model().nvml_name,
                n.model().default_limit_mw
            ))
        }
        Command::Status { dir, format } => {
            let node = Node::open(&dir)?;
            let mut rows = Vec::new();
            for index in 0..node.gpu_count() {
                let (gpu, r) = node.reading(index)?;
                rows.push(serde_json::json!({
                    "simulated": true,
                    "index": index,
                    "uuid": gpu.uuid,
                    "limit_mw": r.limit_mw,
                    "power_mw": r.power_mw,
                    "energy_mj": r.energy_mj,
                    "sm_clock_mhz": r.sm_clock_mhz,
                    "memory_clock_mhz": r.memory_clock_mhz,
                    "gpu_util_pct": r.gpu_util_pct,
                    "memory_util_pct": r.memory_util_pct,
                    "power_capped": r.power_capped,
                    "job_id": r.job_id,
                    "profile": gpu.running().map(|w| w.profile.clone()),
                    "fault": gpu.fault,
                }));
            }
            match format {
                Format::Json => Ok(serde_json::to_string_pretty(&rows)? + "\n"),
                Format::Table => {
                    let mut out = format!(
                        "SIMULATED node {} ({} x {})\n{:>3}  {:<40}  {:>8}  {:>8}  {:>12}  {:>5}  {:<8}  {}\n",
                        node.info().node,
                        node.gpu_count(),
                        node.model().nvml_name,
                        "gpu", "uuid", "limit W", "power W", "energy J", "SM", "job", "fault"
                    );
                    for row in &rows {
                        out.push_str(&format!(
                            "{:>3}  {:<40}  {:>8.1}  {:>8.1}  {:>12.1}  {:>5}  {:<8}  {}\n",
                            row["index"].as_u64().unwrap_or(0),
                            row["uuid"].as_str().unwrap_or(""),
                            row["limit_mw"].as_f64().unwrap_or(0.0) / 1000.0,
                            row["power_mw"].as_f64().unwrap_or(0.0) / 1000.0,
                            row["energy_mj"].as_f64().unwrap_or(0.0) / 1000.0,
                            row["sm_clock_mhz"].as_u64().unwrap_or(0),
                            row["job_id"].as_str().unwrap_or("-"),
                            row["fault"].as_str().unwrap_or("-"),
                        ));
                    }
                    Ok(out)
                }
            }
        }
        Command::Fault { dir, gpu, kind } => {
            let node = Node::open(&dir)?;
            let fault = if kind == "none" {
                None
            } else {
                Fault::from_name(&kind)
            };
            node.set_fault(gpu, fault)?;
            Ok(format!(
                "SIMULATED GPU {gpu} of {}: fault {kind}\n",
                node.info().node
            ))
        }
        Command::Profiles {
            paper,
            write,
            real,
            format,
        } => {
            let library = match (&paper, &write) {
                (Some(paper), Some(write)) => {
                    let text = std::fs::read_to_string(paper)
                        .map_err(|e| format!("cannot read {}: {e}", paper.display()))?;
                    let library = match &real {
                        Some(real) => {
                            let curves = std::fs::read_to_string(real)
                                .map_err(|e| format!("cannot read {}: {e}", real.display()))?;
                            Library::generate(&text, &curves)?
                        }
                        None => Library::from_paper(&text)?,
                    };
                    std::fs::write(write, library.to_toml()?)
                        .map_err(|e| format!("cannot write {}: {e}", write.display()))?;
                    library
                }
                _ => Library::builtin()?,
            };
            let rows = reproduction(&library);
            match format {
                Format::Json => Ok(serde_json::to_string_pretty(&rows)? + "\n"),
                Format::Table => {
                    let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
                    let mut out = format!(
                        "SIMULATED workload library ({} profiles): target PFI vs the PFI the profile's physics gives\n{:<42} {:>7} {:>7} {:>9} {:>9} {:>10} {:>12}\n",
                        rows.len(), "profile", "target", "got", "target4", "got4", "uncapped W", "tok/s/GPU"
                    );
                    for r in &rows {
                        out.push_str(&format!(
                            "{:<42} {:>7.2} {:>7} {:>9} {:>9} {:>10.0} {:>12.0}\n",
                            r.name,
                            r.target_pfi,
                            f(r.pfi),
                            f(r.target_pfi_4cap),
                            f(r.pfi_4cap),
                            r.uncapped_w,
                            r.tokens_per_s_per_gpu
                        ));
                    }
                    Ok(out)
                }
            }
        }
    }
}
