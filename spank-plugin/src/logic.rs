//! The plugin's decisions, free of FFI: plugstack arguments, option validation, what to
//! send the agent and what to do with its answer. The FFI shim (`lib.rs`) implements
//! [`Spank`] over the real `spank_t`; unit tests implement it with a fake.

use std::path::PathBuf;
use std::time::Duration;

use powerflex_core::config::{expand_node, SiteConfig};
use powerflex_core::flex::{parse_power_flex, Service, TierTable};
use powerflex_core::slurm_record::valid_node_name;
use powerflex_proto::{ControlAnswer, ControlOp, ControlReply, ControlRequest};

/// Default agent socket (as in the site config's default).
pub const DEFAULT_SOCKET: &str = "/run/powerflex/%n.sock";
/// Default bound on the time one callback may spend talking to the agent.
pub const DEFAULT_TIMEOUT_MS: u64 = 200;
/// Slurm's special step ids.
pub const BATCH_STEP: u32 = 0xffff_fffb;
pub const EXTERN_STEP: u32 = 0xffff_fffc;
pub const INTERACTIVE_STEP: u32 = 0xffff_fffa;

/// plugstack.conf arguments: `site=PATH socket=PATTERN timeout_ms=N default=TIER
/// end_line=on|off`.
#[derive(Debug, Clone, PartialEq)]
pub struct Args {
    pub site: Option<PathBuf>,
    pub socket: String,
    pub timeout: Duration,
    /// Service for jobs that give no --power-flex (overrides the site's default).
    pub default: Option<String>,
    /// Whether a managed batch job's output ends with the powerflex line (`end_line=`).
    pub end_line: bool,
}

impl Default for Args {
    fn default() -> Args {
        Args {
            site: None,
            socket: DEFAULT_SOCKET.to_string(),
            timeout: Duration::from_millis(DEFAULT_TIMEOUT_MS),
            default: None,
            end_line: true,
        }
    }
}

/// The keys `parse_args` accepts, for its error messages.
const ACCEPTED_KEYS: &str = "site, socket, timeout_ms, default, end_line";

/// Parses plugstack.conf arguments. An error disables the plugin (it never fails jobs).
pub fn parse_args(args: &[String]) -> Result<Args, String> {
    let mut out = Args::default();
    for arg in args {
        let (key, value) = arg.split_once('=').ok_or_else(|| {
            format!("plugstack argument \"{arg}\" is not key=value; accepted keys: {ACCEPTED_KEYS}")
        })?;
        match key {
            "site" if value.starts_with('/') => out.site = Some(PathBuf::from(value)),
            "site" => return Err(format!("site= must be an absolute path (got \"{value}\")")),
            "socket" if value.starts_with('/') => out.socket = value.to_string(),
            "socket" => {
                return Err(format!(
                    "socket= must be an absolute path, %n = node name (got \"{value}\")"
                ))
            }
            "timeout_ms" => match value.parse::<u64>() {
                Ok(ms) if (1..=5000).contains(&ms) => out.timeout = Duration::from_millis(ms),
                _ => {
                    return Err(format!(
                        "timeout_ms= must be 1 to 5000 milliseconds (got \"{value}\")"
                    ))
                }
            },
            "default" if !value.is_empty() => out.default = Some(value.to_string()),
            "default" => return Err("default= needs a tier (or none)".into()),
            "end_line" => match value {
                "on" => out.end_line = true,
                "off" => out.end_line = false,
                _ => return Err(format!("end_line= must be on or off (got \"{value}\")")),
            },
            other => {
                return Err(format!(
                    "unknown plugstack argument \"{other}\"; accepted keys: {ACCEPTED_KEYS}"
                ))
            }
        }
    }
    Ok(out)
}

/// What the site offers and allows: its tiers, the default service, and who may opt out
/// (`tiers.opt_out`). From the site config when `site=` names one that parses, else the
/// built-in tiers, `none` as default and anyone may opt out.
#[derive(Debug, Clone)]
pub struct SitePolicy {
    pub table: TierTable,
    pub default: Service,
    pub opt_out: powerflex_core::config::OptOut,
}

/// [`SitePolicy`] from the plugstack arguments.
pub fn site_policy(args: &Args) -> Result<SitePolicy, String> {
    let (table, mut default, opt_out) = match &args.site {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            let site =
                SiteConfig::from_toml_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
            (site.tiers.table, site.tiers.default, site.tiers.opt_out)
        }
        None => (
            TierTable::default_table(),
            Service::Unmanaged,
            powerflex_core::config::OptOut::Anyone,
        ),
    };
    if let Some(d) = &args.default {
        default = parse_power_flex(d, &table)
            .map_err(|e| format!("default={d}: {e}"))?
            .service;
        if !default.is_managed() && matches!(opt_out, powerflex_core::config::OptOut::Listed(_)) {
            return Err(format!(
                "default={d}: the site lets only listed users opt out (tiers.opt_out = \"listed\"), so the default must be a tier"
            ));
        }
    }
    Ok(SitePolicy {
        table,
        default,
        opt_out,
    })
}

/// The service, and the `--power-flex` value to send the agent, for a step whose value
/// does not parse on the node: the site's default tier (the agent applies it to an empty
/// value), or, where the site's default is `none`, its least flexible tier, so that such
/// a step is never unmanaged.
pub fn managed_fallback(policy: &SitePolicy) -> (Service, String) {
    if policy.default.is_managed() {
        return (policy.default.clone(), String::new());
    }
    let strictest = policy
        .table
        .tiers()
        .iter()
        .min_by(|a, b| a.max_slowdown.0.total_cmp(&b.max_slowdown.0));
    match strictest {
        Some(tier) => (
            Service::Bounded {
                tier: tier.name.clone(),
                max_slowdown: tier.max_slowdown,
            },
            tier.name.clone(),
        ),
        // No named tiers: the table allows `max-slowdown=N%` (it must, to be valid).
        None => (
            Service::Bounded {
                tier: powerflex_core::flex::MAX_SLOWDOWN_KEY.to_string(),
                max_slowdown: powerflex_core::units::SlowdownFraction(0.0),
            },
            format!("{}=0%", powerflex_core::flex::MAX_SLOWDOWN_KEY),
        ),
    }
}

/// Whether `value` asks to opt out (`none`) where the site does not let `uid` (named
/// `user`) do so: the message for the user, naming what is accepted.
pub fn opt_out_refused(
    value: &str,
    policy: &SitePolicy,
    uid: u32,
    user: Option<&str>,
) -> Option<String> {
    let request = parse_power_flex(value, &policy.table).ok()?;
    if request.service.is_managed() || policy.opt_out.allows(uid, user) {
        return None;
    }
    Some(format!(
        "--power-flex=none is not open to user {} on this site (tiers.opt_out = \"listed\"); accepted: {}{}",
        user.map_or_else(|| format!("uid {uid}"), str::to_string),
        policy.table.names().collect::<Vec<_>>().join(", "),
        if policy.table.allows_max_slowdown() {
            ", max-slowdown=N%"
        } else {
            ""
        }
    ))
}

/// Validates a `--power-flex` value at submission; `Err` is the message for the user.
pub fn validate(value: &str, table: &TierTable) -> Result<(), String> {
    parse_power_flex(value, table)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// The step id as the agent names it.
pub fn step_name(step: u32) -> String {
    match step {
        BATCH_STEP => "batch".into(),
        EXTERN_STEP => "extern".into(),
        INTERACTIVE_STEP => "interactive".into(),
        n => n.to_string(),
    }
}

/// One request, one reply, over the agent's socket, all within `budget`.
pub fn exchange(
    socket: &str,
    node: &str,
    request: &ControlRequest,
    budget: Duration,
) -> Result<ControlReply, String> {
    let path = expand_node(socket, node);
    let line = crate::wire::exchange_within(
        &path,
        request.to_line().as_bytes(),
        // A batch step's end is answered with the job's share (every GPU, every cap
        // held), longer than a request line; replies come from the root-owned agent.
        powerflex_proto::MAX_REPLY_BYTES,
        budget,
    )?;
    ControlReply::from_line(&line).map_err(|e| format!("bad answer from the powerflex agent: {e}"))
}

/// Longest a step's end may wait on the agent, s: the notice is sent, not answered (the
/// agent also finds a job's end from its processes), so only a full backlog can cost time.
pub const NOTICE_BUDGET: Duration = Duration::from_millis(20);

/// Sends a notice (`EndStep`, `EndJob`) without waiting for the answer, within
/// `budget.min(NOTICE_BUDGET)`.
pub fn notify(
    socket: &str,
    node: &str,
    request: &ControlRequest,
    budget: Duration,
) -> Result<(), String> {
    let path = expand_node(socket, node);
    crate::wire::send_within(
        &path,
        request.to_line().as_bytes(),
        budget.min(NOTICE_BUDGET),
    )
}

/// The line for the end of the job's output from the agent's answer to the batch step's
/// end: the job's final share on this node, if the agent ended the job's hold there and
/// the share is the job owner's (`uid`, Slurm's). `job_nodes` is the job's node count.
/// `None` (no line) for anything else: an agent that kept the job, an older agent, a
/// refusal.
pub fn end_line_of(reply: &ControlReply, uid: u32, job_nodes: u32) -> Option<String> {
    let share = reply.ended_share().filter(|s| s.ended)?;
    if share.uid != uid {
        return None;
    }
    // One line, whatever the agent's words hold.
    Some(share.end_line(job_nodes.max(1)).replace(['\n', '\r'], " "))
}

/// This node's name in a step's node list: the `node_id`-th name of `list`, where the
/// list must hold exactly `nnodes` names (both items come from slurmstepd's own record
/// of the step, the list from the step's environment). The expansion stops at `nnodes`
/// names, so a crafted list costs no more than the step's real size; a list of another
/// length says nothing.
pub fn node_in_list(list: &str, node_id: u32, nnodes: u32) -> Option<String> {
    let max = (nnodes as usize).min(powerflex_core::slurm_record::MAX_HOSTLIST_NAMES);
    let names = powerflex_core::slurm_record::expand_hostlist(list, max)?;
    if names.len() != nnodes as usize {
        return None;
    }
    names.into_iter().nth(node_id as usize)
}

/// What the remote (slurmstepd) side knows about the step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepInfo {
    pub job_id: u32,
    pub step_id: u32,
    pub uid: u32,
    pub node: String,
    pub gpus: Vec<String>,
}

/// Builds the registration for a step with service `flex` (already validated).
pub fn register_request(step: &StepInfo, flex: &str) -> ControlRequest {
    ControlRequest::new(ControlOp::Register {
        job_id: step.job_id.to_string(),
        step_id: step_name(step.step_id),
        uid: step.uid,
        node: step.node.clone(),
        gpus: step.gpus.clone(),
        flex: flex.to_string(),
    })
}

/// What the step-start logic needs from SPANK (the FFI shim implements it over `spank_t`;
/// tests use a fake).
pub trait Spank {
    fn job_id(&self) -> Option<u32>;
    fn step_id(&self) -> Option<u32>;
    fn uid(&self) -> Option<u32>;
    /// This node's Slurm name.
    fn node(&self) -> String;
    /// A variable of the job's environment.
    fn getenv(&self, name: &str) -> Option<String>;
    /// Sets a variable in the tasks' environment.
    fn setenv(&mut self, name: &str, value: &str);
    fn log_error(&self, message: &str);
    fn log_info(&self, message: &str);
    /// The user name of `uid` (the system's user database), if it has one.
    fn user_name(&self, uid: u32) -> Option<String>;
}

/// What happened at step start, for the state the other callbacks read.
#[derive(Debug, Clone, PartialEq)]
pub enum StepStart {
    /// Nothing to do: unmanaged, no GPUs, extern step, or an unusable setup (logged).
    Skipped,
    /// Registered: (job id, step name) for the step's end.
    Registered(String, String),
    /// The agent could not be reached or refused: the line the job's tasks print.
    WarnJob(String),
}

/// The remote-context step start: decide the service, register with the agent through
/// `send`, and export the tier and progress address to the tasks.
pub fn on_step_start(
    api: &mut impl Spank,
    args: &Args,
    flex: Option<&str>,
    send: impl FnOnce(&str, &str, &ControlRequest, Duration) -> Result<ControlReply, String>,
) -> StepStart {
    let policy = match site_policy(args) {
        Ok(p) => p,
        Err(e) => {
            api.log_error(&format!("{e}; job runs unmanaged"));
            return StepStart::Skipped;
        }
    };
    let table = &policy.table;
    let (mut service, mut flex) = match flex.filter(|f| !f.is_empty()) {
        Some(f) => match parse_power_flex(f, table) {
            Ok(r) => (r.service, f.to_string()),
            Err(e) => {
                // Validated at submission, so this value reached the node some other way
                // (an environment edited after sbatch, a site config changed since): it
                // must not buy the job a way out of the budget.
                let (service, flex) = managed_fallback(&policy);
                let tier = match &service {
                    Service::Bounded { tier, .. } => tier.as_str(),
                    Service::Unmanaged => "none",
                };
                api.log_error(&format!(
                    "{e}; the job runs under the site's default tier ({tier})"
                ));
                (service, flex)
            }
        },
        None => (policy.default.clone(), String::new()),
    };
    // Who may opt out is the site's to say, here in root's slurmstepd as at submission:
    // a `none` the site does not allow this user runs under the site's default tier.
    let restricted = matches!(policy.opt_out, powerflex_core::config::OptOut::Listed(_));
    if restricted && !service.is_managed() && !flex.is_empty() {
        // An unknown uid is not on the list: the opt-out is refused (fails closed on
        // the budget's side; the job still runs, under the default tier).
        let uid = api.uid().unwrap_or(u32::MAX);
        let user = api.user_name(uid);
        if let Some(why) = opt_out_refused(&flex, &policy, uid, user.as_deref()) {
            api.log_error(&format!(
                "{why}; the job runs under the site's default tier"
            ));
            service = policy.default.clone();
            flex = String::new();
        }
    }
    // An unmanaged step (an opt-out the site allows, or a site default of `none`) is
    // registered too, as `none`: its GPUs are then a job's, left at their default limit,
    // not use the agent sees no registration for (which a site may hold at the
    // fail-safe, `agent.unregistered_gpu_use`). It gets no progress address, and a
    // failure only logs: the step runs unmanaged either way.
    let managed = service.is_managed();
    if !managed {
        flex = powerflex_core::flex::UNMANAGED.to_string();
    }
    let (Some(job_id), Some(step_id), Some(uid)) = (api.job_id(), api.step_id(), api.uid()) else {
        api.log_error("cannot read the job id, step id or uid; job runs unmanaged");
        return StepStart::Skipped;
    };
    let gpus: Vec<String> = api
        .getenv(slurm_gpu_var(step_id))
        .map(|g| {
            g.split(',')
                .map(str::to_string)
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let node = api.node();
    // It stands for `%n` in the agent's socket path: a Slurm node name, never a path (no
    // `/`), whatever the environment it was read from held.
    if !valid_node_name(&node) {
        api.log_error(&format!(
            "node name {node:?} is not a Slurm node name (1 to 64 of A-Z a-z 0-9 . _ -); job runs unmanaged"
        ));
        return StepStart::Skipped;
    }
    let step = StepInfo {
        job_id,
        step_id,
        uid,
        node,
        gpus,
    };
    if !should_register(&step) {
        return StepStart::Skipped;
    }
    match send(
        &args.socket,
        &step.node,
        &register_request(&step, &flex),
        args.timeout,
    ) {
        Ok(ControlReply::Done(answer)) => {
            if let ControlAnswer::Registered { tier, progress } = &answer {
                if let Some(tier) = tier {
                    api.setenv("POWERFLEX_TIER", tier);
                }
                if let Some(progress) = progress {
                    api.setenv("POWERFLEX_PROGRESS", progress);
                }
            }
            api.log_info(&format!(
                "job {job_id} step {} registered with the agent",
                step_name(step_id)
            ));
            StepStart::Registered(job_id.to_string(), step_name(step_id))
        }
        Ok(ControlReply::Refused(why)) if !managed => {
            api.log_error(&format!(
                "agent refused unmanaged job {job_id}: {why}; it runs unmanaged"
            ));
            StepStart::Skipped
        }
        Err(e) if !managed => {
            api.log_error(&format!("{e}; unmanaged job {job_id} not registered"));
            StepStart::Skipped
        }
        Ok(ControlReply::Refused(why)) => {
            api.log_error(&format!(
                "agent refused job {job_id}: {why}; the job runs unmanaged"
            ));
            StepStart::WarnJob(format!("powerflex: the node agent refused this job ({why}); it runs without power management"))
        }
        Err(e) => {
            api.log_error(&format!("{e}; job {job_id} runs unmanaged"));
            StepStart::WarnJob(
                "powerflex: warning: the node's power agent is not reachable; this job runs without power management".into(),
            )
        }
    }
}

/// The variable that holds a step's GPUs on this node as slurmstepd itself wrote it.
///
/// slurmstepd (Slurm 22.05, `stepd_step_rec_create` and its batch twin) builds the step's
/// environment from the user's and then has the GPU gres plugin write the GPUs over
/// it, before any SPANK callback runs: `SLURM_STEP_GPUS` for a step launched by srun,
/// `SLURM_JOB_GPUS` for the batch and interactive steps. A step given no GPUs has the
/// variable *removed* (the gres plugins unset it "since this means GRES is not
/// allocated"), so a value the user exported does not survive into the plugin's view.
/// The other variables do not have that guarantee: `SLURM_JOB_GPUS` in an srun step is
/// the submitting side's (the batch node's GPUs, or whatever the user exported), and
/// `CUDA_VISIBLE_DEVICES` is written only where gres.conf asks for it and is
/// renumbered inside a device cgroup. So the plugin reads exactly one variable per step
/// kind, and nothing else; the agent then checks the claim against NVML's process
/// lists. This holds on nodes where `GresTypes` includes `gpu` (every GPU node Slurm
/// schedules GPUs on).
pub fn slurm_gpu_var(step_id: u32) -> &'static str {
    match step_id {
        BATCH_STEP | INTERACTIVE_STEP => "SLURM_JOB_GPUS",
        _ => "SLURM_STEP_GPUS",
    }
}

/// Whether a step should be registered at all: it has GPUs and is not the extern step.
/// Managed or not: an unmanaged step's GPUs are registered as its own (see
/// [`on_step_start`]).
pub fn should_register(step: &StepInfo) -> bool {
    !step.gpus.is_empty() && step.step_id != EXTERN_STEP
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn plugstack_arguments() {
        let a = parse_args(&s(&[
            "site=/etc/slurm/powerflex.toml",
            "socket=/run/pf/%n.sock",
            "timeout_ms=150",
            "default=flex1",
        ]))
        .expect("ok");
        assert_eq!(a.site, Some(PathBuf::from("/etc/slurm/powerflex.toml")));
        assert_eq!(a.socket, "/run/pf/%n.sock");
        assert_eq!(a.timeout, Duration::from_millis(150));
        assert_eq!(a.default.as_deref(), Some("flex1"));
        assert_eq!(parse_args(&[]).expect("defaults"), Args::default());
        for bad in [
            &["site=relative"][..],
            &["timeout_ms=0"],
            &["timeout_ms=x"],
            &["color=red"],
            &["novalue"],
            &["default="],
        ] {
            assert!(parse_args(&s(bad)).is_err(), "{bad:?}");
        }
        assert!(parse_args(&s(&["color=red"]))
            .expect_err("msg")
            .contains("accepted keys: site, socket, timeout_ms, default, end_line"));
    }

    #[test]
    fn the_end_line_is_on_unless_the_site_turns_it_off() {
        assert!(Args::default().end_line);
        assert!(parse_args(&s(&["end_line=on"])).expect("on").end_line);
        assert!(!parse_args(&s(&["end_line=off"])).expect("off").end_line);
        assert_eq!(
            parse_args(&s(&["end_line=no"])).expect_err("no"),
            "end_line= must be on or off (got \"no\")"
        );
    }

    fn ended_share(uid: u32) -> powerflex_proto::usage::NodeUsage {
        powerflex_proto::usage::NodeUsage {
            job_id: "42".into(),
            node: "n2".into(),
            uid,
            tier: "flex2".into(),
            gpus: vec![],
            energy_mj: 12_345_000,
            energy_source: powerflex_proto::usage::EnergySource::Counter,
            from_unix_ms: 0,
            to_unix_ms: 10_000,
            peak_power_w: 0.0,
            observed_s: 10.0,
            capped_s: 6.3,
            event_s: 0.0,
            power_throttled_s: 0.0,
            throttle_known_s: 0.0,
            caps: vec![],
            slowdown_pct: None,
            bound_pct: Some(25.0),
            bound_held: None,
            bound_judgement: None,
            saved_estimate_j: None,
            work: None,
            work_unit: None,
            pfi: None,
            ended: true,
            simulated: true,
        }
    }

    #[test]
    fn the_end_line_comes_only_from_the_owner_s_final_share() {
        let reply = |share| ControlReply::Done(ControlAnswer::StepEnded(Box::new(share)));
        let line = end_line_of(&reply(ended_share(1000)), 1000, 1).expect("line");
        assert!(
            line.starts_with(
                "powerflex: job 42 used 3.4 Wh on 0 GPUs (counter), capped 63 % of the time"
            ),
            "{line}"
        );
        assert!(line.ends_with("[SIMULATED GPUs]"), "{line}");
        assert!(end_line_of(&reply(ended_share(1000)), 1000, 2)
            .expect("line")
            .contains("this node's share of 2 nodes"));
        assert_eq!(
            end_line_of(&reply(ended_share(1001)), 1000, 1),
            None,
            "not the owner's"
        );
        let mut running = ended_share(1000);
        running.ended = false;
        assert_eq!(end_line_of(&reply(running), 1000, 1), None, "not final");
        assert_eq!(
            end_line_of(&ControlReply::ok(), 1000, 1),
            None,
            "an older agent"
        );
        let refused = ControlReply::error("refused");
        assert_eq!(end_line_of(&refused, 1000, 1), None);
    }

    #[test]
    fn tiers_from_defaults_and_validation_messages() {
        let SitePolicy { table, default, .. } = site_policy(&Args::default()).expect("defaults");
        assert_eq!(default, Service::Unmanaged);
        assert!(validate("flex2", &table).is_ok());
        assert!(validate("flex3,calibrate=off", &table).is_ok());
        assert!(validate("flex3,preempt=suspend", &table).is_ok());
        assert_eq!(
            validate("flex0,preempt=suspend", &table).expect_err("flex0"),
            "preempt=suspend does not apply to \"flex0\", which allows no slowdown: such jobs are never suspended or requeued; drop preempt= or choose a tier that allows slowdown"
        );
        assert_eq!(
            validate("flex9", &table).expect_err("bad"),
            "unknown tier \"flex9\"; this site offers: flex0, flex1, flex2, flex3, none, or max-slowdown=N%"
        );
        let with_default = Args {
            default: Some("flex1".into()),
            ..Args::default()
        };
        assert!(site_policy(&with_default).expect("ok").default.is_managed());
        let missing = Args {
            site: Some(PathBuf::from("/nonexistent/powerflex.toml")),
            ..Args::default()
        };
        assert!(site_policy(&missing)
            .expect_err("missing")
            .contains("cannot read /nonexistent/powerflex.toml"));
    }

    #[test]
    fn steps_and_requests() {
        let step = StepInfo {
            job_id: 42,
            step_id: BATCH_STEP,
            uid: 1000,
            node: "n1".into(),
            gpus: vec!["0".into(), "1".into()],
        };
        let line = register_request(&step, "flex2").to_line();
        assert!(
            line.contains("\"step_id\":\"batch\"") && line.contains("\"job_id\":\"42\""),
            "{line}"
        );
        assert!(should_register(&step));
        assert!(!should_register(&StepInfo {
            gpus: vec![],
            ..step.clone()
        }));
        assert!(!should_register(&StepInfo {
            step_id: EXTERN_STEP,
            ..step
        }));
        assert_eq!(step_name(3), "3");
    }

    #[test]
    fn an_absent_agent_fails_fast() {
        let t = std::time::Instant::now();
        let e = exchange(
            "/nonexistent/%n.sock",
            "n1",
            &ControlRequest::new(ControlOp::Status),
            Duration::from_millis(200),
        )
        .expect_err("down");
        assert!(
            e.contains("cannot reach the powerflex agent at /nonexistent/n1.sock"),
            "{e}"
        );
        assert!(t.elapsed() < Duration::from_millis(200));
    }

    #[test]
    fn the_node_name_is_the_step_s_own_entry_of_a_list_of_the_step_s_size() {
        assert_eq!(node_in_list("n[1-3]", 1, 3).as_deref(), Some("n2"));
        assert_eq!(
            node_in_list("gpu[01-02,07],login", 3, 4).as_deref(),
            Some("login")
        );
        // A list longer or shorter than the step is not the step's.
        assert_eq!(node_in_list("n[1-3]", 1, 2), None);
        assert_eq!(node_in_list("n[1-3]", 1, 4), None);
        assert_eq!(node_in_list("n[3-1]", 0, 1), None);
        // A crafted list is cut off at the step's size, not expanded to the end.
        let crafted = format!("n[{}]", ["0-60000"; 1000].join(","));
        assert_eq!(node_in_list(&crafted, 0, 2), None);
    }

    use std::collections::BTreeMap;

    /// A fake SPANK handle: a job environment, items, and what the plugin did.
    #[derive(Default)]
    struct Fake {
        env: BTreeMap<String, String>,
        exported: BTreeMap<String, String>,
        errors: std::cell::RefCell<Vec<String>>,
        step: Option<u32>,
    }

    impl Spank for Fake {
        fn job_id(&self) -> Option<u32> {
            Some(42)
        }
        fn step_id(&self) -> Option<u32> {
            self.step.or(Some(0))
        }
        fn uid(&self) -> Option<u32> {
            Some(1000)
        }
        fn node(&self) -> String {
            "n2".into()
        }
        fn getenv(&self, name: &str) -> Option<String> {
            self.env.get(name).cloned()
        }
        fn setenv(&mut self, name: &str, value: &str) {
            self.exported.insert(name.into(), value.into());
        }
        fn log_error(&self, message: &str) {
            self.errors.borrow_mut().push(message.into());
        }
        fn log_info(&self, _: &str) {}
        fn user_name(&self, uid: u32) -> Option<String> {
            (uid == 1000).then(|| "alice".to_string())
        }
    }

    fn with_gpus() -> Fake {
        let mut f = Fake::default();
        f.env.insert("SLURM_STEP_GPUS".into(), "0,1".into());
        f
    }

    /// A `none` the site does not allow must not run uncapped: a user looking for the
    /// cheapest tier gets the site's default instead.
    #[test]
    fn a_none_the_site_does_not_allow_runs_under_the_default_tier() {
        let dir = std::env::temp_dir().join(format!("pf-spank-optout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let site = dir.join("powerflex.toml");
        // The shipped config: only root may opt out, jobs without the option are flex0.
        let shipped = include_str!("../../slurm-conf/powerflex.toml");
        assert!(shipped.contains("opt_out = \"listed\"\nopt_out_users = []\n"));
        assert!(shipped.contains("\ndefault = \"flex0\"\n"));
        let text = shipped
            .replacen("opt_out_users = []", "opt_out_users = [\"svc-infer\"]", 1)
            .replacen("\ndefault = \"flex0\"\n", "\ndefault = \"flex2\"\n", 1);
        std::fs::write(&site, text).expect("write");
        let args = Args {
            site: Some(site.clone()),
            ..Args::default()
        };
        let policy = site_policy(&args).expect("site parses");
        let refused = opt_out_refused("none", &policy, 1000, Some("alice")).expect("refused");
        assert!(refused.contains("not open to user alice"), "{refused}");
        assert!(refused.contains("accepted: flex0"), "{refused}");
        assert_eq!(
            opt_out_refused("none", &policy, 1001, Some("svc-infer")),
            None
        );
        assert_eq!(opt_out_refused("none", &policy, 0, None), None, "root");
        assert_eq!(opt_out_refused("flex1", &policy, 1000, Some("alice")), None);
        // In slurmstepd: alice's `none` registers under the site's default.
        let mut fake = with_gpus();
        let mut sent = None;
        let outcome = on_step_start(&mut fake, &args, Some("none"), |_, _, r, _| {
            sent = Some(r.to_line());
            Ok(ControlReply::ok())
        });
        assert!(matches!(outcome, StepStart::Registered(..)), "{outcome:?}");
        let line = sent.expect("registered");
        assert!(
            line.contains("\"flex\":\"\""),
            "the default tier, not none: {line}"
        );
        assert!(fake
            .errors
            .borrow()
            .iter()
            .any(|e| e.contains("not open to user alice")));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The node name goes into the agent's socket path, so one that is a path is refused.
    #[test]
    fn a_node_name_that_is_a_path_registers_nothing() {
        assert!(valid_node_name("n1") && valid_node_name("gpu-a01.rack_3"));
        for bad in ["", "../../tmp/x", "n1/x", "n 1", &"n".repeat(65)] {
            assert!(!valid_node_name(bad), "{bad}");
        }
    }

    /// Where Slurm set no step GPUs, variables the user exported (`SLURM_JOB_GPUS` in an
    /// srun step, `CUDA_VISIBLE_DEVICES`) must not claim the node's GPUs.
    #[test]
    fn gpus_come_only_from_the_variable_slurmstepd_writes_for_the_step_kind() {
        let never =
            |_: &str, _: &str, _: &ControlRequest, _: Duration| -> Result<ControlReply, String> {
                panic!("must not contact the agent")
            };
        let mut forged = Fake::default();
        forged.env.insert("SLURM_JOB_GPUS".into(), "0,1,2,3".into());
        forged
            .env
            .insert("CUDA_VISIBLE_DEVICES".into(), "0,1,2,3".into());
        assert_eq!(
            on_step_start(&mut forged, &Args::default(), Some("flex1"), never),
            StepStart::Skipped,
            "an srun step without SLURM_STEP_GPUS has no GPUs"
        );
        let mut batch = Fake {
            step: Some(BATCH_STEP),
            ..Fake::default()
        };
        batch.env.insert("SLURM_JOB_GPUS".into(), "2".into());
        batch.env.insert("SLURM_STEP_GPUS".into(), "0,1".into());
        let mut line = String::new();
        on_step_start(&mut batch, &Args::default(), Some("flex1"), |_, _, r, _| {
            line = r.to_line();
            Ok(ControlReply::ok())
        });
        assert!(line.contains("\"gpus\":[\"2\"]"), "{line}");
        assert_eq!(slurm_gpu_var(INTERACTIVE_STEP), "SLURM_JOB_GPUS");
        assert_eq!(slurm_gpu_var(3), "SLURM_STEP_GPUS");
    }

    #[test]
    fn a_managed_step_registers_and_exports_its_tier() {
        let mut fake = with_gpus();
        let mut sent = None;
        let outcome = on_step_start(
            &mut fake,
            &Args::default(),
            Some("flex2"),
            |socket, node, request, timeout| {
                sent = Some((
                    socket.to_string(),
                    node.to_string(),
                    request.to_line(),
                    timeout,
                ));
                Ok(ControlReply::Done(ControlAnswer::Registered {
                    tier: Some("flex2".into()),
                    progress: Some("/run/powerflex/n2.progress".into()),
                }))
            },
        );
        assert_eq!(outcome, StepStart::Registered("42".into(), "0".into()));
        let (socket, node, line, timeout) = sent.expect("sent");
        assert_eq!(
            (socket.as_str(), node.as_str(), timeout),
            (DEFAULT_SOCKET, "n2", Duration::from_millis(200))
        );
        assert!(
            line.contains("\"gpus\":[\"0\",\"1\"]")
                && line.contains("\"uid\":1000")
                && line.contains("\"flex\":\"flex2\""),
            "{line}"
        );
        assert_eq!(
            fake.exported.get("POWERFLEX_TIER").map(String::as_str),
            Some("flex2")
        );
        assert_eq!(
            fake.exported.get("POWERFLEX_PROGRESS").map(String::as_str),
            Some("/run/powerflex/n2.progress")
        );
    }

    #[test]
    fn a_multi_node_step_registers_this_nodes_gpus_not_the_batch_nodes() {
        let mut fake = with_gpus();
        fake.env.insert("SLURM_JOB_GPUS".into(), "2,3".into());
        fake.env.insert("SLURM_STEP_GPUS".into(), "0,1".into());
        let mut line = String::new();
        on_step_start(
            &mut fake,
            &Args::default(),
            Some("flex2"),
            |_, _, request, _| {
                line = request.to_line();
                Ok(ControlReply::ok())
            },
        );
        assert!(line.contains("\"gpus\":[\"0\",\"1\"]"), "{line}");
    }

    #[test]
    fn gpuless_and_extern_steps_stay_away_from_the_agent() {
        let never =
            |_: &str, _: &str, _: &ControlRequest, _: Duration| -> Result<ControlReply, String> {
                panic!("must not contact the agent")
            };
        assert_eq!(
            on_step_start(&mut Fake::default(), &Args::default(), Some("flex1"), never),
            StepStart::Skipped,
            "no GPUs"
        );
        let mut ext = with_gpus();
        ext.step = Some(EXTERN_STEP);
        assert_eq!(
            on_step_start(&mut ext, &Args::default(), Some("flex1"), never),
            StepStart::Skipped
        );
    }

    /// An unmanaged step with GPUs (the site's default `none`, or an opt-out it allows)
    /// registers as `none`, so its GPUs are a job's at their default limit rather than
    /// use the agent sees no registration for (held at the fail-safe where the site
    /// says so). It gets no progress address, and an absent or refusing agent costs it
    /// no warning: it runs unmanaged either way.
    #[test]
    fn an_unmanaged_step_registers_its_gpus_as_none_and_fails_quietly() {
        for flex in [None, Some("none")] {
            let mut fake = with_gpus();
            let mut line = String::new();
            let outcome = on_step_start(&mut fake, &Args::default(), flex, |_, _, r, _| {
                line = r.to_line();
                Ok(ControlReply::Done(ControlAnswer::Registered {
                    tier: Some("none".into()),
                    progress: None,
                }))
            });
            assert_eq!(outcome, StepStart::Registered("42".into(), "0".into()));
            assert!(line.contains("\"flex\":\"none\""), "{flex:?}: {line}");
            assert!(!fake.exported.contains_key("POWERFLEX_PROGRESS"));
            for reply in [
                Err("cannot reach".to_string()),
                Ok(ControlReply::Refused("GPU 0 belongs to job 9".into())),
            ] {
                let mut fake = with_gpus();
                let outcome = on_step_start(&mut fake, &Args::default(), flex, |_, _, _, _| {
                    reply.clone()
                });
                assert_eq!(outcome, StepStart::Skipped, "{flex:?}");
                assert_eq!(fake.errors.borrow().len(), 1, "logged once");
            }
        }
    }

    #[test]
    fn an_unreachable_or_refusing_agent_fails_open_with_one_warning() {
        let mut fake = with_gpus();
        let down = on_step_start(&mut fake, &Args::default(), Some("flex3"), |_, _, _, _| {
            Err("cannot reach".into())
        });
        assert!(
            matches!(down, StepStart::WarnJob(ref w) if w.contains("not reachable")),
            "{down:?}"
        );
        assert_eq!(fake.errors.borrow().len(), 1);
        assert!(fake.exported.is_empty());
        let mut fake = with_gpus();
        let refused = on_step_start(&mut fake, &Args::default(), Some("flex3"), |_, _, _, _| {
            Ok(ControlReply::error("no GPU 7 on node n2"))
        });
        assert!(
            matches!(refused, StepStart::WarnJob(ref w) if w.contains("no GPU 7")),
            "{refused:?}"
        );
    }

    /// A value that slipped past submission (an environment edited since, a site config
    /// changed since) is not fatal, and is no way out of the budget: the step runs under
    /// the site's default tier, or its least flexible one where the default is `none`.
    #[test]
    fn a_value_that_does_not_parse_on_the_node_runs_under_the_default_tier_never_unmanaged() {
        let register = |args: &Args, value: &str| {
            let mut fake = with_gpus();
            let mut line = String::new();
            let outcome = on_step_start(&mut fake, args, Some(value), |_, _, request, _| {
                line = request.to_line();
                Ok(ControlReply::ok())
            });
            let errors = fake.errors.borrow().clone();
            (outcome, line, errors)
        };
        let with_default = Args {
            default: Some("flex2".into()),
            ..Args::default()
        };
        for value in [
            "gold",
            "flex2,calibrate=sometimes",
            "max-slowdown=200%",
            "\u{0}",
        ] {
            let (outcome, line, errors) = register(&with_default, value);
            assert_eq!(
                outcome,
                StepStart::Registered("42".into(), "0".into()),
                "{value}"
            );
            assert!(
                line.contains("\"flex\":\"\""),
                "the agent's default: {line}"
            );
            assert!(
                errors[0].contains("runs under the site's default tier (flex2)"),
                "{errors:?}"
            );
        }
        // The site's default is `none`: its least flexible tier, flex0, never unmanaged.
        let (outcome, line, errors) = register(&Args::default(), "gold");
        assert_eq!(outcome, StepStart::Registered("42".into(), "0".into()));
        assert!(line.contains("\"flex\":\"flex0\""), "{line}");
        assert!(errors[0].contains("unknown tier"), "{errors:?}");
    }
}
