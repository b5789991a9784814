//! Which Slurm job a process belongs to, from what the kernel records rather than from
//! anything the job's user can write.
//!
//! Slurm runs every step of a job under a `slurmstepd` that it starts as root and whose
//! process title names the step: `slurmstepd: [1234.0]`, `[1234.batch]`,
//! `[1234.extern]`. A process belongs to job J when one of its ancestors is such a
//! process: owned by root (uid 0), running the `slurmstepd` executable, titled with J. A
//! user can set any environment and any title on their own processes, but cannot make
//! them root's or make root's `slurmstepd` their parent. This works with
//! `proctrack/linuxproc` (the test cluster) as with the cgroup plugins.
//!
//! Job ids are unique within one Slurm cluster only. Where several clusters share a host
//! (the test clusters, several `slurmd -N` on one machine), a step daemon is told apart by
//! the `SLURM_CONF` in its environment (root's, set by slurmd, not by the job): a job is
//! known by its id and that cluster together, [`JobKey`].
//!
//! [`ProcTable::read`] reads `/proc` (I/O); everything else is pure and tested on tables
//! built by hand.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// One process as `/proc` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcEntry {
    pub pid: u32,
    pub ppid: u32,
    /// Real user id.
    pub uid: u32,
    /// The command line as one string (NULs as spaces, trimmed): a process's title.
    pub title: String,
    /// Whether `/proc/PID/exe` is a `slurmstepd` binary (`slurmstepd`, Debian's
    /// `slurmstepd-wlm`).
    pub exe_is_slurmstepd: bool,
    /// `SLURM_CONF` from the environment of a root-owned `slurmstepd` (which cluster it
    /// serves; `None` for the default config). Not read for other processes.
    pub slurm_conf: Option<String>,
}

use powerflex_agent_machine::JobKey;

/// A Slurm step: job id and step name (`0`, `batch`, `extern`, ...), and the cluster its
/// step daemon serves (its `SLURM_CONF`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct StepId {
    pub job: String,
    pub step: String,
    pub cluster: Option<String>,
}

impl StepId {
    pub fn job_key(&self) -> JobKey {
        (self.job.clone(), self.cluster.clone())
    }
}

/// Deepest ancestry walked: process trees are shallow; a loop or a forged table stops here.
const MAX_DEPTH: usize = 64;

/// The step a `slurmstepd` title names: `slurmstepd: [1234.0]` → (`1234`, `0`). Job ids of
/// heterogeneous jobs (`1234+1`) and array tasks keep their Slurm spelling.
pub fn parse_stepd_title(title: &str) -> Option<StepId> {
    let inner = title
        .trim()
        .strip_prefix("slurmstepd: [")?
        .strip_suffix(']')?;
    let (job, step) = inner.rsplit_once('.')?;
    let valid = |s: &str| {
        !s.is_empty()
            && s.len() <= 64
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '+')
    };
    (valid(job) && valid(step) && job.starts_with(|c: char| c.is_ascii_digit())).then(|| StepId {
        job: job.to_string(),
        step: step.to_string(),
        cluster: None,
    })
}

/// A snapshot of the host's processes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcTable {
    by_pid: BTreeMap<u32, ProcEntry>,
}

impl ProcTable {
    pub fn from_entries(entries: impl IntoIterator<Item = ProcEntry>) -> ProcTable {
        ProcTable {
            by_pid: entries.into_iter().map(|e| (e.pid, e)).collect(),
        }
    }

    /// Reads every process under `proc_root` (normally `/proc`). Processes that end while
    /// being read, or whose files cannot be read, are left out.
    pub fn read(proc_root: &Path) -> std::io::Result<ProcTable> {
        let mut entries = Vec::new();
        for dir in std::fs::read_dir(proc_root)? {
            let Ok(dir) = dir else { continue };
            let Some(pid) = dir.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            if let Some(entry) = read_entry(&dir.path(), pid) {
                entries.push(entry);
            }
        }
        Ok(ProcTable::from_entries(entries))
    }

    pub fn get(&self, pid: u32) -> Option<&ProcEntry> {
        self.by_pid.get(&pid)
    }

    /// The step `pid` runs in: the nearest ancestor (or the process itself) that is a
    /// root-owned `slurmstepd` titled with a step. `None` for a process outside any job.
    pub fn step_of(&self, pid: u32) -> Option<StepId> {
        let mut current = self.by_pid.get(&pid)?;
        for _ in 0..MAX_DEPTH {
            if let Some(step) = stepd_step(current) {
                return Some(step);
            }
            if current.ppid == 0 || current.ppid == current.pid {
                return None;
            }
            current = self.by_pid.get(&current.ppid)?;
        }
        None
    }

    /// Reads only `pid` and its ancestors under `proc_root` (normally `/proc`): enough to
    /// answer [`ProcTable::step_of`] for `pid` without reading every process on the
    /// host, on paths (a progress connection, a registration) that must stay cheap.
    pub fn read_ancestry(proc_root: &Path, pid: u32) -> ProcTable {
        let mut entries = Vec::new();
        let mut next = pid;
        for _ in 0..MAX_DEPTH {
            let Some(entry) = read_entry(&proc_root.join(next.to_string()), next) else {
                break;
            };
            let (ppid, done) = (entry.ppid, stepd_step(&entry).is_some());
            entries.push(entry);
            if done || ppid == 0 || ppid == next {
                break;
            }
            next = ppid;
        }
        ProcTable::from_entries(entries)
    }

    /// Jobs with at least one step daemon on this host.
    pub fn live_jobs(&self) -> BTreeSet<JobKey> {
        self.by_pid
            .values()
            .filter_map(stepd_step)
            .map(|s| s.job_key())
            .collect()
    }
}

/// The step of a process that is itself a step daemon Slurm started.
fn stepd_step(entry: &ProcEntry) -> Option<StepId> {
    if entry.uid != 0 || !entry.exe_is_slurmstepd {
        return None;
    }
    parse_stepd_title(&entry.title).map(|s| StepId {
        cluster: entry.slurm_conf.clone(),
        ..s
    })
}

/// The step process `pid` runs in, from its ancestry under `proc_root` (see
/// [`ProcTable::step_of`]): what a progress report or a GPU's process is attributed by,
/// never the process's own environment.
pub fn step_of_pid(proc_root: &Path, pid: u32) -> Option<StepId> {
    ProcTable::read_ancestry(proc_root, pid).step_of(pid)
}

/// The cluster served by process `pid` when it is a root-owned step daemon (the peer of a
/// registration): `Some(SLURM_CONF)`, or `None` when it is not a step daemon.
pub fn stepd_cluster(proc_root: &Path, pid: u32) -> Option<Option<String>> {
    let entry = read_entry(&proc_root.join(pid.to_string()), pid)?;
    stepd_step(&entry).map(|s| s.cluster)
}

/// What the kernel appends to a process's `exe` link once the file it runs was unlinked.
const DELETED_SUFFIX: &str = " (deleted)";

/// Whether `target`, a `/proc/PID/exe` link's target, is a `slurmstepd` binary
/// (`slurmstepd`, Debian's `slurmstepd-wlm`). A package upgrade replaces the binary under
/// the step daemons that run on, and the kernel then shows their link as
/// `/usr/sbin/slurmstepd-wlm (deleted)`: the name before that suffix is what they ran, so
/// they are still step daemons. Only the name is judged here, as before the upgrade;
/// being root's is what a user's process cannot fake ([`stepd_step`]).
fn is_slurmstepd_exe(target: &Path) -> bool {
    let target = target.to_string_lossy();
    let path = target.strip_suffix(DELETED_SUFFIX).unwrap_or(&target);
    Path::new(path)
        .file_name()
        .map(|n| n.to_string_lossy())
        .is_some_and(|name| name == "slurmstepd" || name.starts_with("slurmstepd-"))
}

fn slurm_conf_of(dir: &Path) -> Option<String> {
    let environ = std::fs::read(dir.join("environ")).ok()?;
    environ
        .split(|&b| b == 0)
        .find_map(|var| var.strip_prefix(b"SLURM_CONF="))
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

fn read_entry(dir: &Path, pid: u32) -> Option<ProcEntry> {
    let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
    // `pid (comm) state ppid ...`: comm may hold spaces and parentheses, so the fields
    // are counted from the last ')'.
    let after_comm = &stat[stat.rfind(')')? + 1..];
    let ppid: u32 = after_comm.split_whitespace().nth(1)?.parse().ok()?;
    let status = std::fs::read_to_string(dir.join("status")).ok()?;
    let uid: u32 = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let cmdline = std::fs::read(dir.join("cmdline")).unwrap_or_default();
    let title = String::from_utf8_lossy(&cmdline)
        .replace('\0', " ")
        .trim()
        .to_string();
    let exe_is_slurmstepd = std::fs::read_link(dir.join("exe"))
        .ok()
        .is_some_and(|target| is_slurmstepd_exe(&target));
    // Only a step daemon's environment says anything trustworthy (root's, from slurmd).
    let slurm_conf = if uid == 0 && exe_is_slurmstepd {
        slurm_conf_of(dir)
    } else {
        None
    };
    Some(ProcEntry {
        pid,
        ppid,
        uid,
        title,
        exe_is_slurmstepd,
        slurm_conf,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stepd(pid: u32, title: &str) -> ProcEntry {
        ProcEntry {
            pid,
            ppid: 1,
            uid: 0,
            title: title.into(),
            exe_is_slurmstepd: true,
            slurm_conf: None,
        }
    }

    fn user(pid: u32, ppid: u32, uid: u32, title: &str) -> ProcEntry {
        ProcEntry {
            pid,
            ppid,
            uid,
            title: title.into(),
            exe_is_slurmstepd: false,
            slurm_conf: None,
        }
    }

    #[test]
    fn titles_name_the_step() {
        let step = |j: &str, s: &str| {
            Some(StepId {
                job: j.into(),
                step: s.into(),
                cluster: None,
            })
        };
        assert_eq!(parse_stepd_title("slurmstepd: [1234.0]"), step("1234", "0"));
        assert_eq!(
            parse_stepd_title("slurmstepd: [7.batch] "),
            step("7", "batch")
        );
        assert_eq!(
            parse_stepd_title("slurmstepd: [7+1.extern]"),
            step("7+1", "extern")
        );
        for bad in [
            "slurmstepd: [7]",
            "slurmstepd: [.0]",
            "slurmstepd: [x.0]",
            "slurmstepd: [7.0",
            "sleep 100",
            "slurmstepd: [7.0/../x]",
            "",
        ] {
            assert_eq!(parse_stepd_title(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_slurmstepd_binary_replaced_under_it_is_still_one() {
        for target in [
            "/usr/sbin/slurmstepd",
            "/usr/sbin/slurmstepd-wlm",
            "/opt/slurm/sbin/slurmstepd",
            // The file unlinked or replaced (a package upgrade) while the process runs.
            "/usr/sbin/slurmstepd (deleted)",
            "/usr/sbin/slurmstepd-wlm (deleted)",
        ] {
            assert!(is_slurmstepd_exe(Path::new(target)), "{target}");
        }
        for target in [
            "/usr/bin/sleep",
            "/usr/bin/sleep (deleted)",
            "/usr/sbin/slurmd (deleted)",
            "/usr/sbin/xslurmstepd (deleted)",
            "/usr/sbin/slurmstepdx (deleted)",
            // Only one suffix is the kernel's; the name before it is not slurmstepd's.
            "/usr/sbin/slurmstepd (deleted) (deleted)",
            "/usr/sbin/slurmstepd (deleted)x",
            "/usr/sbin/slurmstepd(deleted)",
            "/usr/sbin/slurmstepd/ (deleted)x",
            " (deleted)",
            "/ (deleted)",
        ] {
            assert!(!is_slurmstepd_exe(Path::new(target)), "{target}");
        }
    }

    #[test]
    fn a_job_is_what_root_owned_slurmstepd_ancestry_says() {
        let table = ProcTable::from_entries([
            user(1, 0, 0, "/sbin/init"),
            stepd(100, "slurmstepd: [42.0]"),
            user(101, 100, 1000, "python train.py"),
            user(102, 101, 1000, "python worker"),
            // A user's own process titled like a step daemon: not root's, not the binary.
            user(200, 1, 1000, "slurmstepd: [666.0]"),
            user(201, 200, 1000, "sleep 1000"),
            // Root-owned but not the slurmstepd binary (e.g. a script renaming itself).
            ProcEntry {
                exe_is_slurmstepd: false,
                ..stepd(300, "slurmstepd: [777.0]")
            },
        ]);
        let job = |pid| table.step_of(pid).map(|s| s.job);
        assert_eq!(job(102).as_deref(), Some("42"));
        assert_eq!(job(101).as_deref(), Some("42"));
        assert_eq!(job(100).as_deref(), Some("42"));
        assert_eq!(job(201), None, "a forged title owned by a user is no job");
        assert_eq!(job(300), None);
        assert_eq!(job(999), None, "unknown pid");
        assert_eq!(
            table.live_jobs(),
            BTreeSet::from([("42".to_string(), None)])
        );
    }

    #[test]
    fn a_parent_loop_ends() {
        let table = ProcTable::from_entries([user(5, 6, 1000, "a"), user(6, 5, 1000, "b")]);
        assert_eq!(table.step_of(5), None);
    }

    #[test]
    fn this_host_s_proc_is_readable() {
        let table = ProcTable::read(Path::new("/proc")).expect("/proc");
        let me = table.get(std::process::id()).expect("this process");
        assert_eq!(me.pid, std::process::id());
        assert!(!me.exe_is_slurmstepd);
    }

    #[test]
    fn the_same_job_id_in_two_clusters_is_two_jobs() {
        let other = |pid, conf: &str| ProcEntry {
            slurm_conf: Some(conf.into()),
            ..stepd(pid, "slurmstepd: [1.batch]")
        };
        let table = ProcTable::from_entries([
            other(10, "/a/slurm.conf"),
            other(20, "/b/slurm.conf"),
            user(11, 10, 1000, "train"),
        ]);
        assert_eq!(
            table.live_jobs(),
            BTreeSet::from([
                ("1".to_string(), Some("/a/slurm.conf".to_string())),
                ("1".to_string(), Some("/b/slurm.conf".to_string())),
            ])
        );
        assert_eq!(
            table.step_of(11).map(|s| s.job_key()),
            Some(("1".to_string(), Some("/a/slurm.conf".to_string())))
        );
    }

    /// A /proc tree on disk, laid out as the kernel's (stat, status, cmdline, environ,
    /// the exe link), read by the same code as the real one.
    struct FakeProc(std::path::PathBuf);

    impl FakeProc {
        fn new(name: &str) -> FakeProc {
            let dir = std::env::temp_dir().join(format!("pf-proc-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(dir.join("bin")).expect("mkdir");
            for exe in ["slurmstepd", "sleep"] {
                std::fs::write(dir.join("bin").join(exe), b"").expect("exe");
            }
            FakeProc(dir)
        }

        fn add(&self, pid: u32, ppid: u32, uid: u32, exe: &str, argv: &[&str], env: &[&str]) {
            let d = self.0.join(pid.to_string());
            std::fs::create_dir_all(&d).expect("mkdir");
            // comm with a space and a parenthesis, as the kernel allows.
            let stat = format!("{pid} (x) y) S {ppid} {pid} {pid} 0 -1");
            std::fs::write(d.join("stat"), stat).expect("stat");
            let status = format!("Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n");
            std::fs::write(d.join("status"), status).expect("status");
            std::fs::write(d.join("cmdline"), argv.join("\0")).expect("cmdline");
            std::fs::write(d.join("environ"), env.join("\0")).expect("environ");
            std::os::unix::fs::symlink(self.0.join("bin").join(exe), d.join("exe")).expect("exe");
        }
    }

    impl Drop for FakeProc {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A process is attributed to a job by the root-owned step daemon above it, never by
    /// its own `SLURM_JOB_ID`: a forged environment names no job.
    #[test]
    fn a_fake_proc_tree_is_attributed_by_ancestry_not_environment() {
        let fake = FakeProc::new("ancestry");
        fake.add(1, 0, 0, "sleep", &["/sbin/init"], &[]);
        fake.add(
            10,
            1,
            0,
            "slurmstepd",
            &["slurmstepd: [42.0]"],
            &["SLURM_CONF=/c/slurm.conf"],
        );
        fake.add(
            11,
            10,
            1000,
            "sleep",
            &["python", "train.py"],
            &["SLURM_JOB_ID=42"],
        );
        // The same user's process outside any job, claiming job 42 and job 43.
        fake.add(
            20,
            1,
            1000,
            "sleep",
            &["sleep", "1000"],
            &["SLURM_JOB_ID=42"],
        );
        // A user's process in another job of theirs, claiming job 42.
        fake.add(30, 1, 0, "slurmstepd", &["slurmstepd: [43.batch]"], &[]);
        fake.add(31, 30, 1000, "sleep", &["bash"], &["SLURM_JOB_ID=42"]);
        // A user's own "slurmstepd": the right binary name but not root's.
        fake.add(40, 1, 1000, "slurmstepd", &["slurmstepd: [42.0]"], &[]);
        fake.add(41, 40, 1000, "sleep", &["x"], &[]);
        let root = fake.0.as_path();
        let step = step_of_pid(root, 11).expect("in job 42");
        assert_eq!(
            step.job_key(),
            ("42".to_string(), Some("/c/slurm.conf".to_string()))
        );
        assert_eq!(step.step, "0");
        assert_eq!(step_of_pid(root, 20), None);
        assert_eq!(step_of_pid(root, 31).map(|s| s.job).as_deref(), Some("43"));
        assert_eq!(step_of_pid(root, 41), None);
        assert_eq!(step_of_pid(root, 99), None, "a process that is gone");
        // Only the chain is read.
        assert_eq!(ProcTable::read_ancestry(root, 11).by_pid.len(), 2);
        assert_eq!(ProcTable::read(root).expect("read").by_pid.len(), 8);
    }

    /// After Slurm's package is upgraded under running jobs, their step daemons' `exe`
    /// links read `... (deleted)`: their jobs are still live and their processes still
    /// theirs. A user's process running a deleted file named `slurmstepd` still is not
    /// one, nor is root's deleted `sleep` titled as one.
    #[test]
    fn a_step_daemon_whose_binary_was_replaced_still_holds_its_job() {
        let fake = FakeProc::new("deleted");
        fake.add(1, 0, 0, "sleep", &["/sbin/init"], &[]);
        fake.add(
            10,
            1,
            0,
            "slurmstepd (deleted)",
            &["slurmstepd: [42.0]"],
            &["SLURM_CONF=/c/slurm.conf"],
        );
        fake.add(11, 10, 1000, "sleep", &["python", "train.py"], &[]);
        fake.add(
            20,
            1,
            1000,
            "slurmstepd (deleted)",
            &["slurmstepd: [43.0]"],
            &[],
        );
        fake.add(21, 20, 1000, "sleep", &["x"], &[]);
        fake.add(30, 1, 0, "sleep (deleted)", &["slurmstepd: [44.0]"], &[]);
        fake.add(31, 30, 1000, "sleep", &["x"], &[]);
        let root = fake.0.as_path();
        assert_eq!(
            step_of_pid(root, 11).map(|s| s.job_key()),
            Some(("42".to_string(), Some("/c/slurm.conf".to_string())))
        );
        assert_eq!(stepd_cluster(root, 10), Some(Some("/c/slurm.conf".into())));
        assert_eq!(step_of_pid(root, 21), None, "a user's deleted slurmstepd");
        assert_eq!(stepd_cluster(root, 20), None);
        assert_eq!(step_of_pid(root, 31), None, "root's deleted sleep");
        assert_eq!(
            ProcTable::read(root).expect("read").live_jobs(),
            BTreeSet::from([("42".to_string(), Some("/c/slurm.conf".to_string()))])
        );
    }

    /// The same through this host's real `/proc`: a running process whose binary, a copy
    /// of `sh` named `slurmstepd`, is deleted under it, as the kernel shows it.
    #[test]
    fn a_real_process_whose_slurmstepd_file_is_deleted_is_read_as_one() {
        use std::os::unix::process::CommandExt;
        let dir = std::env::temp_dir().join(format!("pf-proc-real-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir");
        let exe = dir.join("slurmstepd");
        std::fs::copy("/bin/sh", &exe).expect("copy /bin/sh");
        // A shell waiting on its stdin: it runs, with the title alone as its command line.
        let mut child = std::process::Command::new(&exe)
            .arg0("slurmstepd: [7.0]")
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("run the copy");
        // Unlinked only once the process runs it: its exe link then says so.
        std::fs::remove_file(&exe).expect("delete the copy");
        let pid = child.id();
        let link = std::fs::read_link(format!("/proc/{pid}/exe"));
        // `spawn` returns once the exec is under way, before the kernel has laid out the
        // new command line; poll (bounded) until the title is there.
        let proc_dir = Path::new("/proc").join(pid.to_string());
        let mut entry = read_entry(&proc_dir, pid);
        for _ in 0..100 {
            if entry.as_ref().is_some_and(|e| !e.title.is_empty()) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
            entry = read_entry(&proc_dir, pid);
        }
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(&dir);
        let link = link.expect("exe link");
        assert!(
            link.to_string_lossy().ends_with("/slurmstepd (deleted)"),
            "the kernel's link: {}",
            link.display()
        );
        let entry = entry.expect("the process's entry");
        assert!(entry.exe_is_slurmstepd, "{entry:?}");
        assert_eq!(entry.title, "slurmstepd: [7.0]");
        // Whether it is a step daemon is root's to say: only a root run can show it is.
        let step = stepd_step(&entry);
        if entry.uid == 0 {
            assert_eq!(step.map(|s| s.job).as_deref(), Some("7"), "{entry:?}");
        } else {
            assert_eq!(step, None, "a non-root process is never a step daemon");
        }
    }
}
