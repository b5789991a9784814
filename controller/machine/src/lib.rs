//! The controller's decisions, with no I/O: what `powerflex-ctld`, `powerflexctl` and the
//! site harness all rest on. The allocation over every node itself is
//! [`powerflex_decide`]'s, which the agents' standalone mode shares.
//!
//! - [`schedule`]: grid events → the stepped budget in force at each instant, the lowest
//!   step in a window, and event times as text;
//! - [`ramp`]: the budget an allocation is made for while caps are replaced and confirmed;
//! - [`rollout`]: decreases before increases;
//! - [`preempt`]: cuts deeper than caps reach, which jobs to suspend or requeue;
//! - [`placement`]: which of a node's words to believe, from Slurm's record of where each
//!   job runs;
//! - [`controller`]: the controller's state machine, `Controller::step(now, inputs) ->
//!   output`, which puts the above together for every node, event, admin request and
//!   report.
//!
//! Time comes in as an argument (Unix ms). The crate has no dependency that does I/O, and
//! its `clippy.toml` refuses the standard library's files, sockets, processes, clocks and
//! environment, so that stays true. `powerflex-controller` re-exports every module.

pub mod controller;
pub mod error;
pub mod placement;
pub mod preempt;
pub mod ramp;
pub mod rollout;
pub mod schedule;
