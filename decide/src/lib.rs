//! The decision both machines share: one facility budget across every node's jobs.
//!
//! `powerflex-controller-machine` calls it for the whole site every allocation period;
//! `powerflex-agent-machine`, in standalone mode, for its own node. Neither machine
//! imports the other: both import this. Like them it is pure: no I/O, no clock (its
//! `clippy.toml` refuses the standard library's files, sockets, processes, clocks and
//! environment), every view, budget and setting comes in as an argument.
//!
//!
//! Agents report their jobs per node; a job that spans nodes is one job here — its GPUs,
//! power and throughput add up across nodes (each node's agent measures the progress its
//! own ranks report; a job that reports only from rank 0 has throughput on one node) —
//! and gets one cap, the same on all its GPUs everywhere (synchronous training runs at the
//! pace of its slowest rank). Power the controller does not steer comes off the budget
//! first: idle GPUs and unmanaged jobs at what they draw, and a node that stopped
//! reporting at its fail-safe cap on every GPU (what it falls to when its lease runs out).
//!
//! Curves come from the same estimator as the offline evaluation
//! ([`powerflex_core::curve::estimate_population`]): smoothed, and extended below each
//! job's lowest measured cap to the GPUs' minimum by a lower bound (the chord from the
//! GPUs' static draw, a quarter of their highest limit, to the lowest reading) — territory
//! the allocator enters only when the budget cannot pay every tier's floor above it. Floors
//! and the choice of caps rest on each curve's lower bound, never on the smoothed estimate.
//! A job whose curve is in doubt (a prior, or drifted) gets exactly its cap in the equal
//! split within the tiers; the optimiser trades power only among jobs measured where it
//! moves them, and never ends below the equal split on those bounds.
//! The objective is, by default, the sum of each job's speed
//! relative to its own uncapped speed: what a job says about its scale (tokens/s are
//! self-reported) buys it nothing. A site that trusts its jobs' counts can choose the
//! total tokens/s instead; while any managed job reports only steps (units that do not
//! add up), relative speed is used all the same.

mod decision;
mod drift;
mod error;
mod gather;
mod reserve;
mod settings;
mod specs;
mod steady;
mod tiers;

pub use self::decision::{decide, decide_holding, decide_steady, Decision, Held};
pub use self::drift::DRIFT_BAND;
pub use self::error::DecideError;
pub use self::gather::{silent_node_reserve_w, unheard_node_view, UNHEARD_GPU_NAME};
pub use self::settings::{site_gpu_model, NodeView, SiteDomains, SiteSettings, TierBounds};
pub use self::specs::SUSPENDED_SHARE_OF_DEFAULT;
pub use self::steady::{STEADY_GAIN, STEADY_Z};
pub use self::tiers::{apply_least_flexible_tiers, least_flexible_tiers};

#[cfg(test)]
mod tests;
