//! Logging setup shared by the daemons: `tracing` to stderr (journald or the testbed's
//! log file collects it), filtered by `POWERFLEX_LOG` (`RUST_LOG` syntax), `info` when
//! unset or unparsable. No ANSI colours: the output is read from files, not terminals.

/// Environment variable holding the log filter.
pub const LOG_ENV: &str = "POWERFLEX_LOG";

/// Installs the global subscriber. Call once, first thing in `main`; a second call (or
/// one after another subscriber was installed, as in tests) is a no-op.
pub fn init() {
    let filter = tracing_subscriber::EnvFilter::try_from_env(LOG_ENV)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}
