//! What every powerflex binary's `main` does alike (`powerflexd`, `powerflex-ctld`,
//! `powerflexctl`, `powerflex-grid`): parse the command line, answer the hidden
//! `--write-man-pages DIR` and a daemon's `--check-config`, install the tracing
//! subscriber, and at the end say a failure as `NAME: error: WHY` with the exit code
//! ([`Exit`]) that failure has.
//!
//! A binary implements [`Program`] on its clap struct and its `main` reads:
//!
//! ```ignore
//! fn main() -> ExitCode {
//!     let cli = match Cli::start() {
//!         Ok(cli) => cli,
//!         Err(done) => return done.into(),
//!     };
//!     Cli::finish(run(cli), |_| Exit::Failure)
//! }
//! ```

use std::fmt::Display;
use std::path::Path;
use std::process::ExitCode;

/// How a powerflex binary ends. A code means the same in every binary; the Debian
/// maintainer scripts (`packaging/`: an upgrade stops on a `--check-config` that is not
/// 0, a removal on a `--release-gpus` that is not 0) and the tests rely on each one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// 0: done. A daemon stopped by SIGTERM or SIGINT; `--check-config` found the config
    /// valid; `--release-gpus` put every GPU back at its default limit; a `powerflexctl`
    /// command or `--write-man-pages` did what it was asked.
    Success,
    /// 1: failed, the reason on stderr. A daemon could not start (config, key, NVML,
    /// sockets) or stopped on an error; `--check-config` found the config invalid;
    /// `--release-gpus` could not read the config or reach or set some GPU; a
    /// `powerflexctl` command failed (the controller refused or could not be reached,
    /// unreadable input); a man page could not be written.
    Failure,
    /// 2: the invocation cannot work as given, and trying again unchanged will not help:
    /// a wrong command line (clap answers it with the usage before `main`'s own code
    /// runs), or `powerflex-grid`'s config or credentials (no `[grid.openadr]`, a config
    /// or credentials file it cannot read or use). The daemons that check their config at
    /// start exit 1 for it instead, as the package scripts expect.
    Usage,
    /// 3: `powerflexd --release-gpus` refused because an agent answers on this node's
    /// socket: that agent would cap the GPUs again, so the package's removal stops there
    /// until it is stopped.
    AgentRunning,
}

impl Exit {
    /// The process's exit status.
    pub const fn code(self) -> u8 {
        match self {
            Exit::Success => 0,
            Exit::Failure => 1,
            Exit::Usage => 2,
            Exit::AgentRunning => 3,
        }
    }
}

impl From<Exit> for ExitCode {
    fn from(exit: Exit) -> ExitCode {
        ExitCode::from(exit.code())
    }
}

/// A powerflex binary's command line, with what the shared prologue needs from it.
pub trait Program: clap::Parser {
    /// The binary's name: the prefix of everything it says on stdout and stderr.
    const NAME: &'static str;
    /// The section of its man pages: "8" for a daemon, "1" for a command.
    const MAN_SECTION: &'static str;

    /// `--write-man-pages DIR`, when given.
    fn write_man_pages(&self) -> Option<&Path>;

    /// `--check-config`, when given: the config's path and what reading it as a start
    /// would read it gave. A binary without the flag keeps this default.
    fn check_config(&self) -> Option<(&Path, Result<(), String>)> {
        None
    }

    /// The start every `main` shares, in one order: the command line parsed (clap
    /// exits 2 with the usage on a wrong one, 0 for `--help` and `--version`); then
    /// `--write-man-pages DIR` writes this binary's pages; then `--check-config` says
    /// whether the config is valid; then the tracing subscriber from `POWERFLEX_LOG` is
    /// installed (after the check, so its verdict is all `--check-config` prints).
    /// `Ok`: the binary goes on to its work. `Err`: a flag was answered and `main`
    /// returns that exit.
    fn start() -> Result<Self, Exit>
    where
        Self: Sized,
    {
        let cli = Self::parse();
        if let Some(dir) = cli.write_man_pages() {
            return Err(write_man_pages(
                Self::NAME,
                Self::command(),
                Self::MAN_SECTION,
                dir,
            ));
        }
        if let Some((path, checked)) = cli.check_config() {
            return Err(report_config_check(Self::NAME, path, checked));
        }
        crate::trace::init();
        Ok(cli)
    }

    /// How `main` ends: 0 for `Ok`; an error is said on stderr as `NAME: error: WHY`
    /// and ends the process with the exit `exit_for` gives it.
    fn finish<E: Display>(result: Result<(), E>, exit_for: impl FnOnce(&E) -> Exit) -> ExitCode
    where
        Self: Sized,
    {
        match result {
            Ok(()) => Exit::Success.into(),
            Err(e) => {
                eprintln!("{}: error: {e}", Self::NAME);
                exit_for(&e).into()
            }
        }
    }
}

/// What the hidden `--write-man-pages DIR` does: writes `command`'s pages into `dir`,
/// says how many, and gives the exit (1, with the reason on stderr, when a page cannot be
/// written).
fn write_man_pages(
    program: &str,
    command: clap::Command,
    section: &'static str,
    dir: &Path,
) -> Exit {
    match crate::man::write_pages(command, section, dir) {
        Ok(pages) => {
            println!(
                "{program}: wrote {} man pages into {}",
                pages.len(),
                dir.display()
            );
            Exit::Success
        }
        Err(e) => {
            eprintln!("{program}: error: {e}");
            Exit::Failure
        }
    }
}

/// What `--check-config` prints and returns: `PROGRAM: PATH is valid` and 0, or
/// `PROGRAM: error: WHY` on stderr and 1.
fn report_config_check(program: &str, path: &Path, checked: Result<(), String>) -> Exit {
    match checked {
        Ok(()) => {
            println!("{program}: {} is valid", path.display());
            Exit::Success
        }
        Err(e) => {
            eprintln!("{program}: error: {e}");
            Exit::Failure
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The codes the package scripts and the tests depend on, one per meaning.
    #[test]
    fn every_exit_keeps_its_code() {
        assert_eq!(Exit::Success.code(), 0);
        assert_eq!(Exit::Failure.code(), 1);
        assert_eq!(Exit::Usage.code(), 2);
        assert_eq!(Exit::AgentRunning.code(), 3);
    }

    #[derive(Debug, clap::Parser)]
    #[command(name = "tool")]
    struct Tool {
        #[arg(long)]
        config: std::path::PathBuf,
        #[arg(long)]
        check_config: bool,
    }

    impl Program for Tool {
        const NAME: &'static str = "tool";
        const MAN_SECTION: &'static str = "1";
        fn write_man_pages(&self) -> Option<&Path> {
            None
        }
        fn check_config(&self) -> Option<(&Path, Result<(), String>)> {
            self.check_config
                .then(|| (self.config.as_path(), Err("no such key".to_string())))
        }
    }

    #[test]
    fn an_invalid_config_is_a_failure_and_a_valid_one_a_success() {
        let path = Path::new("/etc/site.toml");
        assert_eq!(
            report_config_check("tool", path, Err("bad".into())),
            Exit::Failure
        );
        assert_eq!(report_config_check("tool", path, Ok(())), Exit::Success);
        let tool = <Tool as clap::Parser>::parse_from(["tool", "--config", "x", "--check-config"]);
        let (checked_path, checked) = tool.check_config().expect("asked for");
        assert_eq!(checked_path, Path::new("x"));
        assert!(checked.is_err());
    }

    #[test]
    fn a_failure_gets_the_exit_its_error_maps_to() {
        assert_eq!(
            Tool::finish(Err("refused"), |_| Exit::AgentRunning),
            ExitCode::from(3)
        );
        assert_eq!(
            Tool::finish(Ok::<(), &str>(()), |_| Exit::Failure),
            ExitCode::SUCCESS
        );
    }
}
