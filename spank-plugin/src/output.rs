//! The line at the end of a batch job's own output: where the output is, and
//! appending one line to it with the job owner's credentials, never root's.
//!
//! Why this way (Slurm 22.05, `src/slurmd/slurmstepd/`): the batch script's stdout is a
//! file the task opened itself (`io.c`, `_init_task_stdio_fds`: an unlabelled output
//! file is opened for the task, which writes it directly), and slurmstepd closes its
//! copy once the task is forked (`mgr.c`, `io_close_task_fds`). So at
//! `slurm_spank_exit` — after `_wait_for_all_tasks` and the step's processes are
//! killed, before `batch_finish` reports the script's end — the file is complete and
//! nothing else writes it, but slurmstepd holds no descriptor of it and SPANK has no
//! item for its name. The name comes from Slurm's record of the job: `scontrol show
//! job`'s `StdOut=` line, which `slurm_get_job_stdout` (`src/api/job_info.c`) expands
//! for `%A %a %j %u %x` and the default `slurm-%j.out` in the working directory. A name
//! using patterns that only slurmstepd expands (`%N`, `%n`, `%t`, `%s`, `%J`, padded
//! `%4j`) names no file, and the line is skipped. `TaskEpilog` is no alternative: its
//! output is not the job's (`_run_script_as_user` redirects nothing to the task's files).

use std::ffi::CString;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Who the job runs as: the credentials the line is written with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (Slurm's `S_JOB_SUPPLEMENTARY_GIDS`): an output file in a
    /// project directory may be writable through one of them only.
    pub groups: Vec<u32>,
}

/// How often a child is looked at while the deadline runs.
const POLL: Duration = Duration::from_millis(2);

/// The most `scontrol show job` may print before it is cut off, bytes.
const MAX_SHOW_JOB_BYTES: u64 = 256 * 1024;

/// The job's standard output path in `scontrol show job` text: its own `   StdOut=`
/// line (every field after the first line sits on a line indented by three spaces, and
/// `StdOut=` is alone on its line). `None` when there is none or it is not absolute.
pub fn parse_stdout_path(show_job: &str) -> Option<PathBuf> {
    show_job
        .lines()
        .find_map(|l| l.strip_prefix("   StdOut="))
        .filter(|p| p.starts_with('/'))
        .map(PathBuf::from)
}

/// Asks Slurm where job `job_id`'s output goes: `scontrol show job`, a read-only query
/// run as root (slurmstepd's own user: a process of the job's owner could open a user
/// scontrol's pipe through `/proc/PID/fd` and hold it open), with the environment
/// cleared but for `SLURM_CONF` of this slurmstepd (root's, from slurmd; never the
/// job's, which the user wrote), all before `deadline`: the pipe is read without
/// blocking, so nothing that holds it open can hold slurmstepd.
pub fn stdout_path(job_id: u32, deadline: Instant) -> Result<PathBuf, String> {
    use std::os::fd::AsRawFd;
    let mut command = Command::new("scontrol");
    command
        .args(["show", "job", &job_id.to_string()])
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(conf) = std::env::var_os("SLURM_CONF") {
        command.env("SLURM_CONF", conf);
    }
    let mut child = command
        .spawn()
        .map_err(|e| format!("cannot run scontrol: {e}"))?;
    let Some(mut out) = child.stdout.take() else {
        let _ = child.kill();
        let _ = child.wait();
        return Err("scontrol's output pipe is missing".into());
    };
    // SAFETY: fcntl on a descriptor this function owns (the pipe's read end).
    let nonblocking = unsafe {
        let fd = out.as_raw_fd();
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
    };
    if !nonblocking {
        let _ = child.kill();
        let _ = child.wait();
        return Err("cannot make scontrol's pipe non-blocking".into());
    }
    let mut text = Vec::new();
    let mut chunk = [0u8; 8192];
    let mut exited = None;
    loop {
        // Drain what is there (the child may block on a full pipe otherwise).
        loop {
            match out.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => {
                    text.extend_from_slice(&chunk[..n]);
                    if text.len() as u64 > MAX_SHOW_JOB_BYTES {
                        let _ = child.kill();
                        let _ = child.wait();
                        return Err(format!("scontrol show job {job_id}: too much output"));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!("scontrol show job {job_id}: {e}"));
                }
            }
        }
        // Once it has exited and the pipe is drained, what it wrote is all read: a
        // write end held elsewhere is not waited for.
        if let Some(status) = exited {
            if status {
                break;
            }
            return Err(format!("scontrol show job {job_id} failed"));
        }
        match child.try_wait() {
            Ok(Some(status)) => exited = Some(status.success()),
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("scontrol show job {job_id}: no answer in time"));
            }
            Ok(None) => std::thread::sleep(POLL),
            Err(e) => return Err(format!("scontrol show job {job_id}: {e}")),
        }
    }
    let text = String::from_utf8_lossy(&text);
    parse_stdout_path(&text)
        .ok_or_else(|| format!("scontrol show job {job_id} names no absolute StdOut"))
}

/// Exit codes of the writing child beyond an `open` errno.
const FAILED_SETGROUPS: i32 = 201;
const FAILED_SETGID: i32 = 202;
const FAILED_SETUID: i32 = 203;
const NOT_A_FILE: i32 = 204;
const FAILED_WRITE: i32 = 205;
const FAILED_STAT: i32 = 206;

/// What a child's exit code says went wrong.
fn child_failure(code: i32) -> String {
    match code {
        FAILED_SETGROUPS | FAILED_SETGID | FAILED_SETUID => {
            "cannot take the job owner's credentials".into()
        }
        NOT_A_FILE => "it is not a regular file".into(),
        FAILED_WRITE => "the write failed".into(),
        FAILED_STAT => "cannot stat it".into(),
        errno => format!(
            "cannot open it as the job's owner: {}",
            std::io::Error::from_raw_os_error(errno)
        ),
    }
}

/// Appends `line` and a newline to the file at `path`, as `owner`, before `deadline`.
///
/// A child process takes the owner's groups, gid and uid, then opens the file
/// `O_WRONLY | O_APPEND | O_NOFOLLOW | O_NONBLOCK` — never creating it, never through a
/// symbolic link, never blocking on a FIFO — and writes only to a regular file. Root's
/// slurmstepd never opens the path itself, so the line lands only where the user could
/// have written it. The child does nothing but system calls between `fork` and `_exit`
/// (slurmstepd has threads); a child still running at the deadline is killed.
pub fn append_line(
    path: &Path,
    line: &str,
    owner: &Owner,
    deadline: Instant,
) -> Result<(), String> {
    if owner.uid == 0 {
        return Err("the job is root's: nothing is written as root".into());
    }
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| "the path holds a NUL byte".to_string())?;
    let mut bytes = line.replace(['\n', '\r', '\0'], " ").into_bytes();
    bytes.push(b'\n');
    let groups: Vec<libc::gid_t> = if owner.groups.is_empty() {
        vec![owner.gid]
    } else {
        owner.groups.clone()
    };
    let (uid, gid) = (owner.uid, owner.gid);
    // SAFETY: fork has no preconditions; the child below only makes system calls on
    // memory prepared before the fork, then _exits.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(format!("cannot fork: {}", std::io::Error::last_os_error()));
    }
    if pid == 0 {
        // SAFETY: all pointers point into buffers allocated before the fork, which the
        // child's copy of the memory still holds; each call's result is checked.
        unsafe {
            if libc::setgroups(groups.len(), groups.as_ptr()) != 0 {
                libc::_exit(FAILED_SETGROUPS);
            }
            if libc::setgid(gid) != 0 {
                libc::_exit(FAILED_SETGID);
            }
            if libc::setuid(uid) != 0 || libc::getuid() != uid || libc::geteuid() != uid {
                libc::_exit(FAILED_SETUID);
            }
            let fd = libc::open(
                c_path.as_ptr(),
                libc::O_WRONLY
                    | libc::O_APPEND
                    | libc::O_NOFOLLOW
                    | libc::O_NONBLOCK
                    | libc::O_NOCTTY
                    | libc::O_CLOEXEC,
            );
            if fd < 0 {
                let errno = *libc::__errno_location();
                libc::_exit(if (1..200).contains(&errno) {
                    errno
                } else {
                    libc::EIO
                });
            }
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut st) != 0 {
                libc::_exit(FAILED_STAT);
            }
            if st.st_mode & libc::S_IFMT != libc::S_IFREG {
                libc::_exit(NOT_A_FILE);
            }
            let mut done = 0usize;
            while done < bytes.len() {
                let n = libc::write(fd, bytes.as_ptr().add(done).cast(), bytes.len() - done);
                if n <= 0 {
                    if n < 0 && *libc::__errno_location() == libc::EINTR {
                        continue;
                    }
                    libc::_exit(FAILED_WRITE);
                }
                done += n as usize;
            }
            libc::_exit(0);
        }
    }
    let shown = path.display();
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: pid is this process's child; status is valid for the write.
        let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if rc == pid {
            if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
                return Ok(());
            }
            if libc::WIFEXITED(status) {
                return Err(format!(
                    "{shown}: {}",
                    child_failure(libc::WEXITSTATUS(status))
                ));
            }
            return Err(format!("{shown}: the writer ended abnormally ({status})"));
        }
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(format!("{shown}: cannot wait for the writer: {e}"));
        }
        if Instant::now() >= deadline {
            // SAFETY: pid is our child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            // Reaped now if it died at once; one stuck in the kernel (a hung network
            // file system) is left to init once slurmstepd exits, rather than held for.
            // SAFETY: as above.
            let _ = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            return Err(format!("{shown}: not written in time"));
        }
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stdout_path_is_slurm_s_own_line() {
        let text = "JobId=7 JobName=x StdOut=/forged\n   UserId=alice(1000) GroupId=alice(1000)\n   Comment=a StdOut=/forged2 \n   StdErr=/home/alice/out 7.txt\n   StdIn=/dev/null\n   StdOut=/home/alice/out 7.txt\n   Power=\n";
        assert_eq!(
            parse_stdout_path(text),
            Some(PathBuf::from("/home/alice/out 7.txt"))
        );
        assert_eq!(parse_stdout_path("JobId=7\n   StdOut=relative\n"), None);
        assert_eq!(parse_stdout_path("JobId=7 JobName=x\n"), None);
    }

    #[test]
    fn nothing_is_written_as_root() {
        let owner = Owner {
            uid: 0,
            gid: 0,
            groups: vec![],
        };
        let err = append_line(
            Path::new("/nonexistent"),
            "x",
            &owner,
            Instant::now() + Duration::from_secs(1),
        )
        .expect_err("root");
        assert!(err.contains("root"), "{err}");
    }

    /// As an unprivileged user (the test's own, or `nobody` when the test runs as root):
    /// the line is appended, a missing file is not created, a symbolic link is not
    /// followed, a FIFO is not written.
    #[test]
    fn a_line_is_appended_only_to_an_existing_regular_file() {
        // SAFETY: no preconditions.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let (uid, gid) = if uid == 0 { (65534, 65534) } else { (uid, gid) };
        let dir = std::env::temp_dir().join(format!("pf-eoj-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).expect("chown");
        let owner = Owner {
            uid,
            gid,
            groups: vec![],
        };
        let soon = || Instant::now() + Duration::from_secs(5);
        let out = dir.join("job.out");
        std::fs::write(&out, "hello\n").expect("write");
        std::os::unix::fs::chown(&out, Some(uid), Some(gid)).expect("chown");
        // A file of root's beside it, which the owner may not write.
        let roots = dir.join("root.out");
        std::fs::write(&roots, "").expect("write");
        // SAFETY: no preconditions.
        if unsafe { libc::getuid() } == 0 {
            let err = append_line(&roots, "x", &owner, Instant::now() + Duration::from_secs(5))
                .expect_err("root's file");
            assert!(err.contains("Permission denied"), "{err}");
            assert_eq!(std::fs::read_to_string(&roots).expect("read"), "");
        }
        append_line(&out, "powerflex: one line", &owner, soon()).expect("appended");
        assert_eq!(
            std::fs::read_to_string(&out).expect("read"),
            "hello\npowerflex: one line\n"
        );
        let missing = dir.join("missing.out");
        let err = append_line(&missing, "x", &owner, soon()).expect_err("missing");
        assert!(err.contains("No such file"), "{err}");
        assert!(!missing.exists(), "never created");
        let link = dir.join("link.out");
        std::os::unix::fs::symlink(&out, &link).expect("symlink");
        assert!(
            append_line(&link, "x", &owner, soon()).is_err(),
            "through a link"
        );
        let fifo = CString::new(dir.join("fifo").as_os_str().as_bytes()).expect("c");
        // SAFETY: valid C string.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        std::os::unix::fs::chown(dir.join("fifo"), Some(uid), Some(gid)).expect("chown");
        let t = Instant::now();
        assert!(append_line(&dir.join("fifo"), "x", &owner, soon()).is_err());
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "a FIFO does not block"
        );
        assert_eq!(
            std::fs::read_to_string(&out).expect("read"),
            "hello\npowerflex: one line\n",
            "nothing else was written"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
