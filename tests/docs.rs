//! The docs against the code, so a doc that drifts fails CI:
//!
//! - `docs/reference/config.md` and `metrics.md` are exactly what `powerflexctl
//!   reference` prints from the config types and the metrics catalog;
//! - every ```toml block of the README and `docs/` loads as a site config: a whole file
//!   as it is, a fragment laid over the annotated example `slurm-conf/powerflex.toml`;
//! - every command line of a ```console block that names one of powerflex's binaries is
//!   accepted by that binary's own parser (run with `--help` after it, which exits 0 only
//!   when everything before it parses); the offline ones that need no controller are run
//!   for real;
//! - every `sbatch --power-flex=VALUE` there is accepted by the plugin's grammar on the
//!   example site's tiers, unless the line says `# refused`, and then it is refused;
//! - every other line that starts with one of those binaries (the synopses in ```text
//!   blocks) names only subcommands and `--flags` that binary's `--help` lists;
//! - every ```json block is a progress report the agent accepts;
//! - every fence says what it holds (no block without a language is left unchecked by
//!   accident);
//! - every `bash scripts/NAME` anywhere names a script that exists.

use std::path::{Path, PathBuf};
use std::process::Command;

use powerflex::{binary, repo_root};
use powerflex_core::config::SiteConfig;
use powerflex_core::flex::parse_power_flex;

/// The Markdown files whose blocks are checked.
fn doc_files() -> Vec<PathBuf> {
    let mut files = vec![repo_root().join("README.md")];
    for dir in ["docs", "docs/reference"] {
        let mut found: Vec<PathBuf> = std::fs::read_dir(repo_root().join(dir))
            .expect("docs/")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "md"))
            .collect();
        found.sort();
        files.extend(found);
    }
    files
}

/// One fenced block: its info string, first line number and text.
struct Block {
    file: String,
    line: usize,
    lang: String,
    text: String,
}

fn blocks(path: &Path) -> Vec<Block> {
    let text = std::fs::read_to_string(path).expect("a doc file");
    let file = path
        .strip_prefix(repo_root())
        .unwrap_or(path)
        .display()
        .to_string();
    let mut out = Vec::new();
    let mut open: Option<Block> = None;
    for (i, line) in text.lines().enumerate() {
        let fence = line.trim_start().starts_with("```");
        match (&mut open, fence) {
            (None, true) => {
                open = Some(Block {
                    file: file.clone(),
                    line: i + 1,
                    lang: line.trim_start().trim_start_matches('`').trim().to_string(),
                    text: String::new(),
                })
            }
            (Some(_), true) => out.extend(open.take()),
            (Some(block), false) => {
                block.text.push_str(line);
                block.text.push('\n');
            }
            (None, false) => {}
        }
    }
    out
}

/// The annotated example site config, every key set.
fn example() -> String {
    std::fs::read_to_string(repo_root().join("slurm-conf/powerflex.toml")).expect("the example")
}

/// `fragment`'s tables and keys laid over `base` (a fragment's key replaces the base's).
fn overlay(base: &mut toml::Table, fragment: &toml::Table) {
    for (key, value) in fragment {
        match (base.get_mut(key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(f)) => overlay(b, f),
            _ => {
                base.insert(key.clone(), value.clone());
            }
        }
    }
}

/// `docs/reference/TOPIC.md` against `powerflexctl reference TOPIC`.
fn reference_matches(topic: &str, source: &str) {
    let out = Command::new(binary("powerflexctl"))
        .args(["reference", topic, "--format", "markdown"])
        .output()
        .expect("powerflexctl reference");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let generated = String::from_utf8_lossy(&out.stdout);
    let path = format!("docs/reference/{topic}.md");
    let committed = std::fs::read_to_string(repo_root().join(&path)).expect("the reference");
    assert!(
        generated == committed,
        "{path} differs from {source}; regenerate it: \
         target/debug/powerflexctl reference {topic} > {path}"
    );
}

#[test]
fn the_config_reference_is_what_the_types_say() {
    reference_matches("config", "the config types");
}

#[test]
fn the_metrics_reference_is_what_the_catalog_says() {
    reference_matches("metrics", "the metrics catalog");
}

#[test]
fn every_toml_block_loads_as_a_site_config() {
    let mut checked = 0;
    for path in doc_files() {
        for block in blocks(&path).into_iter().filter(|b| b.lang == "toml") {
            let at = format!("{}:{}", block.file, block.line);
            let fragment: toml::Table = block
                .text
                .parse()
                .unwrap_or_else(|e| panic!("{at}: not TOML: {e}"));
            let whole = fragment.contains_key("facility") && fragment.contains_key("controller");
            let text = if whole {
                block.text.clone()
            } else {
                let mut base: toml::Table = example().parse().expect("the example parses");
                overlay(&mut base, &fragment);
                toml::to_string(&base).expect("TOML out")
            };
            if let Err(e) = SiteConfig::from_toml_str(&text) {
                panic!(
                    "{at}: the site config refuses this block: {e}\n{}",
                    block.text
                );
            }
            checked += 1;
        }
    }
    // The example itself is the largest block of all.
    SiteConfig::from_toml_str(&example()).expect("slurm-conf/powerflex.toml loads");
    println!("{checked} TOML blocks load");
}

/// A console line's command words, prompt and trailing comment removed.
fn command_words(line: &str) -> Option<(Vec<String>, bool)> {
    let line = line.trim();
    let rest = line
        .strip_prefix("$ ")
        .or_else(|| line.strip_prefix("# "))?;
    let (command, comment) = match rest.split_once("  #") {
        Some((c, comment)) => (c, comment),
        None => (rest, ""),
    };
    let refused = comment.contains("refused");
    Some((shell_words(command), refused))
}

/// Splits a command line as a shell would for the simple lines docs hold: spaces, with
/// single or double quotes grouping.
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quote = None;
    let mut any = false;
    for c in line.chars() {
        match (quote, c) {
            (None, '\'' | '"') => {
                quote = Some(c);
                any = true;
            }
            (Some(q), c) if c == q => quote = None,
            (None, ' ') => {
                if any {
                    words.push(std::mem::take(&mut word));
                    any = false;
                }
            }
            (_, c) => {
                word.push(c);
                any = true;
            }
        }
    }
    if any {
        words.push(word);
    }
    words
}

/// powerflexctl subcommands that need no controller: run for real.
const OFFLINE: &[&str] = &["pfi", "allocate", "evaluate", "synth-curves", "reference"];

#[test]
fn every_documented_command_line_parses_and_offline_ones_run() {
    let tiers = SiteConfig::from_toml_str(&example())
        .expect("the example loads")
        .tiers
        .table;
    let mut checked = 0;
    for path in doc_files() {
        for block in blocks(&path).into_iter().filter(|b| b.lang == "console") {
            for (offset, line) in block.text.lines().enumerate() {
                let at = format!("{}:{}", block.file, block.line + 1 + offset);
                let Some((words, refused)) = command_words(line) else {
                    continue;
                };
                let Some(program) = words.first() else {
                    continue;
                };
                match program.as_str() {
                    "powerflexctl" | "powerflexd" | "powerflex-ctld" | "powerflex-grid" => {
                        let offline = program == "powerflexctl"
                            && words.get(1).is_some_and(|w| OFFLINE.contains(&w.as_str()));
                        let mut command = Command::new(binary(program));
                        command.args(&words[1..]).current_dir(repo_root());
                        if !offline {
                            command.arg("--help");
                        }
                        let out = command.output().expect("the binary runs");
                        assert!(
                            out.status.success(),
                            "{at}: `{line}` is not accepted by {program}: {}",
                            String::from_utf8_lossy(&out.stderr)
                        );
                        checked += 1;
                    }
                    "sbatch" | "srun" | "salloc" => {
                        for word in &words {
                            if let Some(value) = word.strip_prefix("--power-flex=") {
                                let parsed = parse_power_flex(value, &tiers);
                                assert_eq!(
                                    parsed.is_err(),
                                    refused,
                                    "{at}: --power-flex={value} is {} by the grammar, and the line says {}",
                                    if parsed.is_err() { "refused" } else { "accepted" },
                                    if refused { "refused" } else { "nothing" }
                                );
                                checked += 1;
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    assert!(
        checked >= 10,
        "only {checked} command lines found in the docs' console blocks"
    );
    println!("{checked} command lines checked");
}

#[test]
fn every_fence_says_what_it_holds() {
    const KNOWN: &[&str] = &["console", "text", "toml", "json", "sql"];
    for path in doc_files() {
        for block in blocks(&path) {
            assert!(
                KNOWN.contains(&block.lang.as_str()),
                "{}:{}: a fence with {:?}; accepted: {KNOWN:?}",
                block.file,
                block.line,
                block.lang
            );
        }
    }
}

#[test]
fn every_json_block_is_a_progress_report_the_agent_accepts() {
    for path in doc_files() {
        for block in blocks(&path).into_iter().filter(|b| b.lang == "json") {
            for line in block.text.lines().filter(|l| !l.trim().is_empty()) {
                if let Err(e) = powerflex_proto::ProgressReport::from_line(line) {
                    panic!("{}:{}: {line}: {e}", block.file, block.line);
                }
            }
        }
    }
}

const BINARIES: &[&str] = &[
    "powerflexctl",
    "powerflexd",
    "powerflex-ctld",
    "powerflex-grid",
];

/// The `--flags` a `--help` output names.
fn flags_in(help: &str) -> Vec<String> {
    let mut flags = Vec::new();
    for (at, _) in help.match_indices("--") {
        let flag: String = help[at..]
            .chars()
            .skip(2)
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
            .collect();
        if !flag.is_empty() {
            flags.push(flag);
        }
    }
    flags
}

#[test]
fn every_synopsis_names_real_subcommands_and_flags() {
    let mut checked = 0;
    for path in doc_files() {
        for block in blocks(&path).into_iter().filter(|b| b.lang == "text") {
            for (offset, line) in block.text.lines().enumerate() {
                let at = format!("{}:{}", block.file, block.line + 1 + offset);
                let words: Vec<&str> = line.split_whitespace().collect();
                let Some(program) = words.first().filter(|w| BINARIES.contains(w)) else {
                    continue;
                };
                // The subcommand path: the plain words after the binary.
                let path_words: Vec<&str> = words[1..]
                    .iter()
                    .take_while(|w| {
                        w.chars().all(|c| c.is_ascii_lowercase() || c == '-') && !w.starts_with('-')
                    })
                    .copied()
                    .collect();
                let help = Command::new(binary(program))
                    .args(&path_words)
                    .arg("--help")
                    .output()
                    .expect("the binary runs");
                assert!(
                    help.status.success(),
                    "{at}: `{program} {}` is not a command: {}",
                    path_words.join(" "),
                    String::from_utf8_lossy(&help.stderr)
                );
                let known = flags_in(&String::from_utf8_lossy(&help.stdout));
                // The line's own comment may name other commands' flags.
                let code = line.split("  #").next().unwrap_or(line);
                for flag in flags_in(code) {
                    assert!(
                        known.contains(&flag),
                        "{at}: `{program} {}` has no --{flag}; it has: {known:?}",
                        path_words.join(" ")
                    );
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 5, "only {checked} synopsis lines found");
    println!("{checked} synopsis lines checked");
}

#[test]
fn every_script_the_docs_name_exists() {
    for path in doc_files() {
        let text = std::fs::read_to_string(&path).expect("a doc file");
        for (i, line) in text.lines().enumerate() {
            for (at, _) in line.match_indices("scripts/") {
                let name: String = line[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || "/._-".contains(*c))
                    .collect();
                if !name.ends_with(".sh") && !name.ends_with(".py") {
                    continue;
                }
                assert!(
                    repo_root().join(&name).is_file(),
                    "{}:{}: {name} does not exist",
                    path.display(),
                    i + 1
                );
            }
        }
    }
}
