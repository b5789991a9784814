//! The few system calls the daemons and the testbed need, through `rustix` (no `unsafe`,
//! no `kill` subprocess): signalling a process by PID, an exclusive `flock`, and the
//! kernel-recorded credentials of a Unix-socket peer.

use std::fs::File;
use std::os::unix::net::UnixStream;
use std::path::Path;

use rustix::fs::FlockOperation;
use rustix::process::Pid;
pub use rustix::process::Signal;

use crate::DaemonError;

/// The signal numbered `signal` (as `libc::SIGTERM` and friends spell it).
pub fn signal_from_raw(signal: i32) -> Result<Signal, DaemonError> {
    Signal::from_named_raw(signal).ok_or(DaemonError::BadSignal { signal })
}

/// Sends `signal` to process `pid`. Only ever called with PIDs the caller started or
/// read from a file it owns; never by name.
pub fn kill(pid: u32, signal: Signal) -> Result<(), DaemonError> {
    let raw = i32::try_from(pid).map_err(|_| DaemonError::BadPid { pid })?;
    let target = Pid::from_raw(raw).ok_or(DaemonError::BadPid { pid })?;
    rustix::process::kill_process(target, signal).map_err(|e| DaemonError::Io {
        what: "kill",
        path: format!("pid {pid} with signal {}", signal.as_raw()),
        source: e.into(),
    })
}

/// The real uid of this process.
pub fn current_uid() -> u32 {
    rustix::process::getuid().as_raw()
}

/// An exclusive `flock(2)` on a file, held until dropped (the kernel also drops it when
/// the descriptor closes, so a crashed holder never leaves it taken).
#[derive(Debug)]
pub struct FileLock {
    file: File,
}

impl FileLock {
    /// Opens (creating if needed) `path` and blocks until the exclusive lock is ours.
    pub fn acquire(path: &Path) -> Result<FileLock, DaemonError> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(DaemonError::io("cannot open lock file", path.display()))?;
        loop {
            match rustix::fs::flock(&file, FlockOperation::LockExclusive) {
                Ok(()) => return Ok(FileLock { file }),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    return Err(DaemonError::Io {
                        what: "cannot lock",
                        path: path.display().to_string(),
                        source: e.into(),
                    })
                }
            }
        }
    }

    /// Takes the lock only if it is free now; `Ok(None)` when another holder has it.
    pub fn try_acquire(path: &Path) -> Result<Option<FileLock>, DaemonError> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(DaemonError::io("cannot open lock file", path.display()))?;
        match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => Ok(Some(FileLock { file })),
            Err(rustix::io::Errno::WOULDBLOCK) => Ok(None),
            Err(e) => Err(DaemonError::Io {
                what: "cannot lock",
                path: path.display().to_string(),
                source: e.into(),
            }),
        }
    }
}

impl FileLock {
    /// Writes this process's pid into the lock file (replacing what a previous holder
    /// wrote), so a process that finds the lock taken can name the holder
    /// ([`FileLock::holder_pid`]). The lock, not the pid, decides who holds it: a stale
    /// pid left by a crashed holder never keeps anyone out.
    pub fn record_pid(&self, path: &Path) -> Result<(), DaemonError> {
        use std::os::unix::fs::FileExt;
        let pid = format!("{}\n", std::process::id());
        self.file
            .set_len(0)
            .and_then(|()| self.file.write_all_at(pid.as_bytes(), 0))
            .map_err(DaemonError::io("cannot record the pid in", path.display()))
    }

    /// The pid the holder of the lock file at `path` recorded, if it did and it reads as
    /// one.
    pub fn holder_pid(path: &Path) -> Option<u32> {
        std::fs::read_to_string(path)
            .ok()?
            .trim()
            .parse()
            .ok()
            .filter(|pid| *pid > 0)
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        // Closing the descriptor releases it too; unlocking first says so explicitly and
        // frees it even while another clone of the descriptor lives.
        let _ = rustix::fs::flock(&self.file, FlockOperation::Unlock);
    }
}

/// A connected peer's process and user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub pid: u32,
    pub uid: u32,
}

/// The credentials of a connected Unix-socket peer, as the kernel recorded them at
/// connect time (`SO_PEERCRED`; the peer cannot forge them). Agent and controller decide
/// what a local client may do from its uid.
pub fn peer_of(stream: &UnixStream) -> std::io::Result<Peer> {
    let cred = rustix::net::sockopt::socket_peercred(stream)?;
    Ok(Peer {
        pid: cred.pid.as_raw_pid() as u32,
        uid: cred.uid.as_raw(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_pair_sees_this_process() {
        let (a, _b) = UnixStream::pair().expect("pair");
        let peer = peer_of(&a).expect("peer");
        assert_eq!(peer.pid, std::process::id());
        assert_eq!(peer.uid, current_uid());
    }

    #[test]
    fn kill_reaches_a_child_by_pid() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        kill(child.id(), Signal::TERM).expect("kill");
        let status = child.wait().expect("wait");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(Signal::TERM.as_raw()));
    }

    #[test]
    fn kill_refuses_pids_that_name_groups() {
        assert!(matches!(
            kill(0, Signal::TERM),
            Err(DaemonError::BadPid { pid: 0 })
        ));
        assert!(matches!(
            kill(u32::MAX, Signal::TERM),
            Err(DaemonError::BadPid { .. })
        ));
        assert!(matches!(
            signal_from_raw(0),
            Err(DaemonError::BadSignal { signal: 0 })
        ));
        assert_eq!(signal_from_raw(15).expect("TERM"), Signal::TERM);
    }

    #[test]
    fn a_held_lock_excludes_a_second_holder_until_dropped() {
        let dir = crate::fsx::tests::scratch("lock");
        let path = dir.join("gpu0.lock");
        let held = FileLock::acquire(&path).expect("first");
        // flock locks belong to the open file description: a second open conflicts.
        assert!(FileLock::try_acquire(&path).expect("try").is_none());
        drop(held);
        assert!(FileLock::try_acquire(&path).expect("try").is_some());
    }

    #[test]
    fn the_holder_pid_is_recorded_and_read_back() {
        let dir = crate::fsx::tests::scratch("lock-pid");
        let path = dir.join("agent.lock");
        assert_eq!(FileLock::holder_pid(&path), None, "no file yet");
        // A longer pid left by a previous holder is replaced, not overwritten in part.
        std::fs::write(&path, "123456789\n").expect("stale");
        let held = FileLock::try_acquire(&path).expect("try").expect("free");
        held.record_pid(&path).expect("record");
        assert_eq!(FileLock::holder_pid(&path), Some(std::process::id()));
        std::fs::write(&path, "not a pid").expect("garbage");
        assert_eq!(FileLock::holder_pid(&path), None);
    }
}
