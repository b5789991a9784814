//! `powerflex-grid`: the site's OpenADR 3 VEN (see the crate docs). Runs until SIGTERM
//! or SIGINT.
//!
//! Exit codes: 0 stopped by a signal; 2 bad config or credentials; 1 any other failure
//! to start.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use powerflex_core::config::SiteConfig;
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

fn main() -> ExitCode {
    powerflex_daemon::trace::init();
    let args = Args::parse();
    if let Some(dir) = &args.write_man_pages {
        use clap::CommandFactory;
        return powerflex_daemon::man::write_pages_for(Args::command(), "8", dir);
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("powerflex-grid: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("powerflex-grid: {e}");
            match e {
                GridError::Config { .. }
                | GridError::NotConfigured { .. }
                | GridError::Credentials { .. } => ExitCode::from(2),
                _ => ExitCode::from(1),
            }
        }
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
