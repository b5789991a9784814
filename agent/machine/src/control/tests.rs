//! The agent machine's tests, by the input they exercise, on plain values and a fake
//! clock; the fixtures they share are here.

use powerflex_proto::usage::FinalRef;
use powerflex_proto::{ControlOp, ProgressReport};

use super::*;
use crate::calibration::Phase;
use crate::gpu::{ErrorClass, GpuError};
use crate::saved::PersistedState;
use crate::MachineError;

mod caps;
mod jobs;
mod lease;
mod progress;
mod restart;
mod shares;
mod snapshot;

fn gpu(index: u32) -> GpuIdentity {
    GpuIdentity {
        index,
        uuid: format!("GPU-{index:08x}-0000-0000-0000-000000000000"),
        name: "NVIDIA H200".into(),
        min_cap: Watts(200.0),
        max_cap: Watts(700.0),
        default_cap: Watts(700.0),
        simulated: false,
    }
}

fn settings(node_budget: Option<Watts>) -> AgentSettings {
    AgentSettings {
        node: "n1".into(),
        tiers: TierTable::default_table(),
        default_service: Service::Unmanaged,
        calibration: CalibrationSettings {
            grid: [700.0, 600.0, 500.0].map(Watts).to_vec(),
            min_cap: Watts(200.0),
            settle_s: 1.0,
            hold_s: 2.0,
            warmup_s: 1.0,
            steady_cv: 0.05,
            allowance: 0.05,
            no_signal_s: 10.0,
            rewalk_after_s: crate::calibration::DEFAULT_REWALK_AFTER_S,
            budget_fraction: 0.02,
            expected_cut: 0.3,
        },
        cap_step: Watts(10.0),
        failsafe_cap: Watts(500.0),
        node_budget,
        policy: Policy::Optimal,
        lease_ttl_s: 30.0,
        prior_intercept: 1.2,
        prior_slope: 1.5,
        progress_address: "/run/powerflex/n1.progress".into(),
        job_end_grace_s: 30.0,
        enforce: true,
        unregistered_gpu_use: UnregisteredGpuUse::Failsafe,
    }
}

fn agent(node_budget: Option<Watts>) -> Agent {
    let mut a = Agent::with_defaults(
        settings(node_budget),
        (0..4).map(gpu).collect(),
        &BTreeMap::new(),
        0.0,
    );
    for g in 0..4 {
        a.sampled(
            0.0,
            g,
            Ok(GpuSample {
                power: Watts(650.0),
                cap: Watts(700.0),
                energy_mj: Some(0),
                power_throttled: None,
                gpu_util_pct: 100,
                memory_util_pct: 40,
                sm_clock_mhz: 1980,
            }),
        );
    }
    a
}

fn caps(actions: &[Action]) -> Vec<(u32, f64)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::SetCap { gpu, cap } => Some((*gpu, cap.0)),
            Action::Persist => None,
        })
        .collect()
}

fn sample_at(cap_w: f64) -> Result<GpuSample, GpuError> {
    Ok(GpuSample {
        power: Watts(cap_w - 20.0),
        cap: Watts(cap_w),
        energy_mj: Some(0),
        power_throttled: None,
        gpu_util_pct: 100,
        memory_util_pct: 40,
        sm_clock_mhz: 1980,
    })
}

/// A lease for job 7 at `cap_w` per GPU from a controller of `epoch`.
fn lease_of_epoch(cap_w: f64, epoch: u64) -> AgentInput {
    AgentInput::Lease(LeaseMessage {
        caps: BTreeMap::from([("7".to_string(), Watts(cap_w))]),
        ttl_s: 30.0,
        start_cap: None,
        recalibrate: Vec::new(),
        learn: Vec::new(),
        next_event_in_s: None,
        event_in_force: true,
        epoch,
    })
}

/// An agent of two GPUs at 700 W started at 0 s from `saved`, job 7 on both.
fn started_with(saved: Option<PersistedState>) -> Agent {
    let mut a = Agent::new(settings(None), (0..2).map(gpu).collect(), 250, UnixMs(0));
    a.step(
        UnixMs(0),
        vec![AgentInput::Start(Box::new(StartFacts {
            saved,
            samples: vec![(0, sample_at(700.0)), (1, sample_at(700.0))],
            jobs_on_host: Some(BTreeSet::new()),
            ..StartFacts::default()
        }))],
    );
    a.register(
        0.0,
        "7",
        "0",
        0,
        "n1",
        &["0".into(), "1".into()],
        "flex2,calibrate=off",
    )
    .expect("registered");
    a
}

fn reading(
    cap_w: f64,
    power_w: f64,
    energy_mj: u64,
    throttled: bool,
) -> Result<GpuSample, GpuError> {
    Ok(GpuSample {
        power: Watts(power_w),
        cap: Watts(cap_w),
        energy_mj: Some(energy_mj),
        power_throttled: Some(throttled),
        gpu_util_pct: 100,
        memory_util_pct: 40,
        sm_clock_mhz: 1980,
    })
}

/// Job 7 on GPU 0 under a lease of 450 W, its cap to be written.
fn job_7_capped_at_450() -> Agent {
    let mut a = agent(None);
    a.register(0.0, "7", "0", 0, "n1", &["0".into()], "flex3,calibrate=off")
        .expect("registered");
    a.set_lease(
        0.0,
        BTreeMap::from([("7".to_string(), Watts(450.0))]),
        30.0,
        None,
    );
    assert_eq!(caps(&a.tick(1.0)), vec![(0, 450.0)]);
    a
}

/// Drives job "3" (flex3, GPUs 0-3) on a fake clock: two ranks report every 50 ms,
/// each its own cumulative tokens (40 000 a step, a step every 50 ms), the second
/// `lag_steps` steps behind the first and heard 10 ms after it. Returns the phase and
/// the warm-up note after `seconds`.
fn two_reporters(lag_steps: u64, seconds: f64) -> (Phase, Option<String>, Agent) {
    let mut a = agent(None);
    a.register(
        0.0,
        "3",
        "batch",
        0,
        "n1",
        &["0".into(), "1".into(), "2".into(), "3".into()],
        "flex3",
    )
    .expect("batch step");
    a.register(
        0.1,
        "3",
        "0",
        0,
        "n1",
        &["0".into(), "1".into(), "2".into(), "3".into()],
        "flex3",
    )
    .expect("step 0");
    a.set_lease(
        0.1,
        BTreeMap::from([("3".to_string(), Watts(700.0))]),
        3600.0,
        None,
    );
    let mut next_tick = 0.5;
    for k in 0..(seconds / 0.05) as u64 {
        let t = 0.2 + k as f64 * 0.05;
        a.progress(t, "3", 4101, 40_000 * (k + lag_steps), k + lag_steps)
            .expect("rank 0");
        if k >= lag_steps {
            a.progress(t + 0.01, "3", 4202, 40_000 * (k - lag_steps), k - lag_steps)
                .expect("rank 1");
        }
        if t >= next_tick {
            a.tick(t);
            next_tick += 0.5;
        }
    }
    let job = &a.jobs["3"];
    (
        job.calibration.phase.clone(),
        job.calibration.waiting.clone(),
        a,
    )
}
