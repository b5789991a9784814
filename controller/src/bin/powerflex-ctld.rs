//! `powerflex-ctld`: the site controller. One per site, as root.
//!
//! SIGHUP re-reads the site config: budget, policy, tiers and lease settings change at
//! once; an invalid file is refused, logged and shown by `powerflexctl status`, and the
//! config in force stays.
//!
//! Exit codes ([`Exit`]): 0 stopped by SIGTERM/SIGINT; 1 could not start (config, key,
//! sockets); 2 usage error.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use powerflex_controller::ctld::{run, CtldOptions};
use powerflex_controller_machine::controller::CtldSettings;
use powerflex_core::config::SiteConfig;
use powerflex_daemon::program::{Exit, Program};
use powerflex_daemon::signals::SignalWatcher;

#[derive(Debug, Parser)]
#[command(
    name = "powerflex-ctld",
    version,
    about = "powerflex site controller: one GPU power budget across every node, grid events on schedule"
)]
struct Cli {
    /// Site config (powerflex.toml).
    #[arg(long, default_value = "/etc/slurm/powerflex.toml", value_name = "FILE")]
    config: PathBuf,
    /// Write this daemon's man page (section 8) into DIR and exit.
    #[arg(long, hide = true, exclusive = true, value_name = "DIR")]
    write_man_pages: Option<PathBuf>,
    /// Do not start: read the site config and the site key as this version would at its
    /// start, say what is wrong, and exit 0 (valid) or 1 (for a package upgrade, before
    /// the controller is restarted on the new binary).
    #[arg(long)]
    check_config: bool,
}

impl Program for Cli {
    const NAME: &'static str = "powerflex-ctld";
    const MAN_SECTION: &'static str = "8";

    fn write_man_pages(&self) -> Option<&std::path::Path> {
        self.write_man_pages.as_deref()
    }

    fn check_config(&self) -> Option<(&std::path::Path, Result<(), String>)> {
        self.check_config
            .then(|| (self.config.as_path(), load_options(&self.config).map(drop)))
    }
}

fn main() -> ExitCode {
    let cli = match Cli::start() {
        Ok(cli) => cli,
        Err(done) => return done.into(),
    };
    Cli::finish(start(cli), |_| Exit::Failure)
}

/// Reads and validates the site config and the key: the controller's options.
fn load_options(config: &std::path::Path) -> Result<CtldOptions, String> {
    let text = std::fs::read_to_string(config)
        .map_err(|e| format!("cannot read {}: {e}", config.display()))?;
    let site =
        SiteConfig::from_toml_str(&text).map_err(|e| format!("{}: {e}", config.display()))?;
    let key = powerflex_daemon::fsx::read_site_key(&site.controller.key_file)
        .map_err(|e| e.to_string())?;
    Ok(CtldOptions {
        listen: site.controller.listen,
        admin_socket: site.controller.admin_socket.clone(),
        state_dir: site.controller.state_dir.clone(),
        key,
        metrics_listen: site.controller.metrics_listen,
        slurm_poll: Duration::from_secs(site.controller.slurm_poll_s),
        slurm_timeout: Duration::from_secs(site.controller.slurm_timeout_s),
        records_db: site
            .controller
            .database
            .as_ref()
            .map(powerflex_controller::ctld::records_db::RecordsDbOptions::from_config),
        ha: site
            .controller
            .ha
            .as_ref()
            .map(powerflex_controller::ctld::ha::HaOptions::from_config),
        settings: CtldSettings::from_site(&site).map_err(|e| e.to_string())?,
    })
}

fn start(cli: Cli) -> Result<(), String> {
    let options = load_options(&cli.config)?;
    let shutdown = Arc::new(AtomicBool::new(false));
    let (reload_tx, reload_rx) = crossbeam_channel::bounded(4);
    let config = cli.config.clone();
    let watcher = SignalWatcher::spawn(shutdown.clone(), move || {
        let _ = reload_tx.send(load_options(&config));
    })
    .map_err(|e| e.to_string())?;
    let result = run(options, shutdown.clone(), reload_rx);
    shutdown.store(true, Ordering::SeqCst);
    watcher.stop();
    result
}
