//! The site controller (`powerflex-ctld`, [`ctld`]) and the admin CLI `powerflexctl`.
//!
//! This library holds what the binaries do, so tests can call it without a process:
//! [`offline`] implements the commands that work on files alone (`pfi`, `allocate`,
//! `evaluate`, `synth-curves`), [`powerflex_controller_machine::schedule`] turns grid events into the budget in force
//! at each instant, [`powerflex_decide`] splits that budget across the jobs of every node
//! (one cap per job everywhere), [`powerflex_controller_machine::placement`] decides which of a node's words to believe (Slurm's
//! record of where each job runs), [`table`] renders human tables and [`render`] the
//! controller's answers in them, [`plot`] draws the controller's history as SVG and
//! [`energy_plot`] the ended jobs' energy per tier. The binaries parse arguments, read
//! files, print and choose exit codes; the decisions come from the pure crates
//! `powerflex-controller-machine`, `powerflex-decide` and `powerflex-core`, each named by
//! its own path.

pub mod ctld;
pub mod energy_plot;
pub mod offline;
pub mod plot;
pub mod reference;
pub mod render;
pub mod table;

/// Errors of the CLI and controller. Messages are lowercase, without a trailing period.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Input {
        path: String,
        #[source]
        source: powerflex_core::Error,
    },
    #[error("{0}")]
    Usage(String),
    #[error("job \"{job}\": tier column: {source}")]
    BadTier {
        job: String,
        #[source]
        source: powerflex_core::flex::FlexError,
    },
    /// Nothing to plot: no ended job's record matched.
    #[error(
        "no job energy records in that range (a user sees only their own jobs); nothing to plot"
    )]
    NoRecords,
    #[error(transparent)]
    Core(#[from] powerflex_core::Error),
}

/// Reads a text file, refusing anything over `max_bytes` so a wrong path (a disk image,
/// /dev/zero) fails with a message instead of exhausting memory.
pub fn read_text(path: &str, max_bytes: u64) -> Result<String, CtlError> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|source| CtlError::Read {
        path: path.to_string(),
        source,
    })?;
    let mut text = String::new();
    let read = file
        .take(max_bytes + 1)
        .read_to_string(&mut text)
        .map_err(|source| CtlError::Read {
            path: path.to_string(),
            source,
        })?;
    if read as u64 > max_bytes {
        return Err(CtlError::Usage(format!(
            "{path} is larger than {} MiB; is it the right file?",
            max_bytes / (1024 * 1024)
        )));
    }
    Ok(text)
}
