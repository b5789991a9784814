//! What the controller's machine refuses, and why: one type for the whole crate, whose
//! messages name the field or input and what is accepted (tests and operators read them).

use powerflex_core::domains::{
    MAX_DOMAINS, MAX_DOMAIN_LIMIT_W, MAX_DOMAIN_NAME_BYTES, MAX_NODES_IN_ALL,
};
use powerflex_proto::event::MAX_PENDING_EVENTS;

/// Why the controller's machine refused a committed state, a site config, or an input
/// its edge could not produce.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MachineError {
    /// The site config gives no allocation settings.
    #[error(transparent)]
    Settings(#[from] powerflex_decide::DecideError),
    /// The edge refused a re-read site config (unreadable, unparsable, invalid): its
    /// message.
    #[error("{0}")]
    Config(String),
    /// Slurm's placement could not be read (`squeue`/`sinfo` failed or timed out): the
    /// edge's message.
    #[error("{0}")]
    SlurmRead(String),
    /// The leadership database did not answer a claim or a save: the edge's message.
    #[error("{0}")]
    Database(String),
    /// A committed state larger than any controller writes.
    #[error("the state is {bytes} bytes; accepted: at most {max_bytes}")]
    StateTooLarge { bytes: usize, max_bytes: usize },
    /// A committed state that is not JSON of a controller state: the parser's message.
    #[error("not a controller state: {0}")]
    NotAState(String),
    #[error("budget_w = {w} W is out of range; accepted: above 0 W, at most {max_w} W")]
    BudgetOutOfRange { w: f64, max_w: f64 },
    #[error("domain_budgets_w names {count} domains; accepted: at most {MAX_DOMAINS}")]
    TooManyDomainBudgets { count: usize },
    #[error(
        "domain_budgets_w: a domain name of {bytes} bytes; accepted: 1 to {MAX_DOMAIN_NAME_BYTES}"
    )]
    DomainBudgetName { bytes: usize },
    #[error(
        "domain_budgets_w.\"{}\" = {w} W is out of range; accepted: above 0 W, at most {MAX_DOMAIN_LIMIT_W} W",
        .name.escape_default()
    )]
    DomainBudgetOutOfRange { name: String, w: f64 },
    #[error("events holds {count} events not yet over; accepted: at most {MAX_PENDING_EVENTS}")]
    TooManyEvents { count: usize },
    /// An event `event add` would refuse: why, as `event add` says it.
    #[error("events: event {id}: {why}")]
    BadEvent { id: u64, why: String },
    #[error(
        "events: event id {id} is out of range; accepted: ids from 1 to next_event_id ({next_event_id}), each once"
    )]
    EventIdOutOfRange { id: u64, next_event_id: u64 },
    #[error(
        "events: event {id}: a domain name of {bytes} bytes; accepted: 1 to {MAX_DOMAIN_NAME_BYTES}"
    )]
    EventDomainName { id: u64, bytes: usize },
    #[error("nodes names {count} nodes; accepted: at most {MAX_NODES_IN_ALL}")]
    TooManyNodes { count: usize },
    #[error(
        "nodes: \"{}\" is not a node name; accepted: 1 to 64 ASCII letters, digits, '.', '_' or '-'",
        shown(.name)
    )]
    BadNodeName { name: String },
    #[error("preempted names {count} jobs; accepted: at most {max_jobs}")]
    TooManyPreempted { count: usize, max_jobs: usize },
    #[error(
        "preempted: \"{}\" is not a job id; accepted: 1 to 64 ASCII letters, digits, '_' or '.'",
        shown(.job)
    )]
    BadJobId { job: String },
    #[error("epoch = {epoch} is out of range; accepted: 0 to {}", i64::MAX)]
    EpochOutOfRange { epoch: u64 },
}

/// A name as an error shows it: its first 80 characters, escaped (a committed state is
/// read from a file or a database row anyone with access may have altered).
fn shown(name: &str) -> String {
    name.chars()
        .take(80)
        .collect::<String>()
        .escape_default()
        .to_string()
}
