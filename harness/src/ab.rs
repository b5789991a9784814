//! The live A/B: one scenario on the site harness, run under the controller's rule or
//! under the equal policy, judged on the TRUE curves the simulated GPUs run.
//!
//! The scenario ([`run`]): a job set starts together and is calibrated with the site's
//! default calibration design (every cap step a candidate, the default warm-up, settle,
//! hold, token budget and allowance); then a first event cuts the budget to a fraction of
//! the draw; one job changes phase; a second event; one job is suspended (`scontrol
//! suspend`); a third event. Everything else is the test bed's site (its H200s, a 10 s
//! lease, a one-second allocation period).
//!
//! What it measures, at every 50 ms quantum of the site's clock (every physics step):
//! - during each event's steady hold, the tokens/s the jobs truly make (the physics: each
//!   job's true curve at the caps actually applied, summed over its GPUs), averaged over
//!   the hold, beside the tier-aware equal split and the oracle computed on the true
//!   curves of the jobs present, at the same budget ([`powerflex_core::compare`]): a
//!   baseline no controller can move;
//! - every job's worst true slowdown over the whole run, transients included (warm-up,
//!   walks, probes, ramps), against its tier's bound, and the time it spent past it. The
//!   calibration allowance widens the bound only while the job's walk is under way.
//!
//! Pure like the site: no clocks, no files; the same seed gives the same result.

use std::collections::BTreeMap;

use powerflex_core::allocate::{CapLimits, Policy};
use powerflex_core::compare::{self, Scored, TrueJob, BOUND_TOLERANCE};
use powerflex_core::config::{BudgetMode, RawSiteConfig, SiteConfig};
use powerflex_core::flex::parse_power_flex;
use powerflex_core::point::OperatingPoint;
use powerflex_core::Watts;
use powerflex_proto::admin::{AdminAnswer, AdminOp, AdminReply};
use powerflex_proto::event::Cut;
use powerflex_proto::status::{CalibrationState, CtldStatus, DecisionView};

use crate::physics::h200;
use crate::site::{test_bed_site, JobSpec, Phase, Site, SiteOptions, QUANTUM_MS};
use crate::HarnessError;

/// Time the site runs before the jobs start, ms: every agent has a lease by then (the
/// link's delay and one allocation period, with room to spare).
const LEASED_WITHIN_MS: u64 = 5_000;

/// A set of jobs and the two jobs the scenario acts on.
#[derive(Debug, Clone, PartialEq)]
pub struct JobSet {
    pub name: String,
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub jobs: Vec<JobSpec>,
    /// The job whose phase ends after the first event (its spec has a next phase).
    pub phase_change: String,
    /// The job suspended before the third event.
    pub suspended: String,
}

/// One job of a set: `gpus` GPUs on node `node` running `workload`, or `then` after its
/// first phase.
fn job(
    id: &str,
    flex: &str,
    node: usize,
    gpus: u32,
    workload: &str,
    then: Option<&str>,
) -> JobSpec {
    let mut spec = JobSpec::training(id, flex, node, gpus, workload);
    if let Some(next) = then {
        // The first phase ends when the scenario says (`Site::end_phase_now`).
        spec.phases = vec![
            Phase {
                workload: Some(workload.to_string()),
                length_s: f64::INFINITY,
                new_step: false,
            },
            Phase::train(next),
        ];
    }
    spec
}

/// Ten jobs on three nodes of 8 GPUs, every tier, on the four REAL measured curves of
/// the Zeus dev set in the simulator's library (BERT, DeepSpeech2 and two ShuffleNet
/// runs, from near-flat to steep), each used by two or three jobs at different tiers and
/// sizes. Job 5 changes from BERT to the flat ShuffleNet curve; job 10 is suspended.
pub fn dev_set() -> JobSet {
    const BERT: &str = "real-rtx6000-squad-bert-base-uncased-bs16-adamw";
    const SPEECH: &str = "real-rtx6000-librispeech-deepspeech2-bs8-adamw";
    const SHUFFLE_FLAT: &str = "real-rtx6000-cifar100-shufflenetv2-bs32-adadelta";
    const SHUFFLE_V100: &str = "real-v100-cifar100-shufflenetv2-bs2048-adam";
    JobSet {
        name: "dev".to_string(),
        nodes: 3,
        gpus_per_node: 8,
        jobs: vec![
            job("1", "flex1", 0, 4, BERT, None),
            job("2", "flex2", 0, 2, SHUFFLE_V100, None),
            job("3", "flex3", 0, 2, SHUFFLE_FLAT, None),
            job("4", "flex0", 1, 2, SPEECH, None),
            job("5", "flex2", 1, 2, BERT, Some(SHUFFLE_FLAT)),
            job("6", "flex3", 1, 4, SHUFFLE_V100, None),
            job("7", "flex1", 2, 2, SPEECH, None),
            job("8", "flex2", 2, 2, SHUFFLE_FLAT, None),
            job("9", "flex3", 2, 2, BERT, None),
            job("10", "flex2", 2, 2, SPEECH, None),
        ],
        phase_change: "5".to_string(),
        suspended: "10".to_string(),
    }
}

/// The same shape of site and tiers on the paper's profiles (fitted to the PFIs of the
/// paper's table): dense and MoE, fine-tuning and pre-training. Job 5 changes from MoE
/// fine-tuning to dense pre-training; job 10 is suspended.
pub fn paper_set() -> JobSet {
    JobSet {
        name: "paper".to_string(),
        nodes: 3,
        gpus_per_node: 8,
        jobs: vec![
            job(
                "1",
                "flex1",
                0,
                4,
                "llama-3.1-70b-dense-pt-8g-compile",
                None,
            ),
            job("2", "flex2", 0, 2, "qwen3-30b-a3b-moe-ft-8g", None),
            job(
                "3",
                "flex3",
                0,
                2,
                "gpt-oss-20b-moe-pt-8g-ep8-compile",
                None,
            ),
            job("4", "flex0", 1, 2, "qwen3-32b-dense-pt-8g-compile", None),
            job(
                "5",
                "flex2",
                1,
                2,
                "gpt-oss-20b-moe-ft-8g-seq4096-bs8",
                Some("llama-3.1-70b-dense-pt-16g"),
            ),
            job(
                "6",
                "flex3",
                1,
                4,
                "mistral-small-24b-base-2501-dense-ft-8g",
                None,
            ),
            job("7", "flex1", 2, 2, "deepseek-v2-lite-moe-pt-8g", None),
            job("8", "flex2", 2, 2, "gemma-4-26b-a4b-moe-ft-8g", None),
            job("9", "flex3", 2, 2, "qwen3-32b-dense-ft-16g", None),
            job(
                "10",
                "flex2",
                2,
                2,
                "llama-3.1-70b-dense-ft-8g-compile",
                None,
            ),
        ],
        phase_change: "5".to_string(),
        suspended: "10".to_string(),
    }
}

/// How long each part of the scenario lasts, site time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Most time calibration may take before the run gives up on it, s.
    pub calibration_within_s: u64,
    /// Each event's length, s.
    pub event_s: u64,
    /// Each event's ramp, s.
    pub ramp_s: u64,
    /// Time from an event's start to its steady hold (the ramp, the caps reaching the
    /// GPUs, the controller settling), s; the hold runs from there to the event's end.
    pub settle_s: u64,
    /// Time between an event's end and the next step of the scenario, s.
    pub gap_s: u64,
    /// Each event's budget, a fraction of the draw just before it.
    pub event_fraction: f64,
}

impl Default for Timing {
    fn default() -> Timing {
        Timing {
            calibration_within_s: 7_200,
            event_s: 240,
            ramp_s: 4,
            settle_s: 60,
            gap_s: 120,
            event_fraction: 0.7,
        }
    }
}

/// One run of the scenario.
#[derive(Debug, Clone, PartialEq)]
pub struct Scenario {
    pub seed: u64,
    pub jobs: JobSet,
    /// The controller's policy: the site's default `optimal`, or `equal`.
    pub policy: Policy,
    pub timing: Timing,
    /// Whether the phase-changing job's next phase starts as a new Slurm step (its agents
    /// hear of the step, as from `srun`) or runs on in its first step (found only by
    /// the controller's drift check).
    pub phase_as_new_step: bool,
}

/// The site the scenario runs on: the test bed's (its H200 model, lease, allocation
/// period, a budget the uncapped jobs fit), with the site's DEFAULT calibration (no
/// calibration caps listed: the design chooses among every cap step; the agent's warm-up,
/// settle, hold, token budget and allowance at their defaults) and `policy`. The
/// objective is the site's tokens/s, what the A/B scores.
pub fn site_config(set: &JobSet, policy: Policy) -> RawSiteConfig {
    let budget_w = f64::from(set.nodes * set.gpus_per_node) * h200::MAX_CAP_W;
    let mut raw = test_bed_site(budget_w, 10);
    raw.facility.policy = match policy {
        Policy::Optimal => None,
        other => Some(other.name().to_string()),
    };
    raw.facility.objective = Some("tokens".to_string());
    for model in raw.gpu_models.values_mut() {
        model.calibration_caps_w.clear();
    }
    raw.agent.calibration_warmup_s = None;
    raw.agent.calibration_settle_s = None;
    raw.agent.calibration_hold_s = None;
    raw.agent.calibration_budget_pct = None;
    raw.agent.calibration_allowance_pct = None;
    raw
}

/// One event's steady hold.
#[derive(Debug, Clone, PartialEq)]
pub struct EventResult {
    pub event: u64,
    /// The event's budget (a fraction of the draw before it), W.
    pub budget_w: f64,
    /// What the jobs present may draw: the budget less the site's metered margin and the
    /// idle draw of the GPUs no running job loads, W. Equal and oracle are computed here.
    pub jobs_budget_w: f64,
    /// Mean metered draw over the hold, W.
    pub draw_w: f64,
    pub hold_s: f64,
    /// The jobs present during the hold (running, loaded), with their workloads.
    pub jobs: Vec<(String, String)>,
    /// Mean true tokens/s over the hold.
    pub tokens_per_s: f64,
    pub equal: Scored,
    pub oracle: Scored,
    /// `(tokens/s − equal) / (oracle − equal)`; `None` when the oracle keeps no more than
    /// the equal split.
    pub gap_share: Option<f64>,
    /// Mean per-GPU cap of each job over the hold, W.
    pub mean_caps_w: BTreeMap<String, f64>,
    /// Mean true draw of each job's GPUs over the hold (the physics), W: beside the
    /// power the controller's model counts for its grant, where a shortfall of the
    /// draw against the budget comes from.
    pub mean_draw_w: BTreeMap<String, f64>,
    /// The controller's status halfway through the hold (its budget, reserve, and each
    /// job's grant, floor and measured curve): what a shortfall is diagnosed from.
    pub controller: Option<CtldStatus>,
    /// What the controller's policy decides at that moment on its own views (`what-if`):
    /// the modelled power of each grant beside the draw.
    pub decision: Option<DecisionView>,
}

impl EventResult {
    /// Whether the budget lets every job present hold its bound on the true curves (the
    /// oracle breaks none): below that, the tiers give way by design and a job past its
    /// bound is the budget's doing, not the decision's.
    pub fn bounds_affordable(&self) -> bool {
        self.oracle.bounds_broken.is_empty()
    }

    /// Draw as a share of the event's budget.
    pub fn draw_of_budget(&self) -> f64 {
        self.draw_w / self.budget_w
    }

    /// Delivered tokens/s over the equal split's, minus one.
    pub fn over_equal(&self) -> f64 {
        self.tokens_per_s / self.equal.tokens_per_s - 1.0
    }
}

/// One job over the whole run.
#[derive(Debug, Clone, PartialEq)]
pub struct JobResult {
    pub id: String,
    pub tier: String,
    /// The tier's bound, a fraction of uncapped throughput.
    pub bound: f64,
    /// Worst true slowdown over the run (against the phase's uncapped rate).
    pub worst_slowdown: f64,
    /// When it happened, s from the start, and whether the job was walking then.
    pub worst_at_s: f64,
    pub worst_walking: bool,
    /// Worst slowdown minus the bound in force at that moment (the bound plus the
    /// calibration allowance while walking), over the whole run.
    pub worst_excess: f64,
    pub worst_excess_at_s: f64,
    /// Time past the bound in force beyond [`BOUND_TOLERANCE`], s.
    pub over_bound_s: f64,
}

impl JobResult {
    /// Whether the job stayed within its bound (in force at each instant, within
    /// [`BOUND_TOLERANCE`]) for the whole run.
    pub fn held(&self) -> bool {
        self.over_bound_s == 0.0
    }
}

/// What one run of the scenario measured.
#[derive(Debug, Clone, PartialEq)]
pub struct AbRun {
    pub set: String,
    pub seed: u64,
    pub policy: Policy,
    /// Site time from the jobs' start until every walk was done, s.
    pub calibration_s: f64,
    pub events: Vec<EventResult>,
    pub jobs: Vec<JobResult>,
    /// The calibration allowance the agents were configured with (fraction).
    pub calibration_allowance: f64,
    /// The site's trace digest at the end: two runs that made the same decisions
    /// throughout (the two policies, where the optimal rule never left the equal split)
    /// have the same digest.
    pub digest: u64,
}

impl AbRun {
    /// The jobs past their bound.
    pub fn broken(&self) -> impl Iterator<Item = &JobResult> {
        self.jobs.iter().filter(|j| !j.held())
    }

    /// Worst true slowdown per tier, with the tier's bound: (tier, bound, worst, job).
    pub fn worst_per_tier(&self) -> Vec<(String, f64, f64, String)> {
        let mut tiers: BTreeMap<&str, (f64, f64, &str)> = BTreeMap::new();
        for j in &self.jobs {
            let e = tiers
                .entry(j.tier.as_str())
                .or_insert((j.bound, f64::NEG_INFINITY, ""));
            if j.worst_slowdown > e.1 {
                *e = (j.bound, j.worst_slowdown, j.id.as_str());
            }
        }
        tiers
            .into_iter()
            .map(|(t, (b, w, id))| (t.to_string(), b, w, id.to_string()))
            .collect()
    }

    /// The run as a markdown table per event and per job.
    pub fn table(&self) -> String {
        let mut s = format!(
            "{} set, seed {}, policy {}: calibration {:.0} s of site time, trace digest {:016x}\n\n\
             | event | budget W | draw % of budget | jobs | every bound affordable | tokens/s | equal (true) | oracle (true) | vs equal | gap share |\n\
             | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
            self.set, self.seed, self.policy, self.calibration_s, self.digest
        );
        for e in &self.events {
            s.push_str(&format!(
                "| {} | {:.0} | {:.1} % | {} | {} | {:.0} | {:.0} | {:.0} | {:+.2} % | {} |\n",
                e.event,
                e.budget_w,
                100.0 * e.draw_of_budget(),
                e.jobs.len(),
                if e.bounds_affordable() { "yes" } else { "no" },
                e.tokens_per_s,
                e.equal.tokens_per_s,
                e.oracle.tokens_per_s,
                100.0 * e.over_equal(),
                e.gap_share
                    .map_or("—".to_string(), |g| format!("{:.0} %", 100.0 * g)),
            ));
        }
        s.push_str(
            "\n| job | tier | bound | worst true slowdown | at s | walking | worst past bound in force | time past it s |\n\
             | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        );
        for j in &self.jobs {
            s.push_str(&format!(
                "| {} | {} | {:.0} % | {:.1} % | {:.0} | {} | {:+.1} pt | {:.2} |\n",
                j.id,
                j.tier,
                100.0 * j.bound,
                100.0 * j.worst_slowdown,
                j.worst_at_s,
                if j.worst_walking { "yes" } else { "no" },
                100.0 * j.worst_excess,
                j.over_bound_s,
            ));
        }
        s
    }
}

/// A job's bound and tier, from its `--power-flex` on the site's tier table.
fn bound_of(site: &SiteConfig, flex: &str) -> Result<(String, f64), HarnessError> {
    let request = parse_power_flex(flex, &site.tiers.table)
        .map_err(|e| HarnessError::Site(format!("--power-flex={flex}: {e}")))?;
    let tier = flex.split(',').next().unwrap_or(flex).to_string();
    Ok((tier, request.service.max_slowdown().map_or(1.0, |b| b.0)))
}

/// The hold being accumulated.
#[derive(Debug, Clone, Default)]
struct Hold {
    samples: u64,
    tokens: f64,
    draw_w: f64,
    caps_w: BTreeMap<String, f64>,
    draws_w: BTreeMap<String, f64>,
}

/// Samples the site at every quantum.
struct Recorder {
    started_ms: u64,
    allowance: f64,
    jobs: Vec<JobResult>,
    hold: Option<Hold>,
}

impl Recorder {
    fn sample(&mut self, site: &Site) {
        let t_s = (site.now_ms() - self.started_ms) as f64 / 1000.0;
        let dt_s = QUANTUM_MS as f64 / 1000.0;
        let mut tokens = 0.0;
        for r in &mut self.jobs {
            if let Some(hold) = self.hold.as_mut() {
                // Suspended jobs too: their GPUs' idle draw is part of what a grant holds.
                *hold.draws_w.entry(r.id.clone()).or_default() += site.job_draw_w(&r.id);
            }
            let Some(rate) = site.job_true_rate(&r.id) else {
                continue;
            };
            tokens += rate.tokens_per_s;
            if let Some(hold) = self.hold.as_mut() {
                let caps = site.job_caps_w(&r.id);
                let mean = caps.iter().sum::<f64>() / caps.len().max(1) as f64;
                *hold.caps_w.entry(r.id.clone()).or_default() += mean;
            }
            let slowdown = 1.0 - rate.tokens_per_s / rate.uncapped_tokens_per_s;
            let walking = site.job_calibration(&r.id) == Some(CalibrationState::Walking);
            let bound = r.bound + if walking { self.allowance } else { 0.0 };
            if slowdown > r.worst_slowdown {
                (r.worst_slowdown, r.worst_at_s, r.worst_walking) = (slowdown, t_s, walking);
            }
            if slowdown - bound > r.worst_excess {
                (r.worst_excess, r.worst_excess_at_s) = (slowdown - bound, t_s);
            }
            if slowdown > bound + BOUND_TOLERANCE {
                r.over_bound_s += dt_s;
            }
        }
        if let Some(hold) = self.hold.as_mut() {
            hold.samples += 1;
            hold.tokens += tokens;
            hold.draw_w += site.draw_w();
        }
    }

    fn run(&mut self, site: &mut Site, ms: u64) {
        for _ in 0..ms / QUANTUM_MS {
            site.run_for(QUANTUM_MS);
            self.sample(site);
        }
    }
}

/// Every job's true curve now (its current phase's workload), on the site's cap grid.
fn true_jobs(
    site: &Site,
    specs: &[JobSpec],
    limits: CapLimits,
) -> Result<Vec<(TrueJob, String)>, HarnessError> {
    let mut grid = Vec::new();
    let mut cap = limits.min_w.0;
    while cap < limits.max_w.0 - 1e-9 {
        grid.push(cap);
        cap += limits.step_w.0;
    }
    grid.push(limits.max_w.0);
    let mut out = Vec::new();
    for spec in specs {
        if site.job_true_rate(&spec.id).is_none() {
            continue;
        }
        let Some(name) = site.job_workload(&spec.id) else {
            continue;
        };
        let w = site.workloads().get(name)?;
        let per_gpu: Vec<OperatingPoint> = grid
            .iter()
            .map(|&c| {
                let s = w.at_cap(c);
                OperatingPoint {
                    cap_w: Watts(c),
                    power_w: s.power_w,
                    throughput: s.relative_throughput,
                }
            })
            .collect();
        let (_, bound) = bound_of(site.site_config(), &spec.flex)?;
        // A job with no slowdown allowed is never capped: it runs uncapped in every
        // baseline as under the controller.
        let max_slowdown = (bound > 0.0).then_some(bound);
        let gpus = spec.gpus_per_node * spec.nodes.len() as u32;
        let job = TrueJob::from_per_gpu(
            &spec.id,
            &per_gpu,
            w.tokens_per_s_per_gpu,
            gpus,
            max_slowdown,
        )
        .map_err(HarnessError::Site)?;
        out.push((job, name.to_string()));
    }
    Ok(out)
}

/// Runs the scenario. Errors only when the site cannot be made or a step of the scenario
/// cannot be carried out (calibration not done within its time, an event refused).
pub fn run(scenario: &Scenario) -> Result<AbRun, HarnessError> {
    let set = &scenario.jobs;
    let t = scenario.timing;
    let mut site = Site::new(SiteOptions {
        nodes: set.nodes,
        gpus_per_node: set.gpus_per_node,
        site: site_config(set, scenario.policy),
        ..SiteOptions::new(scenario.seed, 0.0)
    })?;
    let config = site.site_config().clone();
    let model = config
        .gpu_models
        .first()
        .ok_or_else(|| HarnessError::Site("no GPU model".to_string()))?;
    let limits = CapLimits {
        min_w: model.min_cap_w,
        max_w: model.max_cap_w,
        step_w: model.cap_step_w,
    };
    let margin = match config.facility.budget_mode {
        BudgetMode::Metered { margin } => margin,
        BudgetMode::Hard => 0.0,
    };
    // A site's agents are up and leased before its jobs arrive: without a lease an agent
    // holds its GPUs at the fail-safe cap, which no job on a running site meets.
    site.run_for(LEASED_WITHIN_MS);
    let mut jobs = Vec::new();
    for spec in &set.jobs {
        let (tier, bound) = bound_of(&config, &spec.flex)?;
        jobs.push(JobResult {
            id: spec.id.clone(),
            tier,
            bound,
            worst_slowdown: f64::NEG_INFINITY,
            worst_at_s: 0.0,
            worst_walking: false,
            worst_excess: f64::NEG_INFINITY,
            worst_excess_at_s: 0.0,
            over_bound_s: 0.0,
        });
        let mut spec = spec.clone();
        if spec.id == set.phase_change {
            for phase in spec.phases.iter_mut().skip(1) {
                phase.new_step = scenario.phase_as_new_step;
            }
        }
        site.submit(spec)?;
    }
    let mut rec = Recorder {
        started_ms: site.now_ms(),
        allowance: config.agent.calibration_allowance.0,
        jobs,
        hold: None,
    };

    // Calibration: until every capped job's walk is done.
    let walked = |s: &Site| {
        set.jobs.iter().all(|j| {
            matches!(
                s.job_calibration(&j.id),
                Some(CalibrationState::Done | CalibrationState::Skipped)
            )
        })
    };
    let mut calibrated = false;
    for _ in 0..t.calibration_within_s * 1000 / QUANTUM_MS {
        if walked(&site) {
            calibrated = true;
            break;
        }
        rec.run(&mut site, QUANTUM_MS);
    }
    if !calibrated {
        return Err(HarnessError::Site(format!(
            "calibration not done within {} s: {:?}",
            t.calibration_within_s,
            set.jobs
                .iter()
                .map(|j| (j.id.clone(), site.job_calibration(&j.id)))
                .collect::<Vec<_>>()
        )));
    }
    let calibration_s = (site.now_ms() - rec.started_ms) as f64 / 1000.0;
    rec.run(&mut site, t.gap_s * 1000);

    let mut events = Vec::new();
    for index in 1..=3u64 {
        match index {
            2 => {
                site.end_phase_now(&set.phase_change);
                rec.run(&mut site, t.gap_s * 1000);
            }
            3 => {
                site.suspend_job(&set.suspended, true);
                rec.run(&mut site, t.gap_s * 1000);
            }
            _ => {}
        }
        events.push(event(&mut site, &mut rec, scenario, limits, margin)?);
        rec.run(&mut site, t.gap_s * 1000);
    }
    Ok(AbRun {
        set: set.name.clone(),
        seed: scenario.seed,
        policy: scenario.policy,
        calibration_s,
        events,
        jobs: rec.jobs,
        calibration_allowance: config.agent.calibration_allowance.0,
        digest: site.digest(),
    })
}

/// One event at a fraction of the draw of the last 10 s, held, and its steady hold
/// scored.
fn event(
    site: &mut Site,
    rec: &mut Recorder,
    scenario: &Scenario,
    limits: CapLimits,
    margin: f64,
) -> Result<EventResult, HarnessError> {
    let t = scenario.timing;
    let recent = site.samples_since(site.now_ms().saturating_sub(10_000));
    let draw_w = recent.iter().map(|s| s.draw_w).sum::<f64>() / recent.len().max(1) as f64;
    let budget_w = (draw_w * t.event_fraction).floor();
    let reply = site
        .admin(AdminOp::EventAdd {
            cut: Cut::Target { budget_w },
            start_ms: site.now_ms(),
            duration_ms: t.event_s * 1000,
            ramp_ms: t.ramp_s * 1000,
            domain: None,
        })
        .ok_or_else(|| HarnessError::Site("the controller is down".to_string()))?;
    let Some(id) = reply.event_id() else {
        return Err(HarnessError::Site(format!("event refused: {reply:?}")));
    };
    rec.run(site, t.settle_s * 1000);
    let present = true_jobs(site, &scenario.jobs.jobs, limits)?;
    rec.hold = Some(Hold::default());
    let hold_ms = (t.event_s - t.settle_s) * 1000;
    rec.run(site, hold_ms / 2);
    let controller = site.controller_status();
    let decision = match site.admin(AdminOp::WhatIf {
        policy: Some(scenario.policy),
        budget_w: None,
        ignore_tiers: false,
    }) {
        Some(AdminReply::Done(AdminAnswer::WhatIf(view))) => Some(*view),
        _ => None,
    };
    rec.run(site, hold_ms - hold_ms / 2);
    let hold = rec.hold.take().unwrap_or_default();
    let n = hold.samples.max(1) as f64;
    let loaded_gpus: u32 = present.iter().map(|(j, _)| j.gpus).sum();
    let idle_w = (site.gpu_count() as f64 - f64::from(loaded_gpus)) * h200::IDLE_W;
    let jobs_budget_w = budget_w * (1.0 - margin) - idle_w;
    let true_curves: Vec<TrueJob> = present.iter().map(|(j, _)| j.clone()).collect();
    let equal =
        compare::equal_split(&true_curves, jobs_budget_w, limits).map_err(HarnessError::Site)?;
    let oracle =
        compare::oracle(&true_curves, jobs_budget_w, limits).map_err(HarnessError::Site)?;
    let tokens_per_s = hold.tokens / n;
    let delivered = Scored {
        policy: scenario.policy.name().to_string(),
        caps_w: BTreeMap::new(),
        tokens_per_s,
        power_w: hold.draw_w / n,
        bounds_broken: Vec::new(),
    };
    Ok(EventResult {
        event: id,
        budget_w,
        jobs_budget_w,
        draw_w: hold.draw_w / n,
        hold_s: hold.samples as f64 * QUANTUM_MS as f64 / 1000.0,
        jobs: present
            .iter()
            .map(|(j, w)| (j.id.clone(), w.clone()))
            .collect(),
        tokens_per_s,
        gap_share: compare::gap_recovered(&delivered, &equal, &oracle),
        equal,
        oracle,
        mean_caps_w: hold.caps_w.into_iter().map(|(k, v)| (k, v / n)).collect(),
        mean_draw_w: hold.draws_w.into_iter().map(|(k, v)| (k, v / n)).collect(),
        controller,
        decision,
    })
}
