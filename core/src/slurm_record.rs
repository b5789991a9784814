//! What Slurm itself records about jobs and nodes, parsed from its own output: the
//! placement the controller believes nodes against, and the tier a restarted agent takes
//! a job back with. Pure: the callers run `squeue --json` / `sinfo --json` (with a
//! deadline) and hand the bytes in.
//!
//! Why JSON and not `scontrol show job -o`: that line is `key=value` pairs split on
//! spaces, and a job's name or comment may hold spaces and a forged
//! `AdminComment=powerflex;tier=none`. The JSON keeps each field in its own string.
//!
//! The hostlist expansion ([`expand_hostlist`]) is bounded in total, not only per range:
//! a list like `n[0-60000,0-60000,...]` must not make the caller allocate gigabytes.

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;

/// The most names one hostlist may expand to (a site of 65,536 nodes).
pub const MAX_HOSTLIST_NAMES: usize = 65_536;

/// The most bytes of Slurm output parsed (a 100,000-job queue is about 300 MB of
/// `squeue --json`; more than this is refused rather than read into memory).
pub const MAX_SLURM_OUTPUT_BYTES: usize = 512 * 1024 * 1024;

/// Why Slurm's output was not understood.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SlurmRecordError {
    #[error("slurm's output is not the JSON expected of `{command} --json`: {reason}")]
    NotJson {
        command: &'static str,
        reason: String,
    },
    #[error("slurm reported errors: {0}")]
    Reported(String),
    #[error("slurm's output is {bytes} bytes; at most {MAX_SLURM_OUTPUT_BYTES} are read")]
    TooLarge { bytes: usize },
    #[error(
        "job {job}'s node list {list:?} is not a hostlist of at most {MAX_HOSTLIST_NAMES} names"
    )]
    NodeList { job: String, list: String },
}

/// Longest node name accepted, bytes (Slurm's own names are far shorter).
pub const MAX_NODE_NAME_BYTES: usize = 64;

/// Whether `name` is a node name as every part of powerflex takes one: 1 to
/// [`MAX_NODE_NAME_BYTES`] ASCII letters, digits, `.`, `_` or `-` (what Slurm's node
/// names use; never a path, a space or a bracket). The link, the plugin and the site
/// config's domains all check names with this one rule.
pub fn valid_node_name(name: &str) -> bool {
    (1..=MAX_NODE_NAME_BYTES).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Expands a Slurm hostlist (`n[1-3,5],gpu[01-02],login`) into names, in order.
/// `None` for a malformed list or one of more than `max_names` names in all (checked
/// before each name is made, so a crafted list costs at most `max_names` names).
pub fn expand_hostlist(list: &str, max_names: usize) -> Option<Vec<String>> {
    let mut names = Vec::new();
    let mut push = |name: String| -> Option<()> {
        if names.len() >= max_names {
            return None;
        }
        names.push(name);
        Some(())
    };
    let mut rest = list.trim();
    while !rest.is_empty() {
        // The next element ends at a comma outside brackets.
        let mut depth = 0i32;
        let end = rest
            .char_indices()
            .find(|&(_, c)| {
                match c {
                    '[' => depth += 1,
                    ']' => depth -= 1,
                    _ => {}
                }
                c == ',' && depth == 0
            })
            .map_or(rest.len(), |(i, _)| i);
        let element = &rest[..end];
        rest = rest[end..].strip_prefix(',').unwrap_or(&rest[end..]);
        match element.split_once('[') {
            None if !element.is_empty() => push(element.to_string())?,
            None => {}
            Some((prefix, tail)) => {
                let (ranges, suffix) = tail.split_once(']')?;
                if suffix.contains(['[', ']']) || prefix.contains(']') {
                    return None;
                }
                for range in ranges.split(',') {
                    let (lo, hi) = range.split_once('-').unwrap_or((range, range));
                    let width = lo.len();
                    let all_digits =
                        |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
                    if !all_digits(lo) || !all_digits(hi) {
                        return None;
                    }
                    let (lo, hi): (u64, u64) = (lo.parse().ok()?, hi.parse().ok()?);
                    if hi < lo {
                        return None;
                    }
                    for n in lo..=hi {
                        push(format!("{prefix}{n:0width$}{suffix}"))?;
                    }
                }
            }
        }
    }
    Some(names)
}

/// A job's state as Slurm gives it, for what the controller needs to tell apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlurmJobState {
    /// Running, configuring or completing: the job holds its nodes.
    OnItsNodes,
    Suspended,
    /// Pending (a requeued job waits here), or held.
    Pending,
    /// Ended in any way.
    Ended,
}

impl SlurmJobState {
    /// From Slurm's state name (`RUNNING`, `SUSPENDED`, ...; flags after a `+` ignored).
    pub fn from_slurm(name: &str) -> SlurmJobState {
        match name.split('+').next().unwrap_or("") {
            "RUNNING" | "CONFIGURING" | "COMPLETING" | "STAGE_OUT" | "SIGNALING" | "RESIZING"
            | "STOPPED" => SlurmJobState::OnItsNodes,
            "SUSPENDED" => SlurmJobState::Suspended,
            "PENDING" | "REQUEUED" | "REQUEUE_HOLD" | "REQUEUE_FED" | "RESV_DEL_HOLD"
            | "SPECIAL_EXIT" => SlurmJobState::Pending,
            _ => SlurmJobState::Ended,
        }
    }

    /// Whether the job still holds GPUs on its nodes (a suspended job keeps them).
    pub fn holds_nodes(self) -> bool {
        matches!(self, SlurmJobState::OnItsNodes | SlurmJobState::Suspended)
    }
}

/// One job as Slurm records it.
#[derive(Debug, Clone, PartialEq)]
pub struct SlurmJob {
    /// The nodes Slurm placed the job on (empty while it is pending).
    pub nodes: BTreeSet<String>,
    /// The job's owner, Slurm's `user_id`.
    pub uid: u32,
    pub state: SlurmJobState,
    /// The job's `AdminComment` (only Slurm's admins and the controller set it).
    pub admin_comment: String,
    /// The Slurm account the job is charged to (empty when Slurm names none).
    pub account: String,
    /// When the job's current run started, Unix seconds (`start_time`): a requeued job
    /// keeps its id and starts again later, so this tells its runs apart. None while it
    /// never ran (pending: Slurm's figure is then an estimate) or when Slurm gave none.
    pub start_unix_s: Option<u64>,
}

/// Every job Slurm lists, by job id (decimal, as the plugin reports it).
pub type SlurmJobs = BTreeMap<String, SlurmJob>;

#[derive(Deserialize)]
struct Reply<T> {
    #[serde(default)]
    errors: Vec<serde::de::IgnoredAny>,
    #[serde(flatten)]
    body: T,
}

#[derive(Deserialize)]
struct QueueBody {
    jobs: Vec<QueueJob>,
}

#[derive(Deserialize)]
struct QueueJob {
    job_id: u64,
    user_id: u32,
    job_state: JobStateField,
    #[serde(default)]
    nodes: String,
    #[serde(default)]
    admin_comment: String,
    #[serde(default)]
    account: String,
    start_time: Option<TimeField>,
}

/// A time in `squeue --json`: a number of Unix seconds in Slurm 22.05, an object
/// `{"set": true, "infinite": false, "number": N}` in later releases.
#[derive(Deserialize)]
#[serde(untagged)]
enum TimeField {
    Plain(u64),
    Set {
        #[serde(default)]
        set: Option<bool>,
        #[serde(default)]
        infinite: Option<bool>,
        #[serde(default)]
        number: Option<u64>,
    },
}

impl TimeField {
    /// The time, when one is set (0, unset and infinite are none).
    fn unix_s(&self) -> Option<u64> {
        match self {
            TimeField::Plain(t) => Some(*t),
            TimeField::Set {
                set,
                infinite,
                number,
            } => (set.unwrap_or(true) && !infinite.unwrap_or(false))
                .then_some(*number)
                .flatten(),
        }
        .filter(|t| *t > 0)
    }
}

/// `job_state`: a string in Slurm 22.05 (`"RUNNING"`), a list of flags in later
/// releases (`["RUNNING"]`).
#[derive(Deserialize)]
#[serde(untagged)]
enum JobStateField {
    One(String),
    Flags(Vec<String>),
}

impl JobStateField {
    fn state(&self) -> SlurmJobState {
        match self {
            JobStateField::One(s) => SlurmJobState::from_slurm(s),
            JobStateField::Flags(flags) => flags
                .iter()
                .map(|f| SlurmJobState::from_slurm(f))
                .find(|s| *s != SlurmJobState::Ended)
                .unwrap_or(SlurmJobState::Ended),
        }
    }
}

#[derive(Deserialize)]
struct NodesBody {
    nodes: Vec<SinfoNode>,
}

#[derive(Deserialize)]
struct SinfoNode {
    name: String,
    #[serde(default)]
    gres: String,
}

fn parse_reply<T: serde::de::DeserializeOwned>(
    bytes: &[u8],
    command: &'static str,
) -> Result<T, SlurmRecordError> {
    if bytes.len() > MAX_SLURM_OUTPUT_BYTES {
        return Err(SlurmRecordError::TooLarge { bytes: bytes.len() });
    }
    let reply: Reply<T> = serde_json::from_slice(bytes).map_err(|e| SlurmRecordError::NotJson {
        command,
        reason: e.to_string(),
    })?;
    if !reply.errors.is_empty() {
        return Err(SlurmRecordError::Reported(format!(
            "{} error(s) in `{command} --json`",
            reply.errors.len()
        )));
    }
    Ok(reply.body)
}

/// Every job of `squeue --json`'s output, with its nodes expanded.
pub fn parse_squeue_json(bytes: &[u8]) -> Result<SlurmJobs, SlurmRecordError> {
    let body: QueueBody = parse_reply(bytes, "squeue")?;
    let mut jobs = SlurmJobs::new();
    for job in body.jobs {
        let id = job.job_id.to_string();
        let nodes = expand_hostlist(&job.nodes, MAX_HOSTLIST_NAMES).ok_or_else(|| {
            SlurmRecordError::NodeList {
                job: id.clone(),
                list: job.nodes.chars().take(200).collect(),
            }
        })?;
        jobs.insert(
            id,
            SlurmJob {
                nodes: nodes.into_iter().collect(),
                uid: job.user_id,
                state: job.job_state.state(),
                admin_comment: job.admin_comment,
                account: job.account,
                start_unix_s: if job.job_state.state() == SlurmJobState::Pending {
                    None
                } else {
                    job.start_time.as_ref().and_then(TimeField::unix_s)
                },
            },
        );
    }
    Ok(jobs)
}

/// Per node of `sinfo --json`'s output, how many GPUs Slurm configures on it (the
/// `gpu` gres, typed or not; 0 for a node without one).
pub fn parse_sinfo_gpus(bytes: &[u8]) -> Result<BTreeMap<String, u32>, SlurmRecordError> {
    let body: NodesBody = parse_reply(bytes, "sinfo")?;
    Ok(body
        .nodes
        .into_iter()
        .map(|n| {
            let gpus = gres_gpus(&n.gres);
            (n.name, gpus)
        })
        .collect())
}

/// GPUs in a node's gres string: `gpu:4`, `gpu:h100:8(S:0-1)`, `gpu:a:2,gpu:b:2,mps:100`.
pub fn gres_gpus(gres: &str) -> u32 {
    let mut total: u32 = 0;
    let mut depth = 0i32;
    let mut start = 0;
    let mut items = Vec::new();
    for (i, c) in gres.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&gres[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&gres[start..]);
    for item in items {
        let item = item.split('(').next().unwrap_or("");
        let Some(rest) = item
            .strip_prefix("gpu")
            .filter(|r| r.is_empty() || r.starts_with(':'))
        else {
            continue;
        };
        // `gpu` alone is one GPU; otherwise the count is the last `:` field.
        let count = match rest.rsplit_once(':') {
            _ if rest.is_empty() => 1,
            Some((_, count)) => count.parse::<u32>().unwrap_or(0),
            None => continue,
        };
        total = total.saturating_add(count);
    }
    total
}

/// Where powerflex's segment of an `AdminComment` begins: at its start, or after the
/// site's own text and the separator `" | "` (the controller keeps what a site wrote).
pub fn powerflex_segment_start(comment: &str) -> Option<usize> {
    if comment.starts_with("powerflex;") || comment == "powerflex" {
        return Some(0);
    }
    comment.rfind(" | powerflex;").map(|at| at + 3)
}

/// The tier Slurm records for `job_id` running on `node`: `powerflex-ctld` writes each
/// managed job's tier into its `AdminComment` (`powerflex;tier=flex2;pfi=1.43;cap=450W`),
/// a field only Slurm's admins can set, read from `squeue --json` (the agent's `persist::slurm_jobs`)
/// where the job's name and comment are strings of their own: the `key=value` line of
/// `scontrol show job -o` is split on spaces, and a job named
/// `x AdminComment=powerflex;tier=none` would have forged it. `None` when Slurm does not
/// place the job on `node` or records no powerflex tier: the agent then does not take
/// the job back (its GPUs keep the limit they read back until a current lease, and the
/// controller counts them at their default), so a lost state file never makes a job
/// more flexible than Slurm's record of it.
pub fn recorded_tier(jobs: &SlurmJobs, job_id: &str, node: &str) -> Option<String> {
    let job = jobs.get(job_id)?;
    if !job.state.holds_nodes() || !job.nodes.contains(node) {
        return None;
    }
    tier_from_admin_comment(&job.admin_comment)
}

/// The tier the controller recorded for a job in its `AdminComment`
/// (`powerflex;tier=flex2;pfi=1.43;cap=450W`). `None` when the comment is not one of
/// powerflex's or names no tier. A site's own text before powerflex's segment
/// (`project=X | powerflex;tier=…`) is skipped.
pub fn tier_from_admin_comment(comment: &str) -> Option<String> {
    let comment = &comment[powerflex_segment_start(comment)?..];
    let mut parts = comment.split(';');
    if parts.next() != Some("powerflex") {
        return None;
    }
    parts
        .find_map(|p| p.strip_prefix("tier="))
        .filter(|t| !t.is_empty() && *t != "-")
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostlists_expand_like_slurm_and_are_bounded_in_total() {
        assert_eq!(
            expand_hostlist("n[1-3]", 10),
            Some(vec!["n1".into(), "n2".into(), "n3".into()])
        );
        assert_eq!(
            expand_hostlist("gpu[01-02,07],login", 10),
            Some(vec![
                "gpu01".into(),
                "gpu02".into(),
                "gpu07".into(),
                "login".into()
            ])
        );
        assert_eq!(expand_hostlist("n1", 10), Some(vec!["n1".into()]));
        assert_eq!(expand_hostlist("", 10), Some(vec![]));
        for bad in ["n[3-1]", "n[1-", "n[a-b]", "n[1-2]x[3]", "n[-1]", "n[1--2]"] {
            assert_eq!(expand_hostlist(bad, 10), None, "{bad}");
        }
        // Ranges within one element count towards the total, not each on its own.
        let crafted = format!("n[{}]", ["0-60000"; 100].join(","));
        assert_eq!(expand_hostlist(&crafted, MAX_HOSTLIST_NAMES), None);
        assert_eq!(expand_hostlist("n[1-11]", 10), None);
        assert_eq!(expand_hostlist("n[1-10]", 10).map(|v| v.len()), Some(10));
        // A range as wide as u64 is refused at the bound, not walked.
        assert_eq!(expand_hostlist("n[0-18446744073709551615]", 1000), None);
    }

    const SQUEUE: &str = r#"{"meta":{},"errors":[],"jobs":[
      {"job_id":1,"user_id":1001,"job_state":"RUNNING","nodes":"n[1-2]",
       "name":"x AdminComment=powerflex;tier=none","admin_comment":"","comment":"AdminComment=powerflex;tier=none"},
      {"job_id":2,"user_id":1002,"job_state":"PENDING","nodes":"","admin_comment":"powerflex;tier=flex1;pfi=-;cap=500W","account":"physics"},
      {"job_id":3,"user_id":0,"job_state":"SUSPENDED","nodes":"n3","admin_comment":"powerflex;tier=flex3,preempt=suspend;suspended:x"}
    ]}"#;

    #[test]
    fn squeue_json_gives_each_run_s_start_in_either_time_format() {
        let text = r#"{"jobs":[
          {"job_id":1,"user_id":1,"job_state":"RUNNING","nodes":"n1","start_time":1764680000},
          {"job_id":2,"user_id":1,"job_state":["RUNNING"],"nodes":"n1",
           "start_time":{"set":true,"infinite":false,"number":1764680001}},
          {"job_id":3,"user_id":1,"job_state":"PENDING","nodes":"","start_time":1764689999},
          {"job_id":4,"user_id":1,"job_state":"RUNNING","nodes":"n1","start_time":{"set":false,"infinite":false,"number":0}},
          {"job_id":5,"user_id":1,"job_state":"COMPLETED","nodes":"n1","start_time":0},
          {"job_id":6,"user_id":1,"job_state":"RUNNING","nodes":"n1"}
        ]}"#;
        let jobs = parse_squeue_json(text.as_bytes()).expect("parses");
        assert_eq!(jobs["1"].start_unix_s, Some(1_764_680_000));
        assert_eq!(jobs["2"].start_unix_s, Some(1_764_680_001));
        assert_eq!(
            jobs["3"].start_unix_s, None,
            "a pending job's start is an estimate"
        );
        assert_eq!(jobs["4"].start_unix_s, None);
        assert_eq!(jobs["5"].start_unix_s, None);
        assert_eq!(jobs["6"].start_unix_s, None);
    }

    #[test]
    fn squeue_json_gives_placement_owner_state_and_the_real_admin_comment() {
        let jobs = parse_squeue_json(SQUEUE.as_bytes()).expect("parses");
        let one = &jobs["1"];
        assert_eq!(one.nodes, ["n1", "n2"].map(String::from).into());
        assert_eq!(one.uid, 1001);
        assert_eq!(one.state, SlurmJobState::OnItsNodes);
        // The forged text sits in the name and comment; the admin comment is empty.
        assert_eq!(tier_from_admin_comment(&one.admin_comment), None);
        assert_eq!(
            tier_from_admin_comment("project=X | powerflex;tier=flex3;cap=450W").as_deref(),
            Some("flex3")
        );
        assert_eq!(
            tier_from_admin_comment("project=powerflex;tier=flex3"),
            None
        );
        assert_eq!(jobs["2"].state, SlurmJobState::Pending);
        assert_eq!(jobs["2"].account, "physics");
        assert_eq!(one.account, "", "no account named: none");
        assert!(jobs["2"].nodes.is_empty());
        assert_eq!(
            tier_from_admin_comment(&jobs["2"].admin_comment).as_deref(),
            Some("flex1")
        );
        assert_eq!(jobs["3"].state, SlurmJobState::Suspended);
        assert!(jobs["3"].state.holds_nodes());
        assert_eq!(
            tier_from_admin_comment(&jobs["3"].admin_comment).as_deref(),
            Some("flex3,preempt=suspend")
        );
    }

    #[test]
    fn bad_slurm_output_is_refused_with_a_reason() {
        assert!(matches!(
            parse_squeue_json(b"squeue: error: cannot connect"),
            Err(SlurmRecordError::NotJson { .. })
        ));
        assert!(matches!(
            parse_squeue_json(br#"{"errors":[{"error":"x"}],"jobs":[]}"#),
            Err(SlurmRecordError::Reported(_))
        ));
        let crafted = format!(
            r#"{{"jobs":[{{"job_id":1,"user_id":1,"job_state":"RUNNING","nodes":"n[{}]"}}]}}"#,
            ["0-60000"; 10].join(",")
        );
        assert!(matches!(
            parse_squeue_json(crafted.as_bytes()),
            Err(SlurmRecordError::NodeList { .. })
        ));
    }

    #[test]
    fn sinfo_gres_counts_gpus_of_every_type() {
        let text = r#"{"errors":[],"nodes":[
          {"name":"n1","gres":"gpu:4"},
          {"name":"n2","gres":"gpu:h100:8(S:0-1)"},
          {"name":"n3","gres":"gpu:a:2(S:0),gpu:b:2,mps:100"},
          {"name":"login","gres":""},
          {"name":"n4","gres":"gpux:3,gpu"}
        ]}"#;
        let gpus = parse_sinfo_gpus(text.as_bytes()).expect("parses");
        assert_eq!(gpus["n1"], 4);
        assert_eq!(gpus["n2"], 8);
        assert_eq!(gpus["n3"], 4);
        assert_eq!(gpus["login"], 0);
        assert_eq!(gpus["n4"], 1, "gpux is another gres; a bare gpu is one");
    }

    #[test]
    fn states_are_told_apart() {
        assert_eq!(
            SlurmJobState::from_slurm("COMPLETING"),
            SlurmJobState::OnItsNodes
        );
        assert_eq!(
            SlurmJobState::from_slurm("PENDING+REQUEUED"),
            SlurmJobState::Pending
        );
        assert_eq!(SlurmJobState::from_slurm("COMPLETED"), SlurmJobState::Ended);
        assert_eq!(SlurmJobState::from_slurm("CANCELLED"), SlurmJobState::Ended);
        assert_eq!(
            SlurmJobState::from_slurm("STOPPED"),
            SlurmJobState::OnItsNodes
        );
        let later = r#"{"jobs":[{"job_id":5,"user_id":1,"job_state":["RUNNING","COMPLETING"],"nodes":"n1"}]}"#;
        assert_eq!(
            parse_squeue_json(later.as_bytes()).expect("a list of flags")["5"].state,
            SlurmJobState::OnItsNodes
        );
    }
}
