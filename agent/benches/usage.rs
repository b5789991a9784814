//! What per-job accounting adds to the agent's sample: `cargo bench -p powerflex-agent
//! --bench usage`. Pure (no NVML, no sockets): the cost of charging 8 GPUs' readings and
//! one observation to a job per sample, and of building the job's share (done at every
//! status publish and report), against nothing. The NVML reads themselves are the same
//! with accounting on or off (the counter was already read).

use std::hint::black_box;
use std::time::Instant;

use powerflex_agent_machine::usage::{max_observation_gap_ms, JobUsage, Observation};
use powerflex_core::curve::CapCurve;
use powerflex_core::point::OperatingPoint;
use powerflex_core::Watts;

fn main() {
    const SAMPLES: u64 = 200_000;
    const GPUS: u32 = 8;
    let uuids: Vec<String> = (0..GPUS).map(|g| format!("GPU-{g:08x}")).collect();
    let mut usage = JobUsage::default();
    let start = Instant::now();
    for i in 0..SAMPLES {
        let at = 1_700_000_000_000 + i * 100;
        for (g, uuid) in uuids.iter().enumerate() {
            usage.gpu_reading(
                uuid,
                g as u32,
                at,
                Some(i * 70_000 + g as u64),
                Watts(700.0),
            );
        }
        usage.observe(
            Observation {
                at_unix_ms: at,
                power_w: Some(5600.0),
                cap_w: Some(500.0 + (i % 40) as f64 * 5.0),
                capped: i % 2 == 0,
                in_event: false,
                power_throttled: Some(true),
            },
            max_observation_gap_ms(100),
        );
    }
    let per_sample_ns = start.elapsed().as_nanos() as f64 / SAMPLES as f64;
    let curve = CapCurve::from_points(&[
        OperatingPoint {
            cap_w: Watts(300.0),
            power_w: Watts(2400.0),
            throughput: 60.0,
        },
        OperatingPoint {
            cap_w: Watts(500.0),
            power_w: Watts(4000.0),
            throughput: 95.0,
        },
        OperatingPoint {
            cap_w: Watts(700.0),
            power_w: Watts(5600.0),
            throughput: 100.0,
        },
    ])
    .expect("curve");
    let share = || {
        usage.share(
            "7",
            "n1",
            1000,
            "flex2",
            Some(&curve),
            Some(25.0),
            Some(2.0),
            None,
            false,
            true,
        )
    };
    const SHARES: u32 = 20_000;
    let start = Instant::now();
    for _ in 0..SHARES {
        black_box(share());
    }
    let per_share_us = start.elapsed().as_secs_f64() * 1e6 / f64::from(SHARES);
    let json = serde_json::to_string(&share()).expect("json");
    println!("| what | cost |");
    println!("| --- | --- |");
    println!("| charging one sample of {GPUS} GPUs and one observation to a job | {per_sample_ns:.0} ns |");
    println!("| building the job's share (status publish, report) | {per_share_us:.1} µs |");
    println!(
        "| the share in a report, {GPUS} GPUs, 40 caps merged to ≤ 32 | {} bytes of JSON |",
        json.len()
    );
}
