//! `powerflex-test-lanes`: builds the workspace's test binaries and runs them in parallel
//! lanes (the `cargo test` step of `scripts/test.sh`). See `powerflex::lanes` for
//! why and how; this file is the I/O edge: cargo, processes, logs and the clock.
//!
//! Each binary runs where `cargo test` would run it (its package's directory, with
//! cargo's `CARGO*` variables), in a process group of its own, its output in a log file
//! under `--log-dir`. A finished binary prints one line (and its whole log when it
//! failed); every `--progress-s` the runner says what is still running. A binary past
//! `--timeout-s` is killed with its process group, and so is every process still carrying
//! its marker (`POWERFLEX_TEST_LANE` in the environment: the Slurm daemons its tests
//! started leave the group with `setsid`, but keep the variable). Marked processes left
//! when a binary ends are killed and reported too. SIGTERM or SIGINT ends every running
//! binary the same way before the runner exits. A binary passes only when it exits 0,
//! printed at least one libtest `test result:` line and counted no failure. The last line
//! is `tests: N passed, N failed, N skipped`; the exit status is 0 only when every binary
//! passed.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io::{BufReader, Read as _};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use clap::Parser;
use powerflex::lanes::{schedule, test_binaries, Hints, TestBinary, TestCounts};
use powerflex::slurm;

#[derive(Debug, Parser)]
#[command(
    name = "powerflex-test-lanes",
    about = "Build the workspace's tests and run their binaries in parallel lanes"
)]
struct Args {
    /// How many test binaries run at once.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=32))]
    lanes: u16,
    /// A binary still running after this many seconds is killed (with its process group)
    /// and counts as failed.
    #[arg(long, default_value_t = 1500)]
    timeout_s: u64,
    /// How often to print what is still running, in seconds.
    #[arg(long, default_value_t = 60)]
    progress_s: u64,
    /// Expected seconds per binary (`<package> <kind> <target> <seconds>` lines): the
    /// longest start first. Missing file: cargo's order.
    #[arg(long, default_value = ".ci/test-times.tsv")]
    hints: PathBuf,
    /// Where each binary's log and this run's times (`times.tsv`) go.
    #[arg(long, default_value = "target/test-lanes")]
    log_dir: PathBuf,
    /// Extra arguments for `cargo test --no-run` (e.g. `--workspace`).
    #[arg(last = true)]
    cargo_args: Vec<String>,
}

/// The environment variable that marks every process a test binary starts.
const MARKER_VAR: &str = "POWERFLEX_TEST_LANE";

/// A binary in a lane now.
#[derive(Debug)]
struct Running {
    label: String,
    since: Instant,
    /// Its PID, which is also its process group's id, once it has started.
    pid: Option<u32>,
}

/// The running binaries, by marker value.
type RunningSet = Arc<Mutex<BTreeMap<String, Running>>>;

/// How one binary ended.
#[derive(Debug)]
struct Finished {
    label: String,
    took: Duration,
    passed: bool,
    counts: TestCounts,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(message) => {
            eprintln!("powerflex-test-lanes: {message}");
            ExitCode::from(2)
        }
    }
}

fn run(args: &Args) -> Result<bool, String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    eprintln!("powerflex-test-lanes: building the test binaries (cargo test --no-run)");
    let built = powerflex::cargo_command()
        .args([
            "test",
            "--no-run",
            "--message-format=json-render-diagnostics",
        ])
        .args(&args.cargo_args)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !built.status.success() {
        return Err(format!("cargo test --no-run failed ({})", built.status));
    }
    let binaries = test_binaries(built.stdout.as_slice()).map_err(|e| e.to_string())?;
    if binaries.is_empty() {
        return Err("cargo built no test binary".to_string());
    }
    let hints = match std::fs::read_to_string(&args.hints) {
        Ok(text) => {
            Hints::parse(&args.hints.display().to_string(), &text).map_err(|e| e.to_string())?
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Hints::default(),
        Err(e) => return Err(format!("cannot read {}: {e}", args.hints.display())),
    };
    std::fs::create_dir_all(&args.log_dir)
        .map_err(|e| format!("cannot create {}: {e}", args.log_dir.display()))?;
    let log_dir = std::fs::canonicalize(&args.log_dir)
        .map_err(|e| format!("{}: {e}", args.log_dir.display()))?;
    let profile_dir = powerflex::profile_dir();
    let queue: VecDeque<TestBinary> = schedule(binaries, &hints).into();
    let total = queue.len();
    let lanes = usize::from(args.lanes).min(total);
    eprintln!(
        "powerflex-test-lanes: {total} test binaries in {lanes} lanes (logs in {})",
        log_dir.display()
    );

    let queue = Arc::new(Mutex::new(queue));
    let running: RunningSet = Arc::default();
    let stop_signal = powerflex_daemon::signals::stop_signal_cell().map_err(|e| e.to_string())?;
    let finished: Arc<Mutex<Vec<Finished>>> = Arc::default();
    let started = Instant::now();
    let timeout = Duration::from_secs(args.timeout_s);
    let workers: Vec<_> = (0..lanes)
        .map(|_| {
            let (queue, running, finished) = (queue.clone(), running.clone(), finished.clone());
            let (log_dir, profile_dir, cargo) =
                (log_dir.clone(), profile_dir.clone(), cargo.clone());
            thread::spawn(move || loop {
                let Some(binary) = queue
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .pop_front()
                else {
                    return;
                };
                let done = run_one(&binary, &log_dir, &profile_dir, &cargo, timeout, &running);
                finished
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(done);
            })
        })
        .collect();

    let progress = Duration::from_secs(args.progress_s.max(1));
    let mut next_progress = Instant::now() + progress;
    while workers.iter().any(|w| !w.is_finished()) {
        thread::sleep(Duration::from_millis(200));
        let signal = stop_signal.load(std::sync::atomic::Ordering::SeqCst);
        if signal != 0 {
            // No new binary starts; every running one ends with what it started.
            queue.lock().unwrap_or_else(PoisonError::into_inner).clear();
            let running = running.lock().unwrap_or_else(PoisonError::into_inner);
            for (marker, r) in running.iter() {
                eprintln!("powerflex-test-lanes: signal {signal}: ending {}", r.label);
                end_binary(r.pid, marker);
            }
            return Err(format!("stopped by signal {signal}"));
        }
        if Instant::now() >= next_progress {
            next_progress += progress;
            let now = Instant::now();
            let still: Vec<String> = running
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .values()
                .map(|r| format!("{} ({} s)", r.label, (now - r.since).as_secs()))
                .collect();
            let queued = queue.lock().unwrap_or_else(PoisonError::into_inner).len();
            let done = finished
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .len();
            eprintln!(
                "powerflex-test-lanes: {} s: {done}/{total} done, {queued} queued; running: {}",
                started.elapsed().as_secs(),
                still.join(", ")
            );
        }
    }
    for w in workers {
        w.join()
            .map_err(|_| "a lane's thread panicked".to_string())?;
    }

    let finished = std::mem::take(&mut *finished.lock().unwrap_or_else(PoisonError::into_inner));
    let times: Vec<(String, Duration)> =
        finished.iter().map(|f| (f.label.clone(), f.took)).collect();
    let times_path = log_dir.join("times.tsv");
    if let Err(e) = std::fs::write(&times_path, Hints::render(&times)) {
        eprintln!(
            "powerflex-test-lanes: cannot write {}: {e}",
            times_path.display()
        );
    }
    let mut counts = TestCounts::default();
    let mut failed = Vec::new();
    for f in &finished {
        counts.add(f.counts);
        if !f.passed {
            failed.push(f.label.clone());
        }
    }
    let busy: Duration = times.iter().map(|(_, t)| *t).sum();
    eprintln!(
        "powerflex-test-lanes: {total} binaries in {:.1} s wall, {:.1} s of binary time \
         ({lanes} lanes); times in {}",
        started.elapsed().as_secs_f64(),
        busy.as_secs_f64(),
        times_path.display()
    );
    if !failed.is_empty() {
        eprintln!("powerflex-test-lanes: FAILED: {}", failed.join(", "));
    }
    println!(
        "tests: {} passed, {} failed, {} skipped",
        counts.passed, counts.failed, counts.ignored
    );
    Ok(failed.is_empty())
}

/// Runs one test binary to its end (or its timeout) and prints how it went.
fn run_one(
    binary: &TestBinary,
    log_dir: &Path,
    profile_dir: &Path,
    cargo: &std::ffi::OsStr,
    timeout: Duration,
    running: &RunningSet,
) -> Finished {
    let label = binary.label();
    let log_path = log_dir.join(format!("{}.log", label.replace(' ', "-")));
    let marker = format!("{}-{}", std::process::id(), label.replace(' ', "-"));
    running
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(
            marker.clone(),
            Running {
                label: label.clone(),
                since: Instant::now(),
                pid: None,
            },
        );
    let started = Instant::now();
    let outcome = spawn_and_wait(
        binary,
        &log_path,
        profile_dir,
        cargo,
        timeout,
        &marker,
        running,
    );
    let took = started.elapsed();
    // Whatever the binary left running carries its marker: a test that stops its
    // daemons leaves none.
    let leftovers = kill_marked(&marker);
    running
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(&marker);
    let output = read_log(&log_path);
    let counts = TestCounts::from_output(&output);
    let (passed, mut why) = match outcome {
        Ok(status) if !status.success() => (false, status.to_string()),
        Ok(_) if counts.failed > 0 => (false, format!("{} failed", counts.failed)),
        Ok(_) if counts.results == 0 => (false, "no libtest `test result:` line".to_string()),
        Ok(_) => (true, String::new()),
        Err(why) => (false, why),
    };
    if !leftovers.is_empty() {
        let note = format!("killed processes it left running: {leftovers:?}");
        why = if why.is_empty() {
            note
        } else {
            format!("{why}; {note}")
        };
    }
    let line = format!(
        "{} {:>7.1} s  {label}  ({} passed, {} failed, {} ignored){}",
        if passed { "PASS" } else { "FAIL" },
        took.as_secs_f64(),
        counts.passed,
        counts.failed,
        counts.ignored,
        if why.is_empty() {
            String::new()
        } else {
            format!(": {why}")
        }
    );
    if passed {
        eprintln!("{line}");
    } else {
        // One write, so a failure's log is not interleaved with another lane's lines.
        eprintln!(
            "{line}\n---- {label}: {} ----\n{output}\n---- end of {label} ----",
            log_path.display()
        );
    }
    Finished {
        label,
        took,
        passed,
        counts,
    }
}

fn spawn_and_wait(
    binary: &TestBinary,
    log_path: &Path,
    profile_dir: &Path,
    cargo: &std::ffi::OsStr,
    timeout: Duration,
    marker: &str,
    running: &RunningSet,
) -> Result<std::process::ExitStatus, String> {
    use std::os::unix::process::CommandExt as _;
    let log = File::create(log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
    let log_err = log
        .try_clone()
        .map_err(|e| format!("{}: {e}", log_path.display()))?;
    // As `cargo test` runs a test binary: in its package's directory, with the package's
    // CARGO_* variables and the profile's library directories on the loader's path.
    let mut library_path = format!(
        "{}:{}",
        profile_dir.join("deps").display(),
        profile_dir.display()
    );
    // An empty entry would put the working directory on the loader's path.
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|v| !v.is_empty()) {
        library_path.push(':');
        library_path.push_str(&old.to_string_lossy());
    }
    let mut child = Command::new(&binary.executable)
        .current_dir(&binary.package_dir)
        .env("CARGO", cargo)
        .env("CARGO_MANIFEST_DIR", &binary.package_dir)
        .env("CARGO_PKG_NAME", &binary.package)
        .env("LD_LIBRARY_PATH", library_path)
        .env(MARKER_VAR, marker)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err)
        .process_group(0)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", binary.executable.display()))?;
    if let Some(r) = running
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_mut(marker)
    {
        r.pid = Some(child.id());
    }
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Ok(status),
            Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(100)),
            Ok(None) => {
                end_binary(Some(child.id()), marker);
                let _ = child.wait();
                return Err(format!(
                    "killed after {} s (--timeout-s)",
                    timeout.as_secs()
                ));
            }
            Err(e) => return Err(format!("cannot wait for the binary: {e}")),
        }
    }
}

/// Ends a binary and what it started: SIGKILL to the process group this runner made
/// for it (its PID), then to every process carrying its marker. Nothing found by name.
fn end_binary(pid: Option<u32>, marker: &str) {
    if let Some(group) = pid
        .and_then(|p| i32::try_from(p).ok())
        .and_then(rustix::process::Pid::from_raw)
    {
        let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
    }
    kill_marked(marker);
}

/// SIGKILLs every process (but this one) whose environment holds `MARKER_VAR=marker`;
/// their PIDs. Only processes this runner's binaries started carry it. (`slurmstepd`
/// rewrites its environment and is not found this way; the test bed reaps those by
/// cluster directory when a cluster of that name next starts.)
fn kill_marked(marker: &str) -> Vec<u32> {
    let wanted = format!("{MARKER_VAR}={marker}");
    let marked: Vec<u32> = slurm::other_live_pids()
        .into_iter()
        .filter(|&pid| slurm::environ_holds(pid, &wanted))
        .collect();
    for &pid in &marked {
        let _ = powerflex_daemon::os::kill(pid, powerflex_daemon::os::Signal::KILL);
    }
    marked
}

fn read_log(path: &Path) -> String {
    let mut text = String::new();
    if let Ok(file) = File::open(path) {
        let mut bytes = Vec::new();
        let _ = BufReader::new(file).read_to_end(&mut bytes);
        text = String::from_utf8_lossy(&bytes).into_owned();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process that left the binary's process group (as slurmd does with `setsid`) is
    /// still found by its marker and ended.
    #[test]
    fn a_marked_process_outside_the_group_is_found_and_killed() {
        let marker = format!("selftest-{}", std::process::id());
        let mut child = Command::new("setsid")
            .args(["sleep", "60"])
            .env(MARKER_VAR, &marker)
            .spawn()
            .expect("setsid sleep");
        // setsid execs sleep in place (the child is not a group leader), so the PID is
        // sleep's; wait until its environment is readable.
        let environ = format!("/proc/{}/environ", child.id());
        let deadline = Instant::now() + Duration::from_secs(5);
        while !std::fs::read(&environ).is_ok_and(|e| !e.is_empty()) {
            assert!(Instant::now() < deadline, "sleep did not start");
            thread::sleep(Duration::from_millis(20));
        }
        let killed = kill_marked(&marker);
        assert_eq!(killed, vec![child.id()]);
        let status = child.wait().expect("reaped");
        assert!(!status.success(), "{status}");
        assert!(kill_marked(&marker).is_empty(), "nothing left to kill");
    }
}
