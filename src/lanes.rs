//! The test suite in parallel lanes (`powerflex-test-lanes`, run by `scripts/test.sh`):
//! which test binaries cargo built, in what order to run them, and what they said.
//!
//! `cargo test` runs its test binaries one after another. Most of the suite's time is in
//! whole-system binaries that start a real Slurm cluster and then wait on simulated time
//! with the CPUs nearly idle (load average under 1), so running several binaries at once
//! cuts the wall time without starving any of them. Inside one binary the tests still
//! share the process's cluster turn ([`crate::slurm`]). Across binaries every cluster has
//! its own name (unique by the tests' convention, not by a lock), its own scratch
//! directory, and ports the kernel handed out fresh (bound to port 0 and released, so
//! another process could take one in between, as another test of the same binary could
//! before). Test users are created under a machine-wide lock; nested `cargo build`
//! freshness checks take turns on the target directory's lock.
//!
//! Why not cargo-nextest: it runs every test in a process of its own, which would drop
//! the per-process cluster turn (every Slurm test of a binary at once) and start each
//! binary's shared fixtures once per test. The lanes keep cargo's process model and only
//! overlap whole binaries.
//!
//! Pure: cargo's messages and the binaries' output in, the order and the counts out. The
//! binary in `src/bin/powerflex-test-lanes.rs` is the I/O edge.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

/// What went wrong before any test ran.
#[derive(Debug, thiserror::Error)]
pub enum LaneError {
    #[error("cannot read cargo's build messages: {0}")]
    Read(#[from] std::io::Error),
    #[error("cargo's build message on line {line} is not JSON cargo writes: {source}")]
    Message {
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}:{line}: expected `<package> <kind> <target> <seconds>`, got {text:?}")]
    Hint {
        path: String,
        line: usize,
        text: String,
    },
}

/// One test executable cargo built (a crate's unit tests, an integration test, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestBinary {
    /// The package's name (`powerflex-agent`).
    pub package: String,
    /// The target's kind as cargo names it (`lib`, `bin`, `test`, `bench`, `example`).
    pub kind: String,
    /// The target's name (`powerflexd`, `demo`).
    pub target: String,
    pub executable: PathBuf,
    /// The package's directory: `cargo test` runs a test binary there.
    pub package_dir: PathBuf,
}

impl TestBinary {
    /// `package kind target`: how logs, hints and the summary name the binary.
    pub fn label(&self) -> String {
        format!("{} {} {}", self.package, self.kind, self.target)
    }
}

/// The fields of cargo's `--message-format=json` lines that name a test executable;
/// serde skips the rest.
#[derive(Debug, Deserialize)]
struct CargoMessage {
    reason: String,
    #[serde(default)]
    manifest_path: Option<PathBuf>,
    #[serde(default)]
    target: Option<CargoTarget>,
    #[serde(default)]
    profile: Option<CargoProfile>,
    #[serde(default)]
    executable: Option<PathBuf>,
    #[serde(default)]
    package_id: Option<String>,
}

#[derive(Debug, Deserialize)]
struct CargoTarget {
    name: String,
    kind: Vec<String>,
}

#[derive(Debug, Deserialize)]
struct CargoProfile {
    test: bool,
}

/// The package name in a cargo package id: `path+file:///w/agent#powerflex-agent@0.1.0`
/// (cargo ≥ 1.77), `path+file:///w/core#0.1.0` (cargo leaves the name out when it is the
/// URL's last segment), or, from cargo before 1.77,
/// `powerflex-agent 0.1.0 (path+file:///w/agent)`.
fn package_name(package_id: &str) -> String {
    if let Some((url, fragment)) = package_id.rsplit_once('#') {
        return match fragment.split_once('@') {
            Some((name, _version)) => name.to_string(),
            None => url.rsplit('/').next().unwrap_or(url).to_string(),
        };
    }
    package_id
        .split_whitespace()
        .next()
        .unwrap_or(package_id)
        .to_string()
}

/// The test executables in cargo's JSON messages (`cargo test --no-run
/// --message-format=json`), in the order cargo reported them, each once.
pub fn test_binaries(messages: impl BufRead) -> Result<Vec<TestBinary>, LaneError> {
    let mut found: Vec<TestBinary> = Vec::new();
    for (index, line) in messages.lines().enumerate() {
        let line = line?;
        // cargo interleaves its JSON with nothing else, but a build script may print.
        if !line.starts_with('{') {
            continue;
        }
        let message: CargoMessage =
            serde_json::from_str(&line).map_err(|source| LaneError::Message {
                line: index + 1,
                source,
            })?;
        if message.reason != "compiler-artifact" {
            continue;
        }
        let (Some(executable), Some(target), Some(profile), Some(manifest)) = (
            message.executable,
            message.target,
            message.profile,
            message.manifest_path,
        ) else {
            continue;
        };
        if !profile.test {
            continue;
        }
        let package_dir = manifest
            .parent()
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("."));
        let package = package_name(message.package_id.as_deref().unwrap_or(""));
        let binary = TestBinary {
            package,
            kind: target.kind.first().cloned().unwrap_or_default(),
            target: target.name,
            executable,
            package_dir,
        };
        if !found.iter().any(|b| b.executable == binary.executable) {
            found.push(binary);
        }
    }
    Ok(found)
}

/// Expected seconds per binary label, from earlier runs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Hints(pub BTreeMap<String, f64>);

impl Hints {
    /// Parses `package kind target seconds` lines; `#` starts a comment.
    pub fn parse(path: &str, text: &str) -> Result<Hints, LaneError> {
        let mut hints = BTreeMap::new();
        for (index, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            let bad = || LaneError::Hint {
                path: path.to_string(),
                line: index + 1,
                text: raw.to_string(),
            };
            let [package, kind, target, seconds] = fields[..] else {
                return Err(bad());
            };
            let seconds: f64 = seconds.parse().map_err(|_| bad())?;
            if !seconds.is_finite() || seconds < 0.0 {
                return Err(bad());
            }
            hints.insert(format!("{package} {kind} {target}"), seconds);
        }
        Ok(Hints(hints))
    }

    /// The hints file's text for these measured times, longest first.
    pub fn render(times: &[(String, Duration)]) -> String {
        let mut sorted: Vec<&(String, Duration)> = times.iter().collect();
        sorted.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let mut text = String::from(
            "# powerflex-test-lanes: seconds each test binary took in the last run\n\
             # (<package> <kind> <target> <seconds>), longest first. Used to start the\n\
             # longest binaries first; a missing or stale line only changes the order.\n",
        );
        for (label, took) in sorted {
            text.push_str(&format!("{label} {:.1}\n", took.as_secs_f64()));
        }
        text
    }
}

/// The order to start `binaries` in: longest expected first (a binary no hint names is
/// taken as long, so a new whole-system test does not end up alone at the end), ties in
/// cargo's order. With lanes taking the next binary as they free up, longest-first keeps
/// the last lane to finish close to the others.
pub fn schedule(mut binaries: Vec<TestBinary>, hints: &Hints) -> Vec<TestBinary> {
    let unknown = hints.0.values().copied().fold(0.0_f64, f64::max);
    let expected = |b: &TestBinary| hints.0.get(&b.label()).copied().unwrap_or(unknown);
    // A stable sort keeps cargo's order among equals.
    binaries.sort_by(|a, b| expected(b).total_cmp(&expected(a)));
    binaries
}

/// What libtest's closing lines (`test result: ok. 3 passed; 0 failed; 1 ignored; ...`)
/// add up to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TestCounts {
    pub passed: u64,
    pub failed: u64,
    pub ignored: u64,
    /// Closing lines seen (one per libtest run; zero means the binary never finished).
    pub results: u64,
}

impl TestCounts {
    /// Adds up every `test result:` line in a binary's output.
    pub fn from_output(output: &str) -> TestCounts {
        let mut counts = TestCounts::default();
        for line in output.lines() {
            let Some(rest) = line.trim().strip_prefix("test result: ") else {
                continue;
            };
            counts.results += 1;
            for part in rest.split(';') {
                let mut words = part.split_whitespace().rev();
                let (Some(what), Some(number)) = (words.next(), words.next()) else {
                    continue;
                };
                let Ok(number) = number.parse::<u64>() else {
                    continue;
                };
                match what {
                    "passed" => counts.passed += number,
                    "failed" => counts.failed += number,
                    "ignored" => counts.ignored += number,
                    _ => {}
                }
            }
        }
        counts
    }

    pub fn add(&mut self, other: TestCounts) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.ignored += other.ignored;
        self.results += other.results;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn artifact(package_id: &str, manifest: &str, kind: &str, name: &str, exe: &str) -> String {
        serde_json::json!({
            "reason": "compiler-artifact",
            "package_id": package_id,
            "manifest_path": manifest,
            "target": {"name": name, "kind": [kind], "src_path": "x.rs"},
            "profile": {"test": true, "opt_level": "0"},
            "executable": exe,
            "fresh": true,
        })
        .to_string()
    }

    #[test]
    fn test_executables_are_read_from_cargos_messages_once_each() {
        let agent_lib = artifact(
            "path+file:///w/agent#powerflex-agent@0.1.0",
            "/w/agent/Cargo.toml",
            "lib",
            "powerflex_agent",
            "/w/target/debug/deps/powerflex_agent-1",
        );
        let lines = [
            agent_lib.clone(),
            // A library built for linking, not a test: no executable, profile.test false.
            serde_json::json!({
                "reason": "compiler-artifact",
                "package_id": "path+file:///w/core#powerflex-core@0.1.0",
                "manifest_path": "/w/core/Cargo.toml",
                "target": {"name": "powerflex_core", "kind": ["lib"]},
                "profile": {"test": false},
                "executable": null,
            })
            .to_string(),
            "build script output, not JSON".to_string(),
            serde_json::json!({"reason": "build-finished", "success": true}).to_string(),
            artifact(
                "path+file:///w/testbed#0.1.0",
                "/w/testbed/Cargo.toml",
                "test",
                "demo",
                "/w/target/debug/deps/demo-2",
            ),
            // The same artifact again (cargo reports a unit once per build it appears in).
            agent_lib,
        ]
        .join("\n");
        let found = test_binaries(lines.as_bytes()).expect("parsed");
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(found[0].label(), "powerflex-agent lib powerflex_agent");
        assert_eq!(found[0].package_dir, PathBuf::from("/w/agent"));
        assert_eq!(found[1].label(), "testbed test demo");
    }

    #[test]
    fn a_line_cargo_would_not_write_is_an_error_naming_its_line() {
        let err = test_binaries("{\"reason\": 3}\n".as_bytes()).expect_err("refused");
        assert!(err.to_string().contains("line 1"), "{err}");
    }

    fn binary(package: &str, target: &str) -> TestBinary {
        TestBinary {
            package: package.into(),
            kind: "test".into(),
            target: target.into(),
            executable: PathBuf::from(format!("/t/{target}")),
            package_dir: PathBuf::from("/t"),
        }
    }

    #[test]
    fn the_longest_binaries_start_first_and_unknown_ones_count_as_long() {
        let hints =
            Hints::parse("hints", "# comment\np test short 2\np test long 90.5\n").expect("hints");
        let order: Vec<String> = schedule(
            vec![
                binary("p", "short"),
                binary("p", "long"),
                binary("p", "new"),
                binary("p", "short2"),
            ],
            &hints,
        )
        .into_iter()
        .map(|b| b.target)
        .collect();
        assert_eq!(order, ["long", "new", "short2", "short"]);
    }

    #[test]
    fn a_bad_hint_line_names_the_file_and_line() {
        for bad in [
            "p test x",
            "p test x -1",
            "p test x NaN",
            "p test x 3 extra",
        ] {
            let err = Hints::parse("h.tsv", bad).expect_err(bad);
            assert!(err.to_string().starts_with("h.tsv:1:"), "{err}");
        }
    }

    #[test]
    fn rendered_hints_parse_back_longest_first() {
        let times = vec![
            ("a test x".to_string(), Duration::from_millis(1_500)),
            ("b lib y".to_string(), Duration::from_secs(120)),
        ];
        let text = Hints::render(&times);
        let first = text.lines().find(|l| !l.starts_with('#')).expect("a line");
        assert_eq!(first, "b lib y 120.0");
        let back = Hints::parse("h", &text).expect("parses");
        assert_eq!(back.0.get("a test x"), Some(&1.5));
    }

    #[test]
    fn libtest_closing_lines_add_up() {
        let out = "running 3 tests\n\
                   test a ... ok\n\
                   test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s\n\
                   \n\
                   test result: FAILED. 1 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out\n";
        let counts = TestCounts::from_output(out);
        assert_eq!(
            counts,
            TestCounts {
                passed: 4,
                failed: 2,
                ignored: 1,
                results: 2
            }
        );
        assert_eq!(TestCounts::from_output("thread panicked").results, 0);
    }
}
