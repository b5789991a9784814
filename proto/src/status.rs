//! Status snapshots: what `powerflexctl status` (controller) and `{"op":"status"}` on the
//! agent's control socket answer, and the views inside them. Typed on both ends so a
//! renamed field is a compile error, not a `-` in a table.
//!
//! Units: every power is W (`_w`), times are Unix milliseconds (`_ms`) or seconds (`_s`),
//! throughput is the job's own unit per second (see [`ThroughputUnit`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use powerflex_core::allocate::{Allocation, FloorStatus, Maximised};
use powerflex_core::flex::Preempt;
use powerflex_core::point::OperatingPoint;

use crate::event::Event;

/// Where a job's PFI (and the curve behind it) came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PfiSource {
    /// Calibrated on this job's own GPUs.
    Measured,
    /// A guess: the site's per-tier prior or the default PFI.
    Prior,
}

impl PfiSource {
    pub fn name(self) -> &'static str {
        match self {
            PfiSource::Measured => "measured",
            PfiSource::Prior => "prior",
        }
    }
}

// The unit of a job's work is its energy record's as much as the status's: it lives
// with the records, so the two modules do not import each other.
use crate::usage::ThroughputUnit;

/// The controller's status snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CtldStatus {
    /// The budget without grid events (site config, or `budget set`), W.
    pub base_budget_w: f64,
    /// The budget in force now (the stepped budget during a ramp), W.
    pub budget_w: f64,
    /// The budget the last allocation was made for: the lowest step before its caps may
    /// be replaced, a rise held to the site's ramp-rate limit, W (none before the first
    /// allocation).
    #[serde(default)]
    pub allocated_budget_w: Option<f64>,
    /// Summed GPU draw reported by live agents, W.
    pub draw_w: f64,
    pub headroom_w: f64,
    /// The event with the deepest cut in force now.
    pub active_event: Option<Event>,
    pub events: Vec<Event>,
    /// Shortfall of the last allocation with every job at its lowest cap, W (none before
    /// the first allocation).
    pub over_budget_w: Option<f64>,
    /// What the site can shed now (see [`ShedReach`]), from the last allocation's jobs;
    /// none before the first allocation. Also shown to non-root callers: a site figure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shed_reach: Option<ShedReach>,
    pub nodes: Vec<NodeStatus>,
    pub jobs: Vec<SiteJobStatus>,
    /// Why the last site config reload was refused; none once one is accepted.
    #[serde(default)]
    pub config_error: Option<String>,
    /// Jobs held out of the allocation because caps at every floor could not meet the
    /// budget (a grid event deeper than caps reach).
    #[serde(default)]
    pub preempted: Vec<PreemptedView>,
    /// Set when the caller was not root: `jobs` and `preempted` list only this uid's
    /// jobs (need-to-know); the site's figures and the per-node job counts
    /// stay. None: the caller sees every job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jobs_of_uid: Option<u32>,
    /// Slurm's placement, where the controller believes nodes against it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slurm: Option<SlurmPlacementView>,
    /// The accounting database (`[controller.database]`), where the site has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accounting_db: Option<AccountingDbView>,
    /// The site's power domains, in the order a tree is drawn (each top domain, then its
    /// children depth first); none without `[[domains]]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub domains: Vec<DomainStatus>,
    /// Whether this controller steers: shown under `[controller.ha]`, and for a
    /// controller whose leases agents refused for their epoch; none for a single
    /// controller that steers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leadership: Option<LeadershipView>,
    /// Nodes whose agents refused this controller's leases because they follow a
    /// controller of a later epoch, with that epoch: this controller steers them no more.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub refused_by: std::collections::BTreeMap<String, u64>,
    /// What the nodes Slurm or the power domains name whose agents this controller has
    /// never heard from (UNMANAGED in `nodes`) take off the budget, W: each is paid for
    /// at its GPUs times the site's largest GPU model's maximum, so the budget left to
    /// the managed jobs is short by this much. None when every such node has spoken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unmanaged_reserve_w: Option<f64>,
}

/// What the site can shed now, as budgets: the lowest the caps alone hold with every job
/// within its tier's bound, and with the jobs whose tier allows it held out too. Both
/// count the power the allocation does not steer (idle and unmanaged GPUs, silent nodes,
/// jobs already held out) as it is now, and the budget's metered margin.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ShedReach {
    /// Every managed job at its tier's floor, W.
    pub caps_w: f64,
    /// As `caps_w`, with every job whose tier allows preemption (`preempt=suspend` or
    /// `requeue`, never flex0) held out instead: at its GPUs' idle draw in metered mode,
    /// at their lowest cap in hard mode (which trusts no meter), W.
    pub with_preemption_w: f64,
    /// The managed jobs that could be held out for `with_preemption_w`.
    pub preemptable_jobs: u32,
}

/// One power domain as the controller sees it now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DomainStatus {
    pub name: String,
    /// The domain it sits in; none for a top domain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Levels below the top (0 for a top domain).
    pub depth: u32,
    /// The limit the site config gives it, W.
    pub limit_w: f64,
    /// Its budget in force now: an admin's `budget set --domain`, else its limit, less
    /// the deepest cut of its events in force (the stepped budget during a ramp), W.
    pub budget_w: f64,
    /// Summed GPU draw its live nodes reported, W.
    pub draw_w: f64,
    /// `budget_w − draw_w`, W.
    pub headroom_w: f64,
    /// Nodes behind it, and how many of them report.
    pub nodes: u32,
    pub live_nodes: u32,
    /// What the last allocation planned through it for the jobs it steers, W.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planned_w: Option<f64>,
    /// By how much its jobs' floors exceeded its limit in the last allocation: it binds
    /// (none or 0 when they fit), W.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub floors_over_w: Option<f64>,
    /// The event cutting it now, if any (the deepest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event: Option<u64>,
    /// What the nodes behind it whose agents were never heard from (UNMANAGED) take off
    /// its limit, W; none when there are none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unmanaged_reserve_w: Option<f64>,
}

/// Whether this controller steers the site, where that is in question: under
/// `[controller.ha]`, or after an agent refused its leases for their epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeadershipView {
    pub role: LeadershipRole,
    /// This controller's name (`controller.ha.name`); none for a single controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The leadership epoch this controller steers (or last steered) with.
    pub epoch: u64,
    /// Who holds leadership as this controller last read it, when it is not this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    /// Why this controller is not active, when it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Since when it has had this role, Unix ms.
    pub since_unix_ms: u64,
}

/// A controller's part in steering the site.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LeadershipRole {
    /// It holds leadership and steers: it sends leases and takes admin changes.
    Active,
    /// Another controller holds leadership (or none does yet and this one is trying):
    /// it sends no lease and refuses admin changes.
    Standby,
    /// It could not renew its leadership in time (the database unreachable) and
    /// stopped steering before its leadership could lapse; it competes again when the
    /// database answers.
    SteppedDown,
    /// Agents refused its leases: a controller of a later epoch steers them.
    Fenced,
}

impl LeadershipRole {
    pub fn name(self) -> &'static str {
        match self {
            LeadershipRole::Active => "active",
            LeadershipRole::Standby => "standby",
            LeadershipRole::SteppedDown => "stepped-down",
            LeadershipRole::Fenced => "fenced",
        }
    }
}

/// The controller's writer of job energy records to PostgreSQL, as it last saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AccountingDbView {
    /// The last attempt to reach it succeeded.
    pub connected: bool,
    /// The schema version in force, once migrated.
    pub schema_version: Option<i32>,
    /// Records waiting to be written (they are in the log meanwhile).
    pub pending: u64,
    /// Records written since the controller started.
    pub written: u64,
    /// Records dropped from the writer's queue while it was behind: they stay in the
    /// log and are written at the next start.
    pub dropped: u64,
    /// Why the last attempt failed.
    pub error: Option<String>,
    /// Since when it has been connected, or unreachable, Unix ms.
    pub since_unix_ms: u64,
}

/// A job the controller holds suspended or requeued.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PreemptedView {
    pub job: String,
    /// `suspend` (stopped, GPUs kept at idle draw) or `requeue` (back in the queue, held
    /// until the cut is over).
    pub how: Preempt,
    /// Since when, Unix ms.
    pub since_ms: u64,
}

/// One node as the controller sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    pub node: String,
    /// Number of GPUs.
    pub gpus: u32,
    /// Reported within its lease.
    pub live: bool,
    pub power_w: f64,
    /// Number of jobs it reports that Slurm places on it (the ones believed).
    pub jobs: u32,
    pub seen_ms_ago: u64,
    /// Job reports refused from this node since the controller started: jobs Slurm does
    /// not place on it (a misconfigured or rogue node says so here).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub refused_reports: u64,
    /// GPUs the node announces beyond what Slurm configures for it (not counted).
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub refused_gpus: u32,
    /// The leaf power domain it is in (none without `[[domains]]`, or for a node no leaf
    /// places: a configuration error, and its jobs are held at their lowest caps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    /// Set for a node Slurm or a power domain names whose agent this controller has
    /// never heard from (UNMANAGED): what the allocation reserves for it, W (its GPUs,
    /// as Slurm counts them, times the site's largest GPU model's maximum).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unmanaged_reserve_w: Option<f64>,
}

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

fn is_zero_u32(n: &u32) -> bool {
    *n == 0
}

/// Slurm's placement as the controller last read it (`job_placement = "slurm"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SlurmPlacementView {
    /// How long ago it was read, ms; none before the first read.
    pub read_ms_ago: Option<u64>,
    /// Jobs Slurm listed then.
    pub jobs: u32,
    /// Why the latest read failed (the last good one stays in force).
    pub error: Option<String>,
}

/// One job across every node it runs on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SiteJobStatus {
    pub job: String,
    /// The job's service in `--power-flex` form.
    pub tier: String,
    pub nodes: Vec<String>,
    /// Number of GPUs, summed over nodes.
    pub gpus: u32,
    pub pfi: Option<f64>,
    pub pfi_source: Option<PfiSource>,
    /// Per-GPU cap granted by the last allocation, W.
    pub cap_w: Option<f64>,
    pub floor: Option<FloorStatus>,
    /// As reported by the first node that reports the job.
    pub throughput: Option<f64>,
    pub uncapped_throughput: Option<f64>,
    /// Summed GPU power, W.
    pub power_w: f64,
    /// Per node: calibrated points, highest cap first (on the wire as
    /// [`crate::point`] writes them).
    #[serde(with = "crate::point::arrays_by_node")]
    pub points: BTreeMap<String, Vec<OperatingPoint>>,
    /// Per node: the job's estimated curve with each point's uncertainty and windows.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub curve: BTreeMap<String, Vec<CurvePoint>>,
    /// The curve as it stood after calibration and after each grid event since, oldest
    /// first: how learning in operation refined it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub curve_history: Vec<CurveSnapshot>,
    /// What calibration (walk and probes) cost the job, percent of its first-hour
    /// tokens, on the first node that says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration_cost_pct: Option<f64>,
    /// The job's measured draw or throughput left its curve's band at the last
    /// allocation: its curve is being corrected and it is walked again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drift: Option<Drift>,
    /// The job's owner (Unix uid) as every node running it reports it; none when a node
    /// does not say (an older agent) or two nodes disagree: then only root sees the job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_uid: Option<u32>,
    /// The job's lowest measured cap, W, when its granted cap is below it: there it is
    /// planned on a physics lower bound of its speed (the chord from the GPU's static draw
    /// to its lowest reading) until the agent's first window at the new cap replaces it.
    /// None when the job runs where it was measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub below_measured_w: Option<f64>,
    /// Energy its GPUs used so far, summed over its nodes' running shares, J (from the
    /// GPUs' counters; see [`crate::usage`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub energy_j: Option<f64>,
    /// Time with a GPU of the job capped below its default, percent of the time
    /// observed (the highest over its nodes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capped_pct: Option<f64>,
}

/// One point of a job's estimated curve: the mean of its measurement windows at one cap,
/// made monotone in the cap, with one standard error of each value.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CurvePoint {
    /// Per-GPU cap, W.
    pub cap_w: f64,
    /// The job's summed GPU power on the node, W.
    pub power_w: f64,
    /// Throughput, in the job's unit per second.
    pub throughput: f64,
    /// One standard error of `power_w`, W.
    pub power_sigma_w: f64,
    /// One standard error of `throughput`, in its unit.
    pub throughput_sigma: f64,
    /// Measurement windows behind the point (calibration walk and operation).
    pub windows: u32,
}

/// A job's curve at one moment, for `powerflexctl report`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CurveSnapshot {
    /// Controller time, ms since the Unix epoch.
    pub t_ms: u64,
    /// What the snapshot follows: `calibrated`, or `event <id>` (after its hold).
    pub after: SnapshotAfter,
    /// The node whose curve it is (the job's first node).
    pub node: String,
    pub points: Vec<CurvePoint>,
}

impl CurveSnapshot {
    /// Measurement windows behind the whole curve.
    pub fn windows(&self) -> u32 {
        self.points.iter().map(|p| p.windows).sum()
    }

    /// Mean standard error of the throughput over the points, as a fraction of the
    /// highest point's throughput (0 without points).
    pub fn mean_relative_sigma(&self) -> f64 {
        let top = self.points.iter().map(|p| p.throughput).fold(0.0, f64::max);
        if self.points.is_empty() || top <= 0.0 {
            return 0.0;
        }
        self.points.iter().map(|p| p.throughput_sigma).sum::<f64>() / self.points.len() as f64 / top
    }
}

/// What a curve snapshot follows. On the wire, `"calibrated"` or `"event <id>"`, the
/// words `powerflexctl report` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum SnapshotAfter {
    /// The job's calibration walk ended.
    Calibrated,
    /// Grid event `id` ended (after its hold).
    Event(u64),
}

impl std::fmt::Display for SnapshotAfter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SnapshotAfter::Calibrated => f.write_str("calibrated"),
            SnapshotAfter::Event(id) => write!(f, "event {id}"),
        }
    }
}

impl From<SnapshotAfter> for String {
    fn from(after: SnapshotAfter) -> String {
        after.to_string()
    }
}

impl TryFrom<String> for SnapshotAfter {
    type Error = crate::ProtoError;

    fn try_from(text: String) -> Result<SnapshotAfter, crate::ProtoError> {
        if text == "calibrated" {
            return Ok(SnapshotAfter::Calibrated);
        }
        match text.strip_prefix("event ").and_then(|id| id.parse().ok()) {
            Some(id) => Ok(SnapshotAfter::Event(id)),
            None => Err(crate::ProtoError::SnapshotOrigin(text)),
        }
    }
}

/// One allocation period, for `powerflexctl plot`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistorySample {
    pub t_ms: u64,
    pub budget_w: f64,
    pub draw_w: f64,
    /// Job → per-GPU cap, W.
    pub caps: BTreeMap<String, f64>,
    /// Any live node's GPUs are simulated (their NVML names say so).
    #[serde(default)]
    pub simulated: bool,
    /// The top power domains (feeds), and any domain an event cuts, at most
    /// [`MAX_SAMPLED_DOMAINS`]: each one's budget in force and draw (none without
    /// `[[domains]]`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub domains: BTreeMap<String, DomainSample>,
}

/// The most power domains one history sample holds: the history keeps thousands of
/// samples, so only the domains worth a line in a plot.
pub const MAX_SAMPLED_DOMAINS: usize = 16;

/// One power domain in a history sample.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DomainSample {
    pub budget_w: f64,
    pub draw_w: f64,
}

/// What an allocation decided (the answer to `what-if`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionView {
    /// Per node: job → per-GPU cap, W (what the node's lease says).
    pub leases: BTreeMap<String, BTreeMap<String, f64>>,
    pub budget_w: f64,
    /// Power not steered by the allocation (idle GPUs, unmanaged jobs, silent nodes), W.
    pub reserved_w: f64,
    /// The allocation over the managed jobs; none when there are none.
    pub allocation: Option<Allocation>,
    /// Reports left out because their values cannot be true.
    #[serde(default)]
    pub rejected: Vec<Rejected>,
    /// Jobs whose measurements left their curve's band.
    #[serde(default)]
    pub drifted: Vec<Drift>,
    /// Per-GPU cap for a managed job that starts before the next allocation names it, W.
    pub start_cap_w: f64,
    pub objective: Maximised,
}

/// A report (or a node's whole report) left out of the allocation because its values
/// cannot be true. It hurts only its sender: the job runs at what its node's lease gives
/// a job it does not name, and the rest of the site is allocated as usual.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rejected {
    pub node: String,
    /// The job, or none when the node's report as a whole was refused.
    pub job: Option<String>,
    pub reason: String,
}

/// A job whose measured draw or throughput at its cap left its curve's band: its curve
/// no longer describes it (a new phase, a changed batch size, a curve that was wrong).
/// The controller corrects its power by the metered loop at once and walks its shape
/// again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Drift {
    pub job: String,
    /// The per-GPU cap it was measured at, W.
    pub cap_w: f64,
    /// Measured over predicted power at that cap.
    pub power_ratio: Option<f64>,
    /// Measured over predicted throughput at that cap.
    pub throughput_ratio: Option<f64>,
}

/// The agent's mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AgentMode {
    /// Caps come from the controller's leases.
    Controller,
    /// Caps come from the node's own budget.
    Standalone,
}

/// A job's calibration walk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CalibrationState {
    Warmup,
    Walking,
    Done,
    Skipped,
}

impl CalibrationState {
    pub fn name(self) -> &'static str {
        match self {
            CalibrationState::Warmup => "warmup",
            CalibrationState::Walking => "walking",
            CalibrationState::Done => "done",
            CalibrationState::Skipped => "skipped",
        }
    }
}

/// The node agent's status snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentStatus {
    pub node: String,
    pub mode: AgentMode,
    /// The controller's lease ran out and the fail-safe cap applies.
    pub failsafe: bool,
    /// At least one GPU is out of service.
    pub degraded: bool,
    pub progress_rejected: u64,
    /// Why the last site config reload was refused; none once one is accepted.
    pub config_error: Option<String>,
    /// GPU limits found changed behind the agent's back (and written again).
    pub cap_mismatches: u64,
    /// Leases applied and read back since the agent started.
    pub leases_applied: u64,
    /// New steps that put a job's curve in question since the agent started (see
    /// [`AgentJobStatus::curve_in_question`]): the agent reports at once when this rises.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub curve_questions: u64,
    /// The highest controller leadership epoch a lease was accepted from (0: a single
    /// controller, or none yet).
    #[serde(default)]
    pub controller_epoch: u64,
    /// Leases refused since the agent started because their controller's epoch was
    /// below [`AgentStatus::controller_epoch`] (a controller that lost leadership).
    #[serde(default)]
    pub leases_refused_epoch: u64,
    /// Always 0 from this agent: a registration naming a GPU other jobs' processes use is
    /// accepted (the GPU is the registering job's, their use foreign:
    /// [`AgentStatus::gpu_foreign_use`]). Kept so that older readers, which require
    /// the field, still parse the status.
    #[serde(default)]
    pub gpu_claims_refused: u64,
    /// Times since the agent started that processes of another job began to use a GPU
    /// held by a job ([`AgentGpuStatus::foreign_use`]).
    // Left out at 0, so a status without foreign use reads as the releases before it wrote it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub gpu_foreign_use: u64,
    /// Times since the agent started that a GPU was found held by another power manager
    /// ([`AgentGpuStatus::owned_elsewhere`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub gpus_owned_elsewhere: u64,
    /// Whether the agent writes limits; false in observe mode (`agent.enforce = false`).
    #[serde(default = "enforcing")]
    pub enforce: bool,
    pub gpus: Vec<AgentGpuStatus>,
    pub jobs: Vec<AgentJobStatus>,
    /// Final shares of jobs that ended here recently (re-sent to the controller).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ended: Vec<crate::usage::NodeUsage>,
}

fn enforcing() -> bool {
    true
}

/// One GPU on the agent's node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentGpuStatus {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    /// The limit saved at start, restored when jobs end, W.
    pub default_w: f64,
    pub cap_w: Option<f64>,
    pub power_w: Option<f64>,
    pub energy_j: Option<f64>,
    pub job: Option<String>,
    /// Why the GPU is out of service.
    pub degraded: Option<String>,
    /// Observe mode: the limit the agent would write, W.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub would_cap_w: Option<f64>,
    /// NVML's power-limit constraints, W: every cap the agent writes is clamped to them.
    /// Absent from an agent older than the field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_w: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_w: Option<f64>,
    /// Whether the last sample found the clocks held back by a power cap or power brake
    /// (NVML's clock-event reasons); none where NVML cannot say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_throttled: Option<bool>,
    /// The processes NVML listed on this GPU at the agent's last scan of the host's
    /// processes, each with the job its ancestry puts it in.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<GpuProcess>,
    /// Processes use this GPU while no registered job holds it (a job that could not
    /// register, a process outside Slurm): with `agent.unregistered_gpu_use =
    /// "failsafe"` it is held at the fail-safe cap until they are gone.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unregistered_use: bool,
    /// Processes of other jobs than the one holding this GPU use it (a stray process, a
    /// debugger, a shared node): the GPU stays its holder's, capped as the job is.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub foreign_use: bool,
    /// Those other jobs (root's view only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub foreign_jobs: Vec<String>,
    /// Another power manager (DPS, Mission Control's power steering, a BMC, an operator)
    /// keeps this GPU's limit below the agent's: the agent does not write it, and it
    /// counts outside its job at the limit it reads (`cap_w`) until that limit rises to
    /// the agent's cap. powerflex does not co-manage GPU limits with another manager.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub owned_elsewhere: bool,
}

/// A process NVML lists on a GPU, as the agent attributes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuProcess {
    pub pid: u32,
    /// The Slurm job whose root-owned step daemon the process descends from; none for a
    /// process in no job.
    pub job: Option<String>,
}

/// One job on the agent's node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentJobStatus {
    pub job: String,
    pub uid: u32,
    pub tier: String,
    /// GPU indices.
    pub gpus: Vec<u32>,
    pub steps: Vec<String>,
    pub cap_w: Option<f64>,
    pub granted_w: Option<f64>,
    pub calibration: CalibrationState,
    pub calibration_note: Option<String>,
    pub calibration_level_w: Option<f64>,
    /// How long the walk took, seconds.
    pub calibration_s: Option<f64>,
    /// Tokens (or steps) the walk (and probes since) cost against running uncapped.
    pub calibration_cost: f64,
    /// The same, percent of the job's first-hour tokens (uncapped rate × 3600 s); the
    /// design keeps the walk within 2 % by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration_cost_pct: Option<f64>,
    /// The estimated curve, highest cap first, with per-point uncertainty and windows.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub curve: Vec<CurvePoint>,
    /// Windows learned in operation (after the walk) behind the curve.
    #[serde(default)]
    pub learned_windows: u32,
    pub pfi: Option<f64>,
    pub pfi_source: Option<PfiSource>,
    pub prior_pfi: Option<f64>,
    /// Measured levels (on the wire as [`crate::point`] writes them).
    #[serde(with = "crate::point::arrays")]
    pub points: Vec<OperatingPoint>,
    /// Recent throughput (job's unit per second).
    pub throughput: Option<f64>,
    pub throughput_unit: Option<ThroughputUnit>,
    pub power_w: Option<f64>,
    /// The per-GPU limit read back in the same samples as `power_w`, W.
    pub power_cap_w: Option<f64>,
    /// The calibration walk is under way (warm-up or a level).
    pub calibrating: bool,
    /// A step of the job started after its curve was measured and no window since has
    /// said whether the curve still holds (a new step may be a new phase): the job is
    /// planned on what physics guarantees, not on the curve, until one does.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub curve_in_question: bool,
    /// Why the job's reported curve was not taken as reported (it slowed more than its
    /// GPUs' clocks): the job is planned on its readings as the clocks allow them (see
    /// the agent's `clock_bounded`). For the admin.
    pub curve_implausible: Option<String>,
    /// How long that limit had held when `power_w` was sampled, seconds.
    pub power_cap_steady_s: Option<f64>,
    /// Its energy and what its caps did on this node so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<crate::usage::NodeUsage>,
}

/// Whether a counter is 0 (left out of the wire form then).
fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_sets_serialise_as_their_wire_names() {
        let names = serde_json::to_string(&(
            PfiSource::Measured,
            ThroughputUnit::Steps,
            Maximised::TokensPerS,
            Maximised::RelativeSpeed,
            AgentMode::Standalone,
            CalibrationState::Walking,
            FloorStatus::Broken { excess: 0.05 },
        ))
        .expect("json");
        assert_eq!(
            names,
            r#"["measured","steps","tokens/s","relative-speed","standalone","walking",{"state":"broken","excess":0.05}]"#
        );
        assert_eq!(PfiSource::Prior.name(), "prior");
        assert_eq!(ThroughputUnit::Tokens.name(), "tokens");
        assert_eq!(Maximised::RelativeSpeed.name(), "relative-speed");
        let after = serde_json::to_string(&(
            SnapshotAfter::Calibrated,
            SnapshotAfter::Event(3),
            Preempt::Requeue,
        ))
        .expect("json");
        assert_eq!(after, r#"["calibrated","event 3","requeue"]"#);
    }

    #[test]
    fn a_snapshot_origin_round_trips_and_nonsense_is_refused() {
        for after in [SnapshotAfter::Calibrated, SnapshotAfter::Event(u64::MAX)] {
            let text = serde_json::to_string(&after).expect("json");
            assert_eq!(
                serde_json::from_str::<SnapshotAfter>(&text).expect("back"),
                after
            );
        }
        for bad in ["\"event\"", "\"event x\"", "\"Calibrated\"", "\"event -1\""] {
            let e = serde_json::from_str::<SnapshotAfter>(bad)
                .expect_err(bad)
                .to_string();
            assert!(e.contains("calibrated") && e.contains("event <id>"), "{e}");
        }
    }

    #[test]
    fn an_unknown_pfi_source_is_refused_naming_the_accepted_ones() {
        let e = serde_json::from_str::<PfiSource>("\"guessed\"")
            .expect_err("unknown")
            .to_string();
        assert!(e.contains("measured") && e.contains("prior"), "{e}");
    }
}
