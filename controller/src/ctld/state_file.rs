//! What survives a controller restart ([`CtldState`], the machine's), saved atomically on
//! change with the copy it replaces kept beside it: a restart that finds the file corrupt
//! falls back on that one.

use std::path::Path;

use tracing::{error, warn};

use powerflex_core::UnixMs;
use powerflex_daemon::fsx::{self, AtomicWrite};

use powerflex_controller_machine::controller::state::{CtldState, Loaded};

pub const STATE_FILE: &str = "ctld-state.json";
/// The state before the last save: what a restart falls back on when the file is corrupt.
pub const PREVIOUS_STATE_FILE: &str = "ctld-state.prev.json";

/// The state in `path` (`None`: no such file), read, parsed and checked
/// ([`CtldState::from_json`]; a file past its size cap is not read whole).
fn read_state(path: &Path, now: UnixMs) -> Option<Result<CtldState, String>> {
    use std::io::Read;
    let file = std::fs::File::open(path).ok()?;
    let mut bytes = Vec::new();
    let cap = powerflex_controller_machine::controller::state::MAX_STATE_BYTES as u64;
    if let Err(e) = file.take(cap + 1).read_to_end(&mut bytes) {
        return Some(Err(format!("cannot read it: {e}")));
    }
    Some(CtldState::from_json(&bytes, now).map_err(|e| e.to_string()))
}

/// The persisted state in `dir`, falling back on the previous copy when the file is
/// corrupt or fails its check (the file is moved aside as `*.json.corrupt`). Events
/// over at `now` are dropped.
pub fn load(dir: &Path, now: UnixMs) -> Loaded {
    let path = dir.join(STATE_FILE);
    let previous = dir.join(PREVIOUS_STATE_FILE);
    match read_state(&path, now) {
        Some(Ok(state)) => return Loaded { state, lost: false },
        None if !previous.exists() => {
            return Loaded {
                state: CtldState::default(),
                lost: false,
            }
        }
        None => {}
        Some(Err(e)) => {
            let moved = path.with_extension("json.corrupt");
            let _ = std::fs::rename(&path, &moved);
            error!(path = %path.display(), error = %e, moved = %moved.display(), "controller state corrupt or out of range: not steered from");
        }
    }
    match read_state(&previous, now) {
        Some(Ok(state)) => {
            warn!(path = %previous.display(), "using the state saved before the last change; the last admin change may be missing");
            Loaded { state, lost: false }
        }
        _ => {
            error!("no usable controller state: the grid events and nodes it held are lost; re-add the events (powerflexctl event list shows what is known)");
            Loaded {
                state: CtldState::default(),
                lost: true,
            }
        }
    }
}

/// Saves `state` in `dir` (mode 0600, fsynced: budgets and events must survive a power
/// loss); a failure is logged and returned: without `[controller.ha]` the state is
/// durable only once this succeeds, and nothing it records takes effect before.
pub fn save(dir: &Path, state: &CtldState) -> Result<(), String> {
    try_save(dir, state).inspect_err(|e| {
        error!(error = %e, dir = %dir.display(), "cannot persist controller state");
    })
}

fn try_save(dir: &Path, state: &CtldState) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let bytes = serde_json::to_vec_pretty(state)
        .map_err(|e| format!("cannot encode the controller state: {e}"))?;
    // Keep the state being replaced: a restart that finds the new file corrupt falls
    // back on the one before. The hard link leaves the current file in place, so the
    // state file is never missing.
    let current = dir.join(STATE_FILE);
    if current.exists() {
        let previous = dir.join(PREVIOUS_STATE_FILE);
        match std::fs::remove_file(&previous) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("cannot remove {}: {e}", previous.display())),
        }
        std::fs::hard_link(&current, &previous).map_err(|e| {
            format!(
                "cannot keep {} as {}: {e}",
                current.display(),
                previous.display()
            )
        })?;
    }
    fsx::write_atomic(&current, &bytes, AtomicWrite::durable()).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use powerflex_controller_machine::preempt::Preempted;
    use powerflex_core::Watts;

    const NOW: UnixMs = UnixMs(1_800_000_000_000);

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("pf-ctld-state-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn with_budget(w: f64) -> CtldState {
        CtldState {
            budget_w: Some(Watts(w)),
            ..CtldState::default()
        }
    }

    /// A restarted controller must still know whom it holds out of a deep cut, and a
    /// state file written before that existed must still load.
    #[test]
    fn the_held_jobs_survive_a_restart_and_old_files_load() {
        let dir = temp_dir("held");
        let mut state = with_budget(1000.0);
        state.preempted.insert(
            "42".into(),
            Preempted {
                how: powerflex_core::flex::Preempt::Requeue,
                since_ms: 1_800_000_000_000,
            },
        );
        save(&dir, &state).expect("saved");
        assert_eq!(load(&dir, NOW).state, state);
        let old = r#"{"budget_w":1000.0,"events":[],"next_event_id":0}"#;
        let parsed: CtldState = serde_json::from_str(old).expect("an old state file");
        assert!(parsed.preempted.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn no_file_is_a_fresh_start_not_a_loss() {
        let dir = temp_dir("fresh");
        assert_eq!(
            load(&dir, NOW),
            Loaded {
                state: CtldState::default(),
                lost: false
            }
        );
    }

    #[test]
    fn a_corrupt_file_falls_back_on_the_previous_copy() {
        let dir = temp_dir("fallback");
        save(&dir, &with_budget(1000.0)).expect("saved");
        save(&dir, &with_budget(2000.0)).expect("saved");
        assert_eq!(load(&dir, NOW).state, with_budget(2000.0));
        std::fs::write(dir.join(STATE_FILE), b"{ not json").expect("corrupt");
        let loaded = load(&dir, NOW);
        assert_eq!(
            loaded.state,
            with_budget(1000.0),
            "the copy before the last save"
        );
        assert!(!loaded.lost);
        assert!(
            dir.join("ctld-state.json.corrupt").exists(),
            "kept for a person to read"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn both_copies_unusable_is_a_loss() {
        let dir = temp_dir("lost");
        save(&dir, &with_budget(1000.0)).expect("saved");
        save(&dir, &with_budget(2000.0)).expect("saved");
        std::fs::write(dir.join(STATE_FILE), b"garbage").expect("corrupt");
        std::fs::write(dir.join(PREVIOUS_STATE_FILE), b"garbage").expect("corrupt");
        let loaded = load(&dir, NOW);
        assert!(loaded.lost);
        assert_eq!(loaded.state, CtldState::default());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn saved_state_is_private_and_keeps_the_copy_it_replaced() {
        use std::os::unix::fs::PermissionsExt;
        let dir = temp_dir("mode");
        save(&dir, &with_budget(1000.0)).expect("saved");
        assert!(
            !dir.join(PREVIOUS_STATE_FILE).exists(),
            "nothing to keep at the first save"
        );
        save(&dir, &with_budget(2000.0)).expect("saved");
        for name in [STATE_FILE, PREVIOUS_STATE_FILE] {
            let mode = std::fs::metadata(dir.join(name))
                .expect("saved")
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{name}: {mode:o}");
        }
        let previous: CtldState = serde_json::from_slice(
            &std::fs::read(dir.join(PREVIOUS_STATE_FILE)).expect("previous"),
        )
        .expect("json");
        assert_eq!(previous, with_budget(1000.0));
        // No temporary file is left behind.
        let names: Vec<String> = std::fs::read_dir(&dir)
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
