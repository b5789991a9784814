//! Files the daemons own: state written atomically, and the site key read with its
//! permissions checked.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::DaemonError;

/// How [`write_atomic`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtomicWrite {
    /// fsync the file before the rename and the directory after it, so the new content
    /// survives a power loss, not only a crash of the writer.
    pub fsync: bool,
    /// Permission bits of the new file (e.g. 0o600 for state only root may read).
    pub mode: u32,
}

impl AtomicWrite {
    /// Survives the writer's crash (the page cache holds it), not the node's: for state
    /// that a reboot makes moot anyway and that sits on a latency path.
    pub const fn fast() -> AtomicWrite {
        AtomicWrite {
            fsync: false,
            mode: 0o644,
        }
    }

    /// Survives a power loss: for state a restart must find (budgets, events).
    pub const fn durable() -> AtomicWrite {
        AtomicWrite {
            fsync: true,
            mode: 0o600,
        }
    }

    /// The same, with permission bits `mode`.
    pub const fn with_mode(self, mode: u32) -> AtomicWrite {
        AtomicWrite { mode, ..self }
    }
}

/// Distinguishes temporary files of concurrent writers in one process.
static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

fn tmp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let seq = TMP_SEQ.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(".{name}.tmp.{}.{seq}", std::process::id()))
}

/// Replaces `path` with `bytes` so that a reader, or the writer after a crash, sees
/// either the whole old file or the whole new one: a temporary file beside it (same
/// directory, so the rename stays on one filesystem), written, then renamed over it.
/// On any failure the temporary file is removed and `path` is left as it was.
pub fn write_atomic(path: &Path, bytes: &[u8], how: AtomicWrite) -> Result<(), DaemonError> {
    let tmp = tmp_path(path);
    let result = write_then_rename(&tmp, path, bytes, how);
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

fn write_then_rename(
    tmp: &Path,
    path: &Path,
    bytes: &[u8],
    how: AtomicWrite,
) -> Result<(), DaemonError> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(how.mode)
        .open(tmp)
        .map_err(DaemonError::io("cannot create", tmp.display()))?;
    // The umask may have narrowed the mode at creation; the caller asked for this one.
    file.set_permissions(std::fs::Permissions::from_mode(how.mode))
        .map_err(DaemonError::io("cannot set the mode of", tmp.display()))?;
    file.write_all(bytes)
        .map_err(DaemonError::io("cannot write", tmp.display()))?;
    if how.fsync {
        file.sync_all()
            .map_err(DaemonError::io("cannot fsync", tmp.display()))?;
    }
    drop(file);
    std::fs::rename(tmp, path).map_err(DaemonError::io("cannot rename into", path.display()))?;
    if how.fsync {
        // The rename is durable only once the directory entry is.
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(DaemonError::io("cannot fsync directory", dir.display()))?;
    }
    Ok(())
}

/// Shortest accepted key, bytes (surrounding whitespace ignored).
pub const MIN_KEY_BYTES: usize = 16;

/// Longest accepted key file, bytes: a key is a line, not a document.
pub const MAX_KEY_FILE_BYTES: u64 = 4096;

/// Reads a link key file (the controller's site key, or a node's own key): a regular
/// file, owned by root, mode 0600 or stricter (no group or other bits), of
/// [`MIN_KEY_BYTES`] to [`MAX_KEY_FILE_BYTES`] bytes, surrounding whitespace ignored.
///
/// It is opened with `O_NOFOLLOW | O_NONBLOCK` and checked with `fstat` on the open file
/// (not the path, which could be swapped in between): a symlink is refused without
/// following it, and a FIFO or device is refused without blocking on it.
pub fn read_key_file(path: &Path) -> Result<Vec<u8>, DaemonError> {
    use rustix::fs::{FileType, Mode, OFlags};
    use std::io::Read;
    let shown = path.display().to_string();
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    )
    .map_err(|e| {
        if e == rustix::io::Errno::LOOP {
            DaemonError::KeyNotRegular {
                path: shown.clone(),
                kind: "symbolic link",
            }
        } else {
            DaemonError::Io {
                what: "cannot open the key file",
                path: shown.clone(),
                source: e.into(),
            }
        }
    })?;
    let stat = rustix::fs::fstat(&fd).map_err(|e| DaemonError::Io {
        what: "cannot stat the key file",
        path: shown.clone(),
        source: e.into(),
    })?;
    let kind = match FileType::from_raw_mode(stat.st_mode) {
        FileType::RegularFile => None,
        FileType::Directory => Some("directory"),
        FileType::Symlink => Some("symbolic link"),
        FileType::Fifo => Some("FIFO"),
        FileType::Socket => Some("socket"),
        FileType::CharacterDevice => Some("character device"),
        FileType::BlockDevice => Some("block device"),
        FileType::Unknown => Some("file of unknown type"),
    };
    if let Some(kind) = kind {
        return Err(DaemonError::KeyNotRegular { path: shown, kind });
    }
    if stat.st_uid != 0 {
        return Err(DaemonError::KeyOwner {
            path: shown,
            uid: stat.st_uid,
        });
    }
    let mode = stat.st_mode & 0o7777;
    if mode & 0o077 != 0 {
        return Err(DaemonError::KeyPermissions { path: shown, mode });
    }
    let mut key = Vec::new();
    std::fs::File::from(fd)
        .take(MAX_KEY_FILE_BYTES + 1)
        .read_to_end(&mut key)
        .map_err(DaemonError::io("cannot read the key file", &shown))?;
    if key.len() as u64 > MAX_KEY_FILE_BYTES {
        return Err(DaemonError::KeyTooLong {
            path: shown,
            max_bytes: MAX_KEY_FILE_BYTES,
        });
    }
    let key = key.trim_ascii();
    if key.len() < MIN_KEY_BYTES {
        return Err(DaemonError::KeyTooShort {
            path: shown,
            min_bytes: MIN_KEY_BYTES,
        });
    }
    Ok(key.to_vec())
}

/// The site key (`controller.key_file`): see [`read_key_file`].
pub fn read_site_key(path: &Path) -> Result<Vec<u8>, DaemonError> {
    read_key_file(path)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A fresh directory for one test, under the target's temp dir.
    pub(crate) fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "powerflex-daemon-{name}-{}-{}",
            std::process::id(),
            TMP_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    #[test]
    fn replaces_the_file_with_the_mode_asked_for() {
        let dir = scratch("atomic");
        let path = dir.join("state.json");
        std::fs::write(&path, b"old").expect("old");
        write_atomic(&path, b"new", AtomicWrite::durable()).expect("write");
        assert_eq!(std::fs::read(&path).expect("read"), b"new");
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        write_atomic(&path, b"newer", AtomicWrite::fast().with_mode(0o640)).expect("write");
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o640);
        // Nothing but the file itself is left in the directory.
        let left: Vec<_> = std::fs::read_dir(&dir).expect("dir").flatten().collect();
        assert_eq!(left.len(), 1, "{left:?}");
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let dir = scratch("atomic-fail");
        // The target is a non-empty directory: the rename over it must fail, after the
        // temporary file was fully written.
        let path = dir.join("state.json");
        std::fs::create_dir(&path).expect("dir");
        std::fs::write(path.join("keep"), b"old").expect("old");
        let err = write_atomic(&path, b"new", AtomicWrite::fast()).expect_err("must fail");
        assert!(err.to_string().contains("cannot rename into"), "{err}");
        assert_eq!(std::fs::read(path.join("keep")).expect("old"), b"old");
        let left: Vec<_> = std::fs::read_dir(&dir).expect("dir").flatten().collect();
        assert_eq!(left.len(), 1, "the temporary file is gone: {left:?}");

        // And where the temporary file cannot even be created, the old file stays.
        let file = dir.join("plain");
        std::fs::write(&file, b"old").expect("old");
        let inside = file.join("x");
        assert!(write_atomic(&inside, b"new", AtomicWrite::fast()).is_err());
        assert_eq!(std::fs::read(&file).expect("read"), b"old");
    }

    #[test]
    fn the_site_key_must_be_private_and_long_enough() {
        let dir = scratch("key");
        let path = dir.join("powerflex.key");
        std::fs::write(&path, b"  a site key of some length \n").expect("key");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        assert!(matches!(
            read_site_key(&path),
            Err(DaemonError::KeyPermissions { mode: 0o644, .. })
        ));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).expect("chmod");
        assert!(matches!(
            read_site_key(&path),
            Err(DaemonError::KeyPermissions { mode: 0o640, .. })
        ));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        if rustix::process::geteuid().is_root() {
            assert_eq!(
                read_site_key(&path).expect("key"),
                b"a site key of some length".to_vec()
            );
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)).expect("chmod");
            assert!(read_site_key(&path).is_ok(), "0400 is stricter than 0600");
            std::fs::write(&path, b"short\n").expect("key");
            assert!(matches!(
                read_site_key(&path),
                Err(DaemonError::KeyTooShort { min_bytes: 16, .. })
            ));
            std::fs::write(&path, vec![b'k'; 5000]).expect("key");
            assert!(matches!(
                read_site_key(&path),
                Err(DaemonError::KeyTooLong { .. })
            ));
        }
        let missing = read_site_key(&dir.join("none")).expect_err("missing");
        assert!(
            missing.to_string().contains("cannot open the key file"),
            "{missing}"
        );
    }

    #[test]
    fn a_key_file_that_is_not_a_private_root_file_is_refused_without_blocking() {
        let dir = scratch("key-kinds");
        let real = dir.join("real.key");
        std::fs::write(&real, b"a site key of some length\n").expect("key");
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        // A symlink to a good key is refused, not followed.
        let link = dir.join("link.key");
        std::os::unix::fs::symlink(&real, &link).expect("symlink");
        let err = read_key_file(&link).expect_err("symlink");
        assert!(
            matches!(
                err,
                DaemonError::KeyNotRegular {
                    kind: "symbolic link",
                    ..
                }
            ),
            "{err}"
        );
        // A FIFO with no writer: a plain open would block forever.
        let fifo = dir.join("fifo.key");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .expect("mkfifo");
        let started = std::time::Instant::now();
        let err = read_key_file(&fifo).expect_err("fifo");
        assert!(
            matches!(err, DaemonError::KeyNotRegular { kind: "FIFO", .. }),
            "{err}"
        );
        assert!(err.to_string().contains("regular file"), "{err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        let err = read_key_file(&dir).expect_err("dir");
        assert!(
            matches!(
                err,
                DaemonError::KeyNotRegular {
                    kind: "directory",
                    ..
                }
            ),
            "{err}"
        );
        // Owned by someone other than root (only root can give a file away).
        if rustix::process::geteuid().is_root() {
            let theirs = dir.join("theirs.key");
            std::fs::write(&theirs, b"a site key of some length\n").expect("key");
            std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o600))
                .expect("chmod");
            std::os::unix::fs::chown(&theirs, Some(65534), None).expect("chown");
            let err = read_key_file(&theirs).expect_err("not root's");
            assert!(
                matches!(err, DaemonError::KeyOwner { uid: 65534, .. }),
                "{err}"
            );
            assert!(err.to_string().contains("owned by uid 65534"), "{err}");
        }
    }
}

/// An append-only log of one JSON document per line, rotated by size: when a line
/// would take `path` past `max_bytes`, `path` becomes `path.1` (`path.1` becomes
/// `path.2`, …, up to `keep` old files; the oldest is dropped) and a new `path` starts.
/// Each line is written with one `write(2)` on an `O_APPEND` descriptor and synced, so a
/// crash leaves at most a torn last line, which readers skip.
#[derive(Debug, Clone)]
pub struct JsonLines {
    pub path: std::path::PathBuf,
    pub max_bytes: u64,
    pub keep: u32,
    /// The files' mode (the accounting log holds users' job figures: 0600 by default).
    pub mode: u32,
}

impl JsonLines {
    pub fn new(path: std::path::PathBuf) -> JsonLines {
        JsonLines {
            path,
            max_bytes: 64 * 1024 * 1024,
            keep: 8,
            mode: 0o600,
        }
    }

    fn rotated(&self, n: u32) -> std::path::PathBuf {
        let mut name = self.path.as_os_str().to_owned();
        name.push(format!(".{n}"));
        std::path::PathBuf::from(name)
    }

    /// Appends `line` (without its newline, which is added), rotating first if needed.
    pub fn append(&self, line: &str) -> Result<(), DaemonError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let shown = self.path.display().to_string();
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(DaemonError::io("cannot create", &shown))?;
        }
        let size = std::fs::metadata(&self.path).map_or(0, |m| m.len());
        if size > 0 && size + line.len() as u64 + 1 > self.max_bytes {
            for n in (1..self.keep).rev() {
                let _ = std::fs::rename(self.rotated(n), self.rotated(n + 1));
            }
            if self.keep > 0 {
                std::fs::rename(&self.path, self.rotated(1))
                    .map_err(DaemonError::io("cannot rotate", &shown))?;
            } else {
                std::fs::remove_file(&self.path)
                    .map_err(DaemonError::io("cannot rotate", &shown))?;
            }
        }
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(self.mode)
            .open(&self.path)
            .map_err(DaemonError::io("cannot open", &shown))?;
        let mut bytes = Vec::with_capacity(line.len() + 2);
        if ends_torn(&self.path) {
            // A crash tore the last line: end it, so this one stays whole.
            bytes.push(b'\n');
        }
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
        file.write_all(&bytes)
            .and_then(|()| file.sync_data())
            .map_err(DaemonError::io("cannot append to", &shown))
    }

    /// Every whole line of the log, oldest first, across the rotated files (a torn last
    /// line is left out).
    pub fn read_all(&self) -> Result<Vec<String>, DaemonError> {
        let mut lines = Vec::new();
        for n in (0..=self.keep).rev() {
            let path = if n == 0 {
                self.path.clone()
            } else {
                self.rotated(n)
            };
            let text = match std::fs::read_to_string(&path) {
                Ok(t) => t,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => {
                    return Err(DaemonError::io("cannot read", &path.display().to_string())(
                        e,
                    ))
                }
            };
            let whole = text.ends_with('\n');
            let mut parts: Vec<&str> = text.split('\n').collect();
            parts.pop();
            if !whole {
                // The last piece had no newline: a torn write.
                parts.push("");
            }
            lines.extend(
                parts
                    .into_iter()
                    .filter(|l| !l.is_empty())
                    .map(str::to_string),
            );
        }
        Ok(lines)
    }
}

/// Whether the file at `path` is non-empty and does not end with a newline.
fn ends_torn(path: &Path) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    let mut last = [0u8; 1];
    f.seek(SeekFrom::End(-1)).is_ok() && f.read_exact(&mut last).is_ok() && last[0] != b'\n'
}

#[cfg(test)]
mod json_lines_tests {
    use super::*;

    #[test]
    fn a_log_rotates_by_size_and_reads_back_in_order_without_a_torn_line() {
        let dir = std::env::temp_dir().join(format!("pf-jsonl-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let log = JsonLines {
            path: dir.join("records.jsonl"),
            max_bytes: 30,
            keep: 2,
            mode: 0o600,
        };
        for i in 0..10 {
            log.append(&format!("{{\"n\":{i}}}")).expect("append");
        }
        let lines = log.read_all().expect("read");
        // 8 bytes a line, three lines a file, three files kept.
        assert_eq!(lines.len(), 7, "{lines:?}");
        assert_eq!(lines.last().map(String::as_str), Some("{\"n\":9}"));
        assert_eq!(lines.first().map(String::as_str), Some("{\"n\":3}"));
        // A torn last line (a crash mid-write) is left out.
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&log.path)
            .expect("open");
        f.write_all(b"{\"n\":1").expect("torn");
        assert_eq!(log.read_all().expect("read").len(), 7);
        // The next line is kept whole beside it.
        log.append("{\"n\":10}").expect("append");
        let lines = log.read_all().expect("read");
        assert_eq!(lines.last().map(String::as_str), Some("{\"n\":10}"));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&log.path)
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
