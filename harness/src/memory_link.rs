//! The agent ↔ controller link in memory: each message waits out a delay, in order per
//! direction, and is refused at the receiver when its sender's wall clock is too far from
//! the receiver's, as the real link (`powerflex_proto::link`, HMAC-sealed frames stamped
//! with the sender's Unix ms) refuses it. What is not modelled: the handshake, the MAC and
//! the sequence numbers (their own tests cover them), and TCP's reconnects, which become
//! a `Hello` after each restart.

use std::collections::{BTreeMap, VecDeque};

use powerflex_proto::report::GpuInfo;
use powerflex_proto::usage::FinalRef;

/// The most a message's stamp may differ from the receiver's clock, ms: the real link's
/// `powerflex_proto::link::MAX_SKEW_MS` (that module sits behind the `link` feature,
/// which draws OS randomness; this crate takes `proto` without it).
pub const MAX_SKEW_MS: u64 = 60_000;

/// What an agent sends the controller.
#[derive(Debug, Clone, PartialEq)]
pub enum ToController {
    /// The agent (re)connected, with its GPUs.
    Hello { gpus: Vec<GpuInfo> },
    /// Its periodic report (and the one right after a lease is applied).
    Report(NodeReport),
}

/// An agent's report, as the real link's `Body::Report` carries it.
use powerflex_proto::report::NodeReport;

/// What the controller sends an agent.
#[derive(Debug, Clone, PartialEq)]
pub enum ToAgent {
    Lease(LeaseBody),
    /// Final shares whose records are written.
    Acked(Vec<FinalRef>),
}

/// A lease as the real link's `Body::Lease` carries it.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseBody {
    /// Job → per-GPU cap, W.
    pub caps: BTreeMap<String, f64>,
    pub ttl_s: f64,
    pub start_cap_w: Option<f64>,
    pub recalibrate: Vec<String>,
    pub learn: Vec<String>,
    pub next_event_in_s: Option<f64>,
    /// Job → the per-GPU cap an announced event's plan needs, W (the real link's
    /// `walk_to_w`: the agent's walks reach down to it before the event).
    pub walk_to_w: BTreeMap<String, f64>,
    pub event_in_force: bool,
}

/// A message in flight.
#[derive(Debug, Clone)]
pub struct Envelope<T> {
    /// The node it is from or to.
    pub node: usize,
    /// The sender's wall clock when it sent it, Unix ms.
    pub stamped_ms: u64,
    /// When it arrives, site ms.
    pub due_ms: u64,
    pub body: T,
}

/// Both directions of every node's link.
#[derive(Debug, Clone, Default)]
pub struct Link {
    /// One-way delay, ms.
    pub delay_ms: u64,
    up: VecDeque<Envelope<ToController>>,
    down: VecDeque<Envelope<ToAgent>>,
    /// Messages refused for their stamp, per direction (up, down).
    pub refused_skew: (u64, u64),
}

impl Link {
    pub fn new(delay_ms: u64) -> Link {
        Link {
            delay_ms,
            ..Link::default()
        }
    }

    fn due(&self, last: Option<u64>, now_ms: u64) -> u64 {
        // In order: a message never overtakes the one sent before it.
        (now_ms + self.delay_ms).max(last.unwrap_or(0))
    }

    pub fn send_up(&mut self, node: usize, stamped_ms: u64, now_ms: u64, body: ToController) {
        let due_ms = self.due(self.up.back().map(|e| e.due_ms), now_ms);
        self.up.push_back(Envelope {
            node,
            stamped_ms,
            due_ms,
            body,
        });
    }

    pub fn send_down(&mut self, node: usize, stamped_ms: u64, now_ms: u64, body: ToAgent) {
        let due_ms = self.due(self.down.back().map(|e| e.due_ms), now_ms);
        self.down.push_back(Envelope {
            node,
            stamped_ms,
            due_ms,
            body,
        });
    }

    /// The messages to the controller arrived by `now_ms`.
    pub fn arrived_up(&mut self, now_ms: u64) -> Vec<Envelope<ToController>> {
        take_due(&mut self.up, now_ms)
    }

    /// The messages to agents arrived by `now_ms`.
    pub fn arrived_down(&mut self, now_ms: u64) -> Vec<Envelope<ToAgent>> {
        take_due(&mut self.down, now_ms)
    }

    /// Drops every message to or from `node` in flight (a connection that broke).
    pub fn cut(&mut self, node: usize) {
        self.up.retain(|e| e.node != node);
        self.down.retain(|e| e.node != node);
    }

    /// Drops every message to the controller in flight (it stopped).
    pub fn cut_controller(&mut self) {
        self.up.clear();
        self.down.clear();
    }
}

fn take_due<T>(queue: &mut VecDeque<Envelope<T>>, now_ms: u64) -> Vec<Envelope<T>> {
    let mut arrived = Vec::new();
    while queue.front().is_some_and(|e| e.due_ms <= now_ms) {
        if let Some(e) = queue.pop_front() {
            arrived.push(e);
        }
    }
    arrived
}

/// Whether a message stamped `stamped_ms` is accepted by a receiver whose wall clock
/// reads `receiver_ms`.
pub fn within_skew(stamped_ms: u64, receiver_ms: u64) -> bool {
    stamped_ms.abs_diff(receiver_ms) <= MAX_SKEW_MS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_wait_out_the_delay_in_order() {
        let mut link = Link::new(20);
        link.send_up(0, 1000, 1000, ToController::Hello { gpus: Vec::new() });
        link.send_up(1, 1010, 1010, ToController::Hello { gpus: Vec::new() });
        assert!(link.arrived_up(1019).is_empty());
        let first = link.arrived_up(1020);
        assert_eq!(first.iter().map(|e| e.node).collect::<Vec<_>>(), [0]);
        link.delay_ms = 0;
        link.send_up(2, 1025, 1025, ToController::Hello { gpus: Vec::new() });
        let rest = link.arrived_up(1030);
        assert_eq!(
            rest.iter().map(|e| e.node).collect::<Vec<_>>(),
            [1, 2],
            "never overtakes"
        );
    }

    #[test]
    fn a_stamp_a_minute_off_is_refused() {
        assert!(within_skew(1_000_000, 1_000_000 + MAX_SKEW_MS));
        assert!(!within_skew(1_000_000, 1_000_001 + MAX_SKEW_MS));
        assert!(!within_skew(1_000_001 + MAX_SKEW_MS, 1_000_000));
    }
}
