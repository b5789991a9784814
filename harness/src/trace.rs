//! What a run did, folded into one number: every meter sample, every lease delivered,
//! every report received and every fault and Slurm action, in order. Two runs from the
//! same seed and the same inputs have the same digest; a change in any decision shows.

use crate::memory_link::LeaseBody;
use crate::meter::Sample;
use powerflex_proto::report::NodeReport;

/// FNV-1a, 64-bit: stable across platforms and releases (std's hasher is not promised
/// to be).
#[derive(Debug, Clone)]
pub struct Trace {
    hash: u64,
    /// Lines noted (faults, refusals, phase changes, preemptions), in order.
    pub notes: Vec<String>,
}

impl Default for Trace {
    fn default() -> Trace {
        Trace {
            hash: 0xcbf2_9ce4_8422_2325,
            notes: Vec::new(),
        }
    }
}

impl Trace {
    fn bytes(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.hash ^= u64::from(b);
            self.hash = self.hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn f64(&mut self, x: f64) {
        self.bytes(&x.to_bits().to_le_bytes());
    }

    fn u64(&mut self, x: u64) {
        self.bytes(&x.to_le_bytes());
    }

    pub fn sample(&mut self, s: &Sample) {
        self.u64(s.t_ms);
        self.f64(s.draw_w);
        self.f64(s.budget_w);
    }

    pub fn lease(&mut self, node: usize, lease: &LeaseBody) {
        self.u64(node as u64);
        for (job, cap) in &lease.caps {
            self.bytes(job.as_bytes());
            self.f64(*cap);
        }
        self.f64(lease.start_cap_w.unwrap_or(-1.0));
    }

    pub fn report(&mut self, node: usize, report: &NodeReport) {
        self.u64(node as u64);
        self.f64(report.power_w);
        self.u64(report.jobs.len() as u64);
    }

    pub fn note(&mut self, line: &str) {
        self.bytes(line.as_bytes());
        self.notes.push(line.to_string());
    }

    pub fn digest(&self) -> u64 {
        self.hash
    }
}
