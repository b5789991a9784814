//! `powerflexd`: powerflex's node agent. Run as root, one per GPU node (or per
//! `slurmd -N` node on a test host).
//!
//! SIGHUP re-reads the site config: tiers, fail-safe cap, node budget, lease and
//! calibration settings change without a restart; an invalid file is refused, logged and
//! shown by `status` (`config_error`), and the settings in force stay.
//!
//! Exit codes ([`Exit`]): 0 stopped cleanly (SIGTERM/SIGINT; GPUs without a running job
//! restored); 1 could not start (config, NVML, sockets); 2 usage error. With
//! `--release-gpus`: 0 every GPU back at its default limit; 1 some GPU could not be
//! reached or set (NVML, the config); 3 refused because an agent runs on this node (the
//! package's removal stops there, since that agent would cap the GPUs again).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use powerflex_agent::backend::{GpuBackend, NvmlBackend};
use powerflex_agent::controller_link::LinkOptions;
use powerflex_agent::run::{run, RunOptions};
use powerflex_agent_machine::control::AgentSettings;
use powerflex_core::config::{ReleaseSettings, SiteConfig};
use powerflex_daemon::clock::SteadyClock;
use powerflex_daemon::program::{Exit, Program};
use powerflex_daemon::signals::SignalWatcher;

#[derive(Debug, Parser)]
#[command(
    name = "powerflexd",
    version,
    about = "powerflex node agent: per-job GPU power caps, calibration; caps of running jobs kept through restarts"
)]
struct Cli {
    /// Site config (powerflex.toml).
    #[arg(long, default_value = "/etc/slurm/powerflex.toml", value_name = "FILE")]
    config: PathBuf,
    /// Write this daemon's man page (section 8) into DIR and exit.
    #[arg(long, hide = true, exclusive = true, value_name = "DIR")]
    write_man_pages: Option<PathBuf>,
    /// Slurm node name this agent serves [default: $SLURMD_NODENAME, else the short host name].
    #[arg(long, value_name = "NAME")]
    node: Option<String>,
    /// GPU sampling and cap reconciliation period, milliseconds.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(50..=60_000), value_name = "MS")]
    sample_interval_ms: u64,
    /// On exit, put every GPU back to its default limit, those of running jobs too (to
    /// decommission the node). Without it a stop or restart leaves every GPU at the limit
    /// in force, so the budget holds through upgrades.
    #[arg(long)]
    release_on_exit: bool,
    /// Do not start: put every GPU of this node back to its default power limit and exit
    /// (for removing powerflex from a node, once powerflexd is stopped). Refused while an
    /// agent answers on this node's socket.
    #[arg(long, conflicts_with = "release_on_exit")]
    release_gpus: bool,
    /// Do not start: read and validate the site config as this version reads it, say
    /// what is wrong, and exit 0 (valid) or 1 (for a package upgrade, before the agent is
    /// restarted on the new binary).
    #[arg(long, conflicts_with_all = ["release_on_exit", "release_gpus"])]
    check_config: bool,
}

/// This node's Slurm name: `--node`, else `$SLURMD_NODENAME`, else the short host name.
fn node_name(given: Option<String>) -> Result<String, String> {
    let node = given
        .or_else(|| std::env::var("SLURMD_NODENAME").ok())
        .unwrap_or_else(hostname);
    if node.is_empty() {
        return Err("cannot tell this node's name; pass --node".into());
    }
    Ok(node)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().split('.').next().unwrap_or("").to_string())
        .unwrap_or_default()
}

impl Program for Cli {
    const NAME: &'static str = "powerflexd";
    const MAN_SECTION: &'static str = "8";

    fn write_man_pages(&self) -> Option<&std::path::Path> {
        self.write_man_pages.as_deref()
    }

    fn check_config(&self) -> Option<(&std::path::Path, Result<(), String>)> {
        self.check_config
            .then(|| (self.config.as_path(), read_site(&self.config).map(drop)))
    }
}

fn main() -> ExitCode {
    let cli = match Cli::start() {
        Ok(cli) => cli,
        Err(done) => return done.into(),
    };
    if cli.release_gpus {
        return release_main(&cli);
    }
    let started = start(cli).inspect_err(|message| tracing::error!("{message}"));
    Cli::finish(started, |_| Exit::Failure)
}

/// `--release-gpus`, start to end: exit 0 when every GPU is back at its default, 3 when
/// an agent still runs here, 1 when a GPU or the config could not be read or set. Observe
/// mode changes nothing here: a node switched to it by a reload keeps the caps written
/// before the switch, and only this puts them back.
fn release_main(cli: &Cli) -> ExitCode {
    let released = release(cli)
        .map(|done| println!("powerflexd: {done}"))
        .inspect_err(|e| tracing::error!("{e}"));
    Cli::finish(released, ReleaseError::exit)
}

/// The site config read leniently ([`ReleaseSettings`]): a node leaving service must put
/// its GPUs back even when the rest of its config no longer validates.
fn release(cli: &Cli) -> Result<String, ReleaseError> {
    let path = &cli.config;
    let text = std::fs::read_to_string(path)
        .map_err(|e| ReleaseError::Failed(format!("cannot read {}: {e}", path.display())))?;
    let settings = ReleaseSettings::from_toml_str(&text)
        .map_err(|e| ReleaseError::Failed(format!("{}: {e}", path.display())))?;
    let node = node_name(cli.node.clone()).map_err(ReleaseError::Failed)?;
    let mut backend = NvmlBackend::open(settings.nvml_library.as_deref().map(std::path::Path::new))
        .map_err(ReleaseError::Failed)?;
    release_gpus(&mut backend, &agent_sockets(&settings, &node))
}

/// Every agent socket on this host that the pattern can name: this node's, and, when
/// `%n` stands in the file name, every file of that directory that fits around it (an
/// agent started with a `--node` other than this host's name must not be missed).
fn agent_sockets(settings: &ReleaseSettings, node: &str) -> Vec<PathBuf> {
    let mut sockets = vec![settings.socket_path(node)];
    let Some((before, after)) = settings.socket.split_once("%n") else {
        return sockets;
    };
    let (dir, prefix) = match before.rfind('/') {
        Some(i) => (&before[..=i], &before[i + 1..]),
        None => ("./", before),
    };
    if after.contains('/') || dir.contains('%') || prefix.contains('%') || after.contains('%') {
        return sockets;
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.len() > prefix.len() + after.len()
                && name.starts_with(prefix)
                && name.ends_with(after)
            {
                sockets.push(entry.path());
            }
        }
    }
    sockets
}

/// Reads and validates the site config.
fn read_site(path: &std::path::Path) -> Result<SiteConfig, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    SiteConfig::from_toml_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The agent's settings from the site config, for GPUs named `gpu_name`.
fn settings_from(
    site: &SiteConfig,
    config: &std::path::Path,
    node: &str,
    gpu_name: &str,
    progress_address: String,
) -> Result<AgentSettings, String> {
    AgentSettings::from_site(site, node, gpu_name, progress_address)
        .map_err(|e| format!("{}: {e}", config.display()))
}

/// `--release-gpus`: every GPU back to its board's default limit, the agent not started.
/// A live agent would put its caps back at its next sample, so it must be stopped
/// first; a socket that accepts a connection is a live agent.
fn release_gpus(
    backend: &mut dyn GpuBackend,
    control_sockets: &[PathBuf],
) -> Result<String, ReleaseError> {
    if let Some(control_socket) = control_sockets
        .iter()
        .find(|socket| std::os::unix::net::UnixStream::connect(socket).is_ok())
    {
        return Err(ReleaseError::AgentRunning(format!(
            "powerflexd is running on this node (its socket {} answers); stop it first (systemctl stop powerflexd), then run --release-gpus again",
            control_socket.display()
        )));
    }
    let gpus = backend
        .discover()
        .map_err(|e| ReleaseError::Failed(e.to_string()))?;
    let mut failed = Vec::new();
    for gpu in &gpus {
        match backend.set_cap(gpu.index, gpu.default_cap) {
            Ok(before) => tracing::info!(
                gpu = gpu.index,
                default_w = gpu.default_cap.0,
                before_w = before.map(|w| w.0),
                "GPU back to its default power limit"
            ),
            Err(e) => failed.push(format!("GPU {}: {e}", gpu.index)),
        }
    }
    if !failed.is_empty() {
        return Err(ReleaseError::Failed(format!(
            "{} of {} GPUs could not be put back to their default limits: {}",
            failed.len(),
            gpus.len(),
            failed.join("; ")
        )));
    }
    Ok(format!(
        "{} GPUs back to their default power limits",
        gpus.len()
    ))
}

/// Why `--release-gpus` did not put every GPU back.
enum ReleaseError {
    /// An agent answers on this node's socket.
    AgentRunning(String),
    /// A GPU could not be reached or set.
    Failed(String),
}

impl ReleaseError {
    /// The exit `--release-gpus` ends with: 3 for a running agent, which the package's
    /// removal must not go past; 1 for the rest.
    fn exit(&self) -> Exit {
        match self {
            ReleaseError::AgentRunning(_) => Exit::AgentRunning,
            ReleaseError::Failed(_) => Exit::Failure,
        }
    }
}

impl std::fmt::Display for ReleaseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReleaseError::AgentRunning(why) | ReleaseError::Failed(why) => f.write_str(why),
        }
    }
}

fn start(cli: Cli) -> Result<(), String> {
    let site = read_site(&cli.config)?;
    let node = node_name(cli.node)?;
    let control_socket = site.agent.socket_path(&node);
    let mut backend = NvmlBackend::open(site.agent.nvml_library.as_deref())?;
    let gpus = backend.discover().map_err(|e| e.to_string())?;
    let gpu_name = gpus
        .first()
        .ok_or("NVML reports no GPU on this node")?
        .name
        .clone();
    let progress_socket = control_socket.with_extension("progress");
    let progress_address = progress_socket.display().to_string();
    let settings = settings_from(
        &site,
        &cli.config,
        &node,
        &gpu_name,
        progress_address.clone(),
    )?;
    // Controller mode needs this node's link key; without it no lease can be trusted, so
    // the link stays down and the fail-safe cap applies once the first lease would be due.
    let link = if site.agent.node_budget_w.is_some() {
        None
    } else {
        match powerflex_daemon::fsx::read_key_file(&site.agent.key_file(&node)) {
            Ok(key) => Some(LinkOptions {
                controllers: std::iter::once(site.controller.listen)
                    .chain(site.controller.standby_addresses.iter().copied())
                    .collect(),
                key,
                node: node.clone(),
                report_period: Duration::from_secs(site.controller.allocation_period_s),
                gpus: Vec::new(),
                silent_after: LinkOptions::silence_for(
                    site.controller.lease_ttl(),
                    Duration::from_secs(site.controller.allocation_period_s),
                ),
            }),
            Err(e) => {
                tracing::error!(
                    "{e}; no controller link: the fail-safe cap will apply after {} s",
                    site.controller.lease_ttl_s
                );
                None
            }
        }
    };
    let options = RunOptions {
        control_socket,
        progress_socket,
        state_dir: site.agent.state_dir(&node),
        metrics_listen: site.agent.metrics_listen,
        sample_interval: Duration::from_millis(cli.sample_interval_ms),
        link,
        release_on_exit: cli.release_on_exit,
        usage_log: site.agent.usage_log,
        clock: Arc::new(SteadyClock::start()),
    };
    let shutdown = Arc::new(AtomicBool::new(false));
    let (reload_tx, reload_rx) = crossbeam_channel::bounded(4);
    let config = cli.config.clone();
    let watcher = SignalWatcher::spawn(shutdown.clone(), move || {
        let reloaded = read_site(&config).and_then(|site| {
            settings_from(&site, &config, &node, &gpu_name, progress_address.clone())
        });
        let _ = reload_tx.send(reloaded);
    })
    .map_err(|e| e.to_string())?;
    let result = run(
        settings,
        options,
        Box::new(backend),
        shutdown.clone(),
        reload_rx,
    )
    .map_err(|e| e.to_string());
    shutdown.store(true, Ordering::SeqCst);
    watcher.stop();
    result
}
