//! `powerflex-grid`: the site's OpenADR 3 VEN (see the crate docs). Runs until SIGTERM
//! or SIGINT.
//!
//! Exit codes ([`Exit`]): 0 stopped by a signal; 2 bad config or credentials; 1 any
//! other failure to start.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use powerflex_core::config::SiteConfig;
use powerflex_daemon::program::{Exit, Program};
use powerflex_grid::{read_credentials, Ctld, GridError, Ven, Vtn};
use tracing::{info, warn};

#[derive(Parser, Debug)]
#[command(
    name = "powerflex-grid",
    version,
    about = "powerflex's OpenADR 3 VEN: follows the utility's grid events ([grid.openadr] in the site config) and reports the metered GPU draw"
)]
struct Args {
    /// Site config.
    #[arg(long, default_value = "/etc/slurm/powerflex.toml")]
    config: String,
    /// Poll once, print what was done, and exit (for checks and cron).
    #[arg(long)]
    once: bool,
    /// Write this daemon's man page (section 8) into DIR and exit.
    #[arg(long, hide = true, exclusive = true, value_name = "DIR")]
    write_man_pages: Option<std::path::PathBuf>,
}

impl Program for Args {
    const NAME: &'static str = "powerflex-grid";
    const MAN_SECTION: &'static str = "8";

    fn write_man_pages(&self) -> Option<&std::path::Path> {
        self.write_man_pages.as_deref()
    }
}

fn main() -> ExitCode {
    let args = match Args::start() {
        Ok(args) => args,
        Err(done) => return done.into(),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            return Args::finish(Err(format!("cannot start the async runtime: {e}")), |_| {
                Exit::Failure
            })
        }
    };
    Args::finish(runtime.block_on(run(args)), exit_for)
}

/// A config or credentials the VEN cannot use will not mend on a restart: 2; the rest
/// (the VTN or the controller away, an I/O failure) is 1.
fn exit_for(error: &GridError) -> Exit {
    match error {
        GridError::Config { .. }
        | GridError::NotConfigured { .. }
        | GridError::Credentials { .. } => Exit::Usage,
        _ => Exit::Failure,
    }
}

async fn run(args: Args) -> Result<(), GridError> {
    let text = std::fs::read_to_string(&args.config).map_err(|e| GridError::Config {
        path: args.config.clone(),
        message: e.to_string(),
    })?;
    let site = SiteConfig::from_toml_str(&text).map_err(|e| GridError::Config {
        path: args.config.clone(),
        message: e.to_string(),
    })?;
    let Some(config) = site.grid.openadr else {
        return Err(GridError::NotConfigured { path: args.config });
    };
    let credentials = read_credentials(&config.credentials_file)?;
    let vtn = Vtn::connect(&config, credentials)?;
    let ctld = Ctld {
        socket: site.controller.admin_socket.clone(),
    };
    let poll = Duration::from_secs(config.poll_interval_s);
    let mut ven = Ven::new(config, vtn, ctld)?;
    info!(
        vtn = %ven.config.vtn_url,
        programs = ?ven.config.programs,
        events = ven.ledger.events.len(),
        "powerflex-grid started"
    );
    if args.once {
        ven.vtn.register(&ven.config.ven_name).await?;
        let round = ven.round().await?;
        println!(
            "{} actions, {} refused, {} reports",
            round.actions, round.refused, round.reports
        );
        return Ok(());
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| GridError::Vtn(format!("cannot watch SIGTERM: {e}")))?;
    let mut registered = false;
    loop {
        if !registered {
            match ven.vtn.register(&ven.config.ven_name).await {
                Ok(()) => registered = true,
                Err(e) => warn!(error = %e, "not registered yet"),
            }
        }
        match ven.round().await {
            Ok(round) if round.actions + round.reports > 0 => {
                info!(
                    actions = round.actions,
                    refused = round.refused,
                    reports = round.reports,
                    "round"
                )
            }
            Ok(_) => {}
            // The VTN or the controller is away: the next round tries again; nothing
            // was changed on a half-read view.
            Err(e) => warn!(error = %e, "round skipped"),
        }
        tokio::select! {
            _ = tokio::time::sleep(poll) => {}
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    info!("powerflex-grid stopped");
    Ok(())
}
