//! `power_flex.so`, powerflex's SPANK plugin: the user's `--power-flex=` and the node
//! agent's news of job steps.
//!
//! - **Allocator/local** (sbatch, salloc, srun): registers `--power-flex=VALUE` and
//!   validates it against the site's tiers; a bad value fails submission with the core's
//!   message, and no job is created.
//! - **Remote** (slurmstepd, root): in `slurm_spank_init_post_opt` — root, before tasks are
//!   forked, after options are known — registers the step with the node's agent and puts
//!   `POWERFLEX_TIER` and `POWERFLEX_PROGRESS` into the tasks' environment; in
//!   `slurm_spank_exit` sends the agent a notice that the step ended (no answer awaited).
//! - **Batch step's end** (root): the batch script's end is the job's end on its node.
//!   The plugin waits (within `timeout_ms`) for the agent's answer, which carries the
//!   job's final share there, and appends one line of it to the job's output file as
//!   the job's owner (`output.rs`); `end_line=off` in plugstack.conf turns that off.
//! - **Extern step's end** (root, every node, with `PrologFlags=Contain`): tells the agent
//!   the job ended, so its GPUs return to default even if every step crashed. Without the
//!   extern step, the agent finds the job's end itself (its step daemons gone). The plugin
//!   exports no `slurm_spank_job_epilog`: that made Slurm exec `slurmstepd spank epilog`
//!   for every job on every node, the largest part of the plugin's launch cost.
//!
//! Rules: every entry point runs its body under `catch_unwind` and returns the fail-open
//! code on a panic; one socket exchange per launch with a hard timeout, notices at the
//! end (but for the batch step's, an exchange within the same deadline when the energy
//! line is on); no threads, no NVML, no `unwrap`; global state in a `Mutex` locked with
//! `unwrap_or_else(PoisonError::into_inner)`; logs with a fixed `"%s"` format. Only a bad
//! `--power-flex` value at submission returns an error.

#![allow(unsafe_code)]
// The SPANK entry points are `unsafe extern "C"`: their contract is Slurm's (a valid
// `spank_t`, `ac` C strings in `av`), stated here once rather than on each callback.
#![allow(clippy::missing_safety_doc)]

mod ffi {
    #![allow(
        non_camel_case_types,
        non_upper_case_globals,
        non_snake_case,
        dead_code,
        clippy::all
    )]
    include!(concat!(env!("OUT_DIR"), "/spank_bindings.rs"));
}
pub mod logic;
mod output;
mod wire;

use std::cell::UnsafeCell;
use std::ffi::{c_char, c_int, c_uint, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, PoisonError};

use powerflex_proto::{ControlOp, ControlRequest};

/// Exported for Slurm's plugin loader.
#[no_mangle]
pub static plugin_name: [u8; 11] = *b"power_flex\0";
#[no_mangle]
pub static plugin_type: [u8; 6] = *b"spank\0";
/// Must equal the Slurm this plugin runs under (bindgen reads it from the installed headers).
#[no_mangle]
pub static plugin_version: c_uint = ffi::SLURM_VERSION_NUMBER;

const OPTION_NAME: &CStr = c"power-flex";
const OPTION_ARGINFO: &CStr = c"TIER[,calibrate=auto|off][,preempt=never|suspend|requeue]";
const OPTION_USAGE: &CStr =
    c"powerflex: slowdown this job accepts when the site cuts GPU power: flex0 (none), flex1 (10%), flex2 (25%), flex3 (50%), max-slowdown=N%, or none; preempt=suspend|requeue lets a deep grid cut pause the job";

/// What the plugin keeps between callbacks of one process.
#[derive(Debug, Default)]
struct State {
    args: Option<logic::Args>,
    /// Why the plugin is disabled, when it is.
    disabled: Option<String>,
    /// The --power-flex value, as given.
    flex: Option<String>,
    registered: Option<(String, String)>,
    /// Set when the agent could not be reached: tasks print one warning to the job.
    warn_job: Option<String>,
}

static STATE: Mutex<State> = Mutex::new(State {
    args: None,
    disabled: None,
    flex: None,
    registered: None,
    warn_job: None,
});

fn state() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Frees what the plugin holds, last thing in `slurm_spank_exit`: Slurm unloads the
/// plugin right after that callback, in every context, and memory that only the
/// plugin's statics point to would then stay allocated and unreachable until the process
/// exits (valgrind's "definitely lost" in slurmstepd, `tests/spank_plugin.rs`).
fn release_state() {
    *state() = State::default();
}

/// `--power-flex`, as registered with Slurm. A static rather than a leaked allocation for
/// the same reason: it lives exactly as long as the plugin. Slurm 22.05 copies it at
/// registration; older releases kept the pointer, which a static also satisfies.
struct OptionTable(UnsafeCell<ffi::spank_option>);

// SAFETY: nothing writes the option after it is built (Slurm only reads it), so sharing
// it between threads is sound; the cell only makes the `*mut` Slurm's API takes honest.
unsafe impl Sync for OptionTable {}

static OPTION: OptionTable = OptionTable(UnsafeCell::new(ffi::spank_option {
    name: OPTION_NAME.as_ptr().cast_mut(),
    arginfo: OPTION_ARGINFO.as_ptr().cast_mut(),
    usage: OPTION_USAGE.as_ptr().cast_mut(),
    has_arg: 1,
    val: 0,
    cb: Some(on_option),
}));

/// Logs through Slurm with a fixed format: user text is never a format string.
fn log_error(message: &str) {
    let text =
        CString::new(format!("power_flex: {message}").replace('\0', " ")).unwrap_or_default();
    // SAFETY: both arguments are valid NUL-terminated strings; "%s" consumes one.
    unsafe { ffi::slurm_error(c"%s".as_ptr(), text.as_ptr()) };
}

fn log_info(message: &str) {
    let text =
        CString::new(format!("power_flex: {message}").replace('\0', " ")).unwrap_or_default();
    // SAFETY: as in log_error.
    unsafe { ffi::slurm_info(c"%s".as_ptr(), text.as_ptr()) };
}

/// Runs a callback body; a panic is logged and answered with `fail_open`.
fn guarded(fail_open: c_int, body: impl FnOnce() -> c_int) -> c_int {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(rc) => rc,
        Err(_) => {
            // Logging could panic too (it should not); never let that escape either.
            let _ = catch_unwind(|| log_error("internal error; continuing without powerflex"));
            fail_open
        }
    }
}

fn context() -> ffi::spank_context_t {
    // SAFETY: no arguments; callable from any callback.
    unsafe { ffi::spank_context() }
}

fn args_of(ac: c_int, av: *mut *mut c_char) -> Vec<String> {
    if av.is_null() || ac <= 0 {
        return Vec::new();
    }
    (0..ac as usize)
        .filter_map(|i| {
            // SAFETY: Slurm passes `ac` valid C strings in `av`.
            let p = unsafe { *av.add(i) };
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        })
        .collect()
}

fn getenv(sp: ffi::spank_t, name: &CStr) -> Option<String> {
    let mut buf = vec![0 as c_char; 4096];
    // SAFETY: buf holds 4096 bytes, as passed.
    let rc = unsafe { ffi::spank_getenv(sp, name.as_ptr(), buf.as_mut_ptr(), buf.len() as c_int) };
    if rc != ffi::ESPANK_SUCCESS {
        return None;
    }
    // SAFETY: spank_getenv NUL-terminates within buf on success.
    let value = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    (!value.is_empty()).then_some(value)
}

fn setenv(sp: ffi::spank_t, name: &CStr, value: &str) {
    if let Ok(v) = CString::new(value) {
        // SAFETY: valid C strings; overwrite = 1.
        let rc = unsafe { ffi::spank_setenv(sp, name.as_ptr(), v.as_ptr(), 1) };
        if rc != ffi::ESPANK_SUCCESS {
            log_error(&format!(
                "cannot set {} in the job environment",
                name.to_string_lossy()
            ));
        }
    }
}

fn item_u32(sp: ffi::spank_t, item: ffi::spank_item) -> Option<u32> {
    let mut value: u32 = 0;
    // SAFETY: these items (job id, step id, uid) take one uint32_t* argument.
    let rc = unsafe { ffi::spank_get_item(sp, item, &mut value as *mut u32) };
    (rc == ffi::ESPANK_SUCCESS).then_some(value)
}

/// This node's Slurm name in remote context. The job's environment carries the name of
/// the node the job was *submitted* from (`SLURMD_NODENAME` of the batch host, say), so
/// the name is taken from the step's node list at this node's relative id instead —
/// essential when several `slurmd -N` nodes share one host. The list must hold exactly
/// the step's node count (`S_JOB_NNODES`, slurmstepd's own item), and its expansion stops
/// there ([`logic::node_in_list`]), so a crafted list costs root's slurmstepd nothing.
fn node_name(sp: ffi::spank_t) -> String {
    let id = item_u32(sp, ffi::spank_item_S_JOB_NODEID);
    let nnodes = item_u32(sp, ffi::spank_item_S_JOB_NNODES);
    for var in [
        c"SLURM_STEP_NODELIST",
        c"SLURM_JOB_NODELIST",
        c"SLURM_NODELIST",
    ] {
        if let (Some(id), Some(nnodes), Some(list)) = (id, nnodes, getenv(sp, var)) {
            if let Some(name) = logic::node_in_list(&list, id, nnodes) {
                return name;
            }
        }
    }
    std::env::var("SLURMD_NODENAME").unwrap_or_default()
}

/// The option callback: keeps the value and, at submission, validates it.
unsafe extern "C" fn on_option(_val: c_int, optarg: *const c_char, remote: c_int) -> c_int {
    guarded(0, || {
        let value = if optarg.is_null() {
            String::new()
        } else {
            // SAFETY: Slurm passes the option's argument as a C string.
            unsafe { CStr::from_ptr(optarg) }
                .to_string_lossy()
                .into_owned()
        };
        let mut st = state();
        st.flex = Some(value.clone());
        if remote != 0 || st.disabled.is_some() {
            return 0;
        }
        let args = st.args.clone().unwrap_or_default();
        drop(st);
        match logic::site_policy(&args) {
            Ok(policy) => match logic::validate(&value, &policy.table) {
                // The user database is asked only when it matters: a `none` where the
                // site restricts opting out.
                Ok(()) if matches!(policy.opt_out, powerflex_core::config::OptOut::Anyone) => 0,
                Ok(()) if logic::opt_out_refused(&value, &policy, u32::MAX, None).is_none() => 0,
                Ok(()) => {
                    // At submission, as the submitting user: told now, not at the start.
                    let uid = powerflex_uid();
                    match logic::opt_out_refused(&value, &policy, uid, user_name(uid).as_deref()) {
                        Some(message) => {
                            log_error(&message);
                            -1
                        }
                        None => 0,
                    }
                }
                Err(message) => {
                    log_error(&message);
                    -1
                }
            },
            Err(e) => {
                // The site config is unreadable here: fail open, say so.
                log_error(&format!("{e}; --power-flex not checked"));
                0
            }
        }
    })
}

/// Registers the option and reads the plugstack arguments, in every context.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_init(
    sp: ffi::spank_t,
    ac: c_int,
    av: *mut *mut c_char,
) -> c_int {
    guarded(0, || {
        let raw = args_of(ac, av);
        {
            let mut st = state();
            match logic::parse_args(&raw) {
                Ok(a) => st.args = Some(a),
                Err(e) => {
                    log_error(&format!("{e}; plugin disabled"));
                    st.disabled = Some(e);
                }
            }
        }
        // SAFETY: OPTION is valid for as long as the plugin is loaded, and Slurm only
        // reads it.
        let rc = unsafe { ffi::spank_option_register(sp, OPTION.0.get()) };
        if rc != ffi::ESPANK_SUCCESS {
            log_error("cannot register --power-flex");
        }
        0
    })
}

/// Remote context, root, options known, tasks not yet forked: register the step.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_init_post_opt(
    sp: ffi::spank_t,
    _ac: c_int,
    _av: *mut *mut c_char,
) -> c_int {
    guarded(0, || {
        if context() != ffi::spank_context_S_CTX_REMOTE {
            return 0;
        }
        let (args, flex) = {
            let st = state();
            if st.disabled.is_some() {
                return 0;
            }
            (st.args.clone().unwrap_or_default(), st.flex.clone())
        };
        let mut api = Handle(sp);
        match logic::on_step_start(&mut api, &args, flex.as_deref(), logic::exchange) {
            logic::StepStart::Registered(job, step) => state().registered = Some((job, step)),
            logic::StepStart::WarnJob(line) => state().warn_job = Some(line),
            logic::StepStart::Skipped => {}
        }
        0
    })
}

/// [`logic::Spank`] over the real handle.
struct Handle(ffi::spank_t);

impl logic::Spank for Handle {
    fn job_id(&self) -> Option<u32> {
        item_u32(self.0, ffi::spank_item_S_JOB_ID)
    }
    fn step_id(&self) -> Option<u32> {
        item_u32(self.0, ffi::spank_item_S_JOB_STEPID)
    }
    fn uid(&self) -> Option<u32> {
        item_u32(self.0, ffi::spank_item_S_JOB_UID)
    }
    fn node(&self) -> String {
        node_name(self.0)
    }
    fn getenv(&self, name: &str) -> Option<String> {
        CString::new(name).ok().and_then(|n| getenv(self.0, &n))
    }
    fn setenv(&mut self, name: &str, value: &str) {
        if let Ok(n) = CString::new(name) {
            setenv(self.0, &n, value);
        }
    }
    fn log_error(&self, message: &str) {
        log_error(message);
    }
    fn log_info(&self, message: &str) {
        log_info(message);
    }
    fn user_name(&self, uid: u32) -> Option<String> {
        user_name(uid)
    }
}

/// The real uid of this process (the submitting user in sbatch, salloc and srun).
fn powerflex_uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

/// The user name of `uid` from the system's user database (`getpwuid_r`, reentrant:
/// slurmstepd has threads). `None` when it has none or the lookup fails.
fn user_name(uid: u32) -> Option<String> {
    let mut size = 16 * 1024;
    while size <= 1024 * 1024 {
        let mut buf = vec![0 as c_char; size];
        // SAFETY: `passwd` is plain data; getpwuid_r fills it and `result` and points
        // its strings into `buf`, which outlives every read below.
        let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call; `buf.len()` is its true size.
        let rc =
            unsafe { libc::getpwuid_r(uid, &mut pwd, buf.as_mut_ptr(), buf.len(), &mut result) };
        if rc == libc::ERANGE {
            size *= 4;
            continue;
        }
        if rc != 0 || result.is_null() || pwd.pw_name.is_null() {
            return None;
        }
        // SAFETY: on success pw_name is a NUL-terminated string inside `buf`.
        let name = unsafe { CStr::from_ptr(pwd.pw_name) };
        return Some(name.to_string_lossy().into_owned());
    }
    None
}

/// In each task (as the user): the one line the job sees when the agent was unreachable.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_task_init(
    _sp: ffi::spank_t,
    _ac: c_int,
    _av: *mut *mut c_char,
) -> c_int {
    guarded(0, || {
        if context() == ffi::spank_context_S_CTX_REMOTE {
            if let Some(w) = state().warn_job.take() {
                eprintln!("{w}");
            }
        }
        0
    })
}

/// The last callback in every context. Remote: the step is over, tell the agent. Then
/// free the plugin's state, since Slurm unloads the plugin next.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_exit(
    sp: ffi::spank_t,
    _ac: c_int,
    _av: *mut *mut c_char,
) -> c_int {
    guarded(0, || {
        if context() == ffi::spank_context_S_CTX_REMOTE {
            step_ended(sp);
        }
        release_state();
        0
    })
}

/// Remote context, the step is over: a notice to the agent (of the step's end, or of the
/// job's when this is the extern step).
fn step_ended(sp: ffi::spank_t) {
    let (args, registered) = {
        let st = state();
        (st.args.clone().unwrap_or_default(), st.registered.clone())
    };
    // The extern step (PrologFlags=Contain) lives from the job's allocation to its
    // end on every node of the job: its end is the job's end there. This is the
    // job-end signal; exporting slurm_spank_job_epilog instead made Slurm exec
    // `slurmstepd spank epilog` for every job, on every node.
    if item_u32(sp, ffi::spank_item_S_JOB_STEPID) == Some(logic::EXTERN_STEP) {
        let Some(job_id) = item_u32(sp, ffi::spank_item_S_JOB_ID) else {
            return;
        };
        let node = node_name(sp);
        let request = ControlRequest::new(ControlOp::EndJob {
            job_id: job_id.to_string(),
        });
        // The agent may be down (or the job never managed): nothing to undo then. A
        // notice, not an exchange: a stopped agent must not hold the job's end (srun
        // waits for the extern step), and the agent finds the end itself regardless.
        if let Err(e) = logic::notify(&args.socket, &node, &request, args.timeout) {
            log_info(&e);
        }
        return;
    }
    let Some((job_id, step_id)) = registered else {
        return;
    };
    let node = node_name(sp);
    let batch = step_id == logic::step_name(logic::BATCH_STEP);
    let request = ControlRequest::new(ControlOp::EndStep { job_id, step_id });
    if batch && args.end_line {
        batch_ended(sp, &args, &node, &request);
        return;
    }
    if let Err(e) = logic::notify(&args.socket, &node, &request, args.timeout) {
        log_error(&e);
    }
}

/// The batch script ended (root, in slurmstepd): the job's end on this node. Asks the
/// agent to end the job's hold and answer with its final share, then appends the share's
/// line to the job's output as its owner. All of it within `timeout_ms`: past the
/// deadline, or on any failure, the job simply gets no line (logged at info).
fn batch_ended(sp: ffi::spank_t, args: &logic::Args, node: &str, request: &ControlRequest) {
    let deadline = std::time::Instant::now() + args.timeout;
    let reply = match logic::exchange(&args.socket, node, request, args.timeout) {
        Ok(reply) => reply,
        Err(e) => {
            log_error(&e);
            return;
        }
    };
    let (Some(job_id), Some(uid), Some(gid)) = (
        item_u32(sp, ffi::spank_item_S_JOB_ID),
        item_u32(sp, ffi::spank_item_S_JOB_UID),
        item_u32(sp, ffi::spank_item_S_JOB_GID),
    ) else {
        return;
    };
    let job_nodes = ["SLURM_JOB_NUM_NODES", "SLURM_NNODES"]
        .iter()
        .find_map(|v| {
            CString::new(*v)
                .ok()
                .and_then(|n| getenv(sp, &n))
                .and_then(|n| n.parse::<u32>().ok())
        })
        .unwrap_or(1);
    let Some(line) = logic::end_line_of(&reply, uid, job_nodes) else {
        log_info(&format!(
            "job {job_id}: no energy line in its output: the agent gave no final share ({})",
            reply.error_message().unwrap_or("none ended here")
        ));
        return;
    };
    let owner = output::Owner {
        uid,
        gid,
        groups: supplementary_groups(sp),
    };
    let written = output::stdout_path(job_id, deadline)
        .and_then(|path| output::append_line(&path, &line, &owner, deadline).map(|()| path));
    match written {
        Ok(path) => log_info(&format!(
            "job {job_id}: energy line appended to {}",
            path.display()
        )),
        Err(e) => log_info(&format!("job {job_id}: no energy line in its output: {e}")),
    }
}

/// The job's supplementary groups as slurmstepd holds them (empty if it cannot say).
fn supplementary_groups(sp: ffi::spank_t) -> Vec<u32> {
    let mut gids: *mut libc::gid_t = std::ptr::null_mut();
    let mut count: c_int = 0;
    // SAFETY: S_JOB_SUPPLEMENTARY_GIDS takes (gid_t **, int *); both are valid for writes.
    let rc = unsafe {
        ffi::spank_get_item(
            sp,
            ffi::spank_item_S_JOB_SUPPLEMENTARY_GIDS,
            &mut gids as *mut *mut libc::gid_t,
            &mut count as *mut c_int,
        )
    };
    if rc != ffi::ESPANK_SUCCESS || gids.is_null() || !(1..=65_536).contains(&count) {
        return Vec::new();
    }
    // SAFETY: on success Slurm points `gids` at its own array of `count` gids, which
    // lives as long as the step record; it is copied at once.
    unsafe { std::slice::from_raw_parts(gids, count as usize) }.to_vec()
}
