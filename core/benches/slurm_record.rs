//! Reading Slurm's placement at site scale: `squeue --json` for N running jobs of 8 GPUs
//! on a site of 10,000 nodes, and `sinfo --json` for those nodes, parsed the way the
//! controller parses them every `slurm_poll_s` (typed structs, hostlists expanded).
//! Run with `cargo bench -p powerflex-core --bench slurm_record`; prints a table.
//!
//! The JSON is generated with the fields Slurm 22.05's `openapi/v0.0.38` prints for a
//! job (about 3 KB each, most of them ignored by the parser), so the bytes parsed are
//! of a real reply's size.

use std::hint::black_box;
use std::time::Instant;

use powerflex_core::slurm_record::{parse_sinfo_gpus, parse_squeue_json};

const NODES: usize = 10_000;

/// A job of `squeue --json` with the fields Slurm prints (values shortened).
fn job(id: usize, first_node: usize, nodes: usize) -> String {
    let padding: String = (0..60)
        .map(|k| format!("\"field_{k}\":\"value {k} of a field the controller ignores\","))
        .collect();
    format!(
        "{{{padding}\"job_id\":{id},\"user_id\":{uid},\"job_state\":\"RUNNING\",\
         \"nodes\":\"gpu[{first:05}-{last:05}]\",\"name\":\"train x AdminComment=powerflex;tier=none\",\
         \"admin_comment\":\"powerflex;tier=flex2;pfi=1.43;cap=450W\",\"comment\":\"\"}}",
        uid = 1000 + id % 500,
        first = first_node,
        last = first_node + nodes - 1,
    )
}

fn squeue(jobs: usize) -> String {
    let per_job_nodes = (NODES / jobs).max(1);
    let body: Vec<String> = (0..jobs)
        .map(|j| job(j + 1, (j * per_job_nodes) % NODES, per_job_nodes))
        .collect();
    format!(
        "{{\"meta\":{{}},\"errors\":[],\"jobs\":[{}]}}",
        body.join(",")
    )
}

fn sinfo() -> String {
    let body: Vec<String> = (0..NODES)
        .map(|n| format!("{{\"name\":\"gpu{n:05}\",\"gres\":\"gpu:h200:8(S:0-1)\",\"state\":\"mixed\",\"comment\":\"\"}}"))
        .collect();
    format!(
        "{{\"meta\":{{}},\"errors\":[],\"nodes\":[{}]}}",
        body.join(",")
    )
}

/// Median of five runs of `parse`, ms.
fn median_ms(mut parse: impl FnMut()) -> f64 {
    let mut times: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            parse();
            t.elapsed().as_secs_f64() * 1000.0
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[2]
}

fn main() {
    println!("| reply | bytes | parse, median of 5 |");
    println!("| --- | --- | --- |");
    for jobs in [1_000usize, 10_000, 20_000] {
        let text = squeue(jobs);
        let ms = median_ms(|| {
            let parsed = parse_squeue_json(black_box(text.as_bytes())).expect("parses");
            assert_eq!(parsed.len(), jobs);
        });
        println!(
            "| squeue --json, {jobs} jobs on {NODES} nodes | {:.1} MB | {ms:.0} ms |",
            text.len() as f64 / 1e6
        );
    }
    let text = sinfo();
    let ms = median_ms(|| {
        let parsed = parse_sinfo_gpus(black_box(text.as_bytes())).expect("parses");
        assert_eq!(parsed.len(), NODES);
    });
    println!(
        "| sinfo --json, {NODES} nodes | {:.1} MB | {ms:.0} ms |",
        text.len() as f64 / 1e6
    );
}
