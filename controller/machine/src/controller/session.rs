//! What the controller knows of one node: the step keeps one [`Session`] per node, and
//! the status and learning read them (their own module, so neither imports the step).

use powerflex_proto::report::{GpuInfo, JobReport};

use powerflex_decide::NodeView;

/// What the controller knows of one node.
#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    /// What the controller believes of the node: its jobs and GPUs as far as Slurm's
    /// placement bears them out (see [`crate::placement`]).
    pub view: NodeView,
    /// When the node last said hello or reported (0: not since this controller started).
    pub last_seen_ms: u64,
    /// What the node last said, before the placement check: believed again whenever a
    /// new placement is read.
    pub reported: Vec<JobReport>,
    pub announced: Vec<GpuInfo>,
    /// Job reports refused from this node since the controller started.
    pub refused_reports: u64,
    /// GPUs it announces beyond what Slurm configures for it (last hello).
    pub refused_gpus: u32,
    /// Its agent is in observe mode (last report): its jobs are never suspended or
    /// requeued, since nothing is enforced there.
    pub observe_only: bool,
    /// It has reported since its last hello. Until it has, its draw is not a reading
    /// (0 W for a node this controller has just met), so `status` counts it neither as
    /// live nor in the draw: a VEN must not report a restarted controller's 0 W to the
    /// utility as the site's metered draw.
    pub reported_since_hello: bool,
}

impl Session {
    /// A node as the controller first knows it: `view`, with the GPUs it `announced`,
    /// never seen, nothing reported or refused yet.
    pub fn new(view: NodeView, announced: Vec<GpuInfo>) -> Session {
        Session {
            view,
            last_seen_ms: 0,
            reported: Vec::new(),
            announced,
            refused_reports: 0,
            refused_gpus: 0,
            observe_only: false,
            reported_since_hello: false,
        }
    }

    /// Whether the node reported within its lease since it last said hello: what
    /// `status` shows as live, and whose draw it sums.
    pub fn draw_known(&self) -> bool {
        self.view.live && self.reported_since_hello
    }
}
