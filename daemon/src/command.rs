//! Running a site command (`squeue`, `sinfo`, `scontrol`) with a deadline: a wedged
//! `slurmctld` must never hold a daemon's loop or start. The output is read while the
//! command runs (a big `squeue --json` would otherwise fill the pipe and never exit),
//! and at most `max_bytes` of it are kept. The command runs in a process group of its
//! own, and the whole group is killed at the deadline: a wrapper's child holding the
//! pipe open cannot keep the caller waiting.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::DaemonError;

/// What a command left when it did not give its output.
fn failed(program: &str, why: String) -> DaemonError {
    DaemonError::Command {
        program: program.to_string(),
        why,
    }
}

/// Runs `program args` with `envs` added, and returns its standard output once it exits
/// successfully within `deadline`. A command still running at the deadline is killed
/// with its process group and reaped; output beyond `max_bytes` is drained and the call
/// fails.
pub fn output_within(
    program: &str,
    args: &[&str],
    envs: &[(&str, &str)],
    deadline: Duration,
    max_bytes: usize,
) -> Result<Vec<u8>, DaemonError> {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn().map_err(|source| DaemonError::Io {
        what: "cannot start",
        path: program.to_string(),
        source,
    })?;
    let mut stdout = child
        .stdout
        .take()
        .ok_or_else(|| failed(program, "no stdout".into()))?;
    let mut stderr = child
        .stderr
        .take()
        .ok_or_else(|| failed(program, "no stderr".into()))?;
    let limit = max_bytes as u64 + 1;
    let reader = std::thread::Builder::new()
        .name("cmd-stdout".into())
        .spawn(move || {
            let mut out = Vec::new();
            let r = (&mut stdout).take(limit).read_to_end(&mut out);
            // Keep draining so the command is never blocked on a full pipe before the
            // deadline kills it.
            let _ = std::io::copy(&mut stdout, &mut std::io::sink());
            r.map(|_| out)
        })
        .map_err(|e| failed(program, format!("cannot start a reader thread: {e}")))?;
    let err_reader = std::thread::Builder::new()
        .name("cmd-stderr".into())
        .spawn(move || {
            let mut out = Vec::new();
            let _ = (&mut stderr).take(4096).read_to_end(&mut out);
            let _ = std::io::copy(&mut stderr, &mut std::io::sink());
            out
        })
        .map_err(|e| failed(program, format!("cannot start a reader thread: {e}")))?;
    let until = Instant::now() + deadline;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => break Err(format!("no answer within {:.1} s", deadline.as_secs_f64())),
            Err(e) => break Err(format!("cannot wait for it: {e}")),
        }
    };
    if status.is_err() {
        // The command this function started, and the group it leads (its pid).
        if let Some(group) = i32::try_from(child.id())
            .ok()
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    let out = reader.join().unwrap_or_else(|_| Ok(Vec::new()));
    let err = err_reader.join().unwrap_or_default();
    let status = status.map_err(|why| failed(program, why))?;
    if !status.success() {
        let text = String::from_utf8_lossy(&err);
        return Err(failed(
            program,
            format!("{status}: {}", text.trim().lines().last().unwrap_or("")),
        ));
    }
    let out = out.map_err(|e| failed(program, format!("cannot read its output: {e}")))?;
    if out.len() > max_bytes {
        return Err(failed(
            program,
            format!("more than {max_bytes} bytes of output"),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_deadline_size_and_failure() {
        let out = output_within(
            "sh",
            &["-c", "echo $X"],
            &[("X", "hi")],
            Duration::from_secs(5),
            100,
        )
        .expect("runs");
        assert_eq!(out, b"hi\n");
        // Output far beyond a pipe's buffer is read while the command runs.
        let out = output_within(
            "sh",
            &["-c", "head -c 1000000 /dev/zero"],
            &[],
            Duration::from_secs(10),
            2_000_000,
        )
        .expect("big output");
        assert_eq!(out.len(), 1_000_000);
        let t = Instant::now();
        let e = output_within("sleep", &["30"], &[], Duration::from_millis(200), 100)
            .expect_err("killed at the deadline");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        // A child of the command holding its stdout dies with the group.
        let t = Instant::now();
        let e2 = output_within(
            "sh",
            &["-c", "sleep 30 & sleep 30"],
            &[],
            Duration::from_millis(200),
            100,
        )
        .expect_err("killed at the deadline");
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{:?} {e2}",
            t.elapsed()
        );
        assert!(e.to_string().contains("no answer within 0.2 s"), "{e}");
        let e = output_within(
            "sh",
            &["-c", "echo nope >&2; exit 3"],
            &[],
            Duration::from_secs(5),
            100,
        )
        .expect_err("fails");
        assert!(e.to_string().contains("nope"), "{e}");
        let e = output_within(
            "sh",
            &["-c", "head -c 1000 /dev/zero"],
            &[],
            Duration::from_secs(5),
            100,
        )
        .expect_err("too big");
        assert!(e.to_string().contains("more than 100 bytes"), "{e}");
        assert!(matches!(
            output_within("/nonexistent/cmd", &[], &[], Duration::from_secs(1), 10),
            Err(DaemonError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound
        ));
    }
}
