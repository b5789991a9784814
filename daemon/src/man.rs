//! Man pages from the same clap definitions that answer `--help` (clap_mangen), so a
//! flag added to a binary is in its page the moment it is built. Every binary takes a
//! hidden `--write-man-pages DIR`; `scripts/package.sh` runs it for the packages.
//!
//! A command with subcommands gets one page for itself and one per subcommand, named as
//! git names its pages (`powerflexctl-event-add.1`), because clap_mangen lists only the
//! subcommands' one-line summaries on the parent's page.

use std::path::{Path, PathBuf};

use crate::DaemonError;

/// Writes `command`'s man page, and one per (nested) subcommand, into `dir` in man
/// section `section` ("1" for user commands, "8" for daemons), and returns the paths
/// written. `dir` is created when missing.
pub fn write_pages(
    command: clap::Command,
    section: &'static str,
    dir: &Path,
) -> Result<Vec<PathBuf>, DaemonError> {
    std::fs::create_dir_all(dir).map_err(DaemonError::io("cannot create", dir.display()))?;
    let mut command = command;
    // Built, every subcommand carries its display name ("powerflexctl-event-add").
    command.build();
    let mut written = Vec::new();
    write_tree(&command, section, dir, &mut written)?;
    Ok(written)
}

fn write_tree(
    command: &clap::Command,
    section: &'static str,
    dir: &Path,
    written: &mut Vec<PathBuf>,
) -> Result<(), DaemonError> {
    let name = page_name(command);
    let path = dir.join(format!("{name}.{section}"));
    let mut roff = Vec::new();
    clap_mangen::Man::new(command.clone())
        .title(name.clone())
        .section(section)
        .render(&mut roff)
        .map_err(DaemonError::io("cannot render the man page", &name))?;
    std::fs::write(&path, roff).map_err(DaemonError::io("cannot write", path.display()))?;
    written.push(path);
    for sub in command.get_subcommands() {
        // clap's own `help` subcommand needs no page.
        if sub.get_name() == "help" {
            continue;
        }
        write_tree(sub, section, dir, written)?;
    }
    Ok(())
}

/// A page's name: the display name clap gives a built subcommand, else its name.
fn page_name(command: &clap::Command) -> String {
    command
        .get_display_name()
        .unwrap_or_else(|| command.get_name())
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool() -> clap::Command {
        clap::Command::new("tool")
            .about("a tool")
            .arg(clap::Arg::new("config").long("config").help("Site config."))
            .subcommand(
                clap::Command::new("event").about("grid events").subcommand(
                    clap::Command::new("add")
                        .about("schedule one")
                        .arg(clap::Arg::new("reduce").long("reduce").help("Cut share.")),
                ),
            )
    }

    #[test]
    fn every_subcommand_gets_a_page_with_its_own_options() {
        let dir = std::env::temp_dir().join(format!("pf-man-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let written = write_pages(tool(), "1", &dir).expect("pages");
        let names: Vec<String> = written
            .iter()
            .filter_map(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["tool.1", "tool-event.1", "tool-event-add.1"]);
        let add = std::fs::read_to_string(dir.join("tool-event-add.1")).expect("the add page");
        assert!(add.starts_with(".ie"), "roff: {add}");
        assert!(add.contains(".TH tool-event-add 1"), "title: {add}");
        assert!(
            add.contains("reduce") && add.contains("Cut share."),
            "{add}"
        );
        let top = std::fs::read_to_string(dir.join("tool.1")).expect("the top page");
        assert!(top.contains("Site config."), "{top}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
