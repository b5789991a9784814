//! Agent ↔ controller link, version 2: framed lines over TCP, every frame authenticated
//! over the exact bytes on the wire, with per-node keys and per-connection freshness.
//!
//! ## Frames
//! One frame is one line:
//! ```text
//! pf2 <from> <to> <seq> <ts_ms> <payload> <mac>\n
//! ```
//! `from`/`to` are the sender and the receiver (a node name, or `controller`), `seq` a
//! number rising per sender within one connection, `ts_ms` the sender's wall clock
//! (Unix ms), `payload` the [`Body`] as compact JSON (it holds no newline), and `mac`
//! the hex HMAC-SHA256 of every byte before the space that precedes it. The receiver
//! checks the MAC over the bytes it received, before it parses the payload: nothing is
//! re-serialised to authenticate (which once broke on a float off by one ulp).
//!
//! ## Keys
//! The controller holds the site key; each node holds only its own key,
//! [`node_key`]`(site key, node)` (HKDF-SHA256 with the node name as its context). A
//! node's key cannot produce another node's, nor the site key, so root on one node can
//! speak neither for another node nor for the controller to another node.
//!
//! ## Handshake and freshness
//! 1. agent → controller: [`Body::Open`] with a fresh random agent nonce, sealed with
//!    the node key;
//! 2. controller → agent: [`Body::Challenge`] echoing that nonce with a fresh controller
//!    nonce, sealed with the node key;
//! 3. both derive the session key [`Session`] from the node key and both nonces; every
//!    later frame ([`Body::Hello`] first, then reports and leases) is sealed with it, its
//!    `seq` rising from 1 in each direction.
//!
//! A frame recorded on an earlier connection (before a reconnect, or before either side
//! restarted) fails authentication on any later one: its session key is not the new
//! one. Within a connection a frame is accepted once (`seq` must rise). A controller only
//! counts an agent as connected after its hello under the session key, so a replayed
//! `Open` buys nothing.
//!
//! ## Version 1
//! Version 1 sent JSON envelopes (`{"v":1,...}`) keyed with the shared site key. A
//! version 2 receiver refuses them with [`LinkError::Version`] naming version 2, and can
//! answer with [`v1_refusal_line`], which a version 1 peer reads as "unsupported protocol
//! version 2".
//!
//! Agent → controller: `Open`, then (session) `Hello`, then `Report` every allocation
//! period. Controller → agent: `Challenge`, then (session) `Lease` — per-job caps valid
//! for `ttl_s`.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::{ProtoError, MAX_LINE_BYTES};

/// The link protocol version this crate speaks.
pub const LINK_VERSION: u32 = 2;

/// The controller's name in frame headers (no node may take it).
pub const CONTROLLER: &str = "controller";

/// Largest accepted difference between a frame's timestamp and the receiver's clock.
pub const MAX_SKEW_MS: u64 = 60_000;

/// Largest link frame, bytes, newline included: reports carry curves of many jobs.
pub const MAX_LINK_LINE_BYTES: usize = 64 * MAX_LINE_BYTES;

/// Largest frame of the handshake (open, challenge, hello), bytes: what a controller
/// buffers for a peer that has not proven its key yet. A hello of
/// [`crate::report::MAX_GPUS_PER_NODE`] GPUs fits.
pub const MAX_HANDSHAKE_LINE_BYTES: usize = 96 * 1024;

/// Bytes of a handshake nonce.
pub const NONCE_BYTES: usize = 16;

/// A handshake nonce: fresh random bytes per connection and side.
pub type Nonce = [u8; NONCE_BYTES];

/// Longest node name, bytes.
pub const MAX_NODE_NAME_BYTES: usize = powerflex_core::slurm_record::MAX_NODE_NAME_BYTES;

/// Domain separation of the two derivations (a node key is never a session key).
const NODE_KEY_SALT: &[u8] = b"powerflex link v2 node key";
const SESSION_INFO: &[u8] = b"powerflex link v2 session key";

/// The frame prefix of this version.
const PREFIX: &str = "pf2";

// What an agent reports and the controller checks is plain data, with no part in the
// link's cryptography: `crate::report` holds it, so pure crates take it without this
// feature.
use crate::report::{GpuInfo, JobReport, NodeReport};
use crate::usage::FinalRef;

/// What a message says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Body {
    /// Handshake, agent → controller (sealed with the node key): the agent's nonce for
    /// this connection, hex.
    Open { nonce: String },
    /// Handshake, controller → agent (sealed with the node key): the agent's nonce echoed
    /// and the controller's nonce for this connection, hex.
    Challenge {
        agent_nonce: String,
        controller_nonce: String,
    },
    /// The agent's GPUs; the first frame under the session key.
    Hello { gpus: Vec<GpuInfo> },
    Report {
        jobs: Vec<JobReport>,
        power_w: f64,
        failsafe: bool,
        /// GPU limits the agent found changed behind its back (read back through NVML
        /// and not what it wrote) and wrote again, since the agent started.
        #[serde(default)]
        cap_mismatches: u64,
        /// Final shares of jobs that ended on the node and that the controller has not
        /// acknowledged ([`Body::Acked`]) yet, at most [`crate::report::MAX_ENDED_PER_REPORT`] per
        /// report: the agent keeps them on disk and re-sends them until acknowledged
        /// (a controller that never acknowledges, one older than [`Body::Acked`], keeps
        /// the first of each and ignores repeats). A controller older than this field
        /// refuses such reports: upgrade controllers before agents.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        ended: Vec<crate::usage::NodeUsage>,
        /// The agent runs in observe mode (`agent.enforce = false`): it writes no limit,
        /// and its caps are the GPUs' own.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        observe_only: bool,
    },
    /// Per-job per-GPU caps, W, valid for `ttl_s` from receipt, for node `node` only.
    Lease {
        /// The node this lease is for: an agent refuses a lease naming another node.
        node: String,
        caps: std::collections::BTreeMap<String, f64>,
        ttl_s: f64,
        /// Per-GPU cap for a managed job the lease does not name yet (it started since
        /// the controller last allocated): the share the budget in force leaves a new
        /// job, so a job that starts during a cut does not start above it, W.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        start_cap_w: Option<f64>,
        /// Jobs whose measured power or throughput left their curve's band: the agent
        /// walks them again, at most as often as its rate limit allows.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        recalibrate: Vec<String>,
        /// Jobs the agent may hold one cap step below their cap for a window, to learn
        /// their curve there: jobs on this node only (a probe on one node of a job
        /// spanning several would slow the job everywhere and mislabel the others'
        /// windows), while an event holds them below uncapped.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        learn: Vec<String>,
        /// Seconds from the controller's send to the start of the next announced grid
        /// event, when one is scheduled: a job still calibrating compresses its walk to
        /// have its curve measured before the cut (pre-positioning). An older
        /// agent refuses a lease with this field: upgrade agents before announcing
        /// events to them.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        next_event_in_s: Option<f64>,
        /// Per job of this node: the lowest per-GPU cap the next announced grid event's
        /// plan needs, W. The agent extends the job's calibration walk down to it, so the
        /// event's caps land where the job was measured (pre-positioning). Sent only
        /// while an event is announced and not yet started, beside `next_event_in_s`: an
        /// agent older than this field refuses such a lease, as it does that one.
        #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
        walk_to_w: std::collections::BTreeMap<String, f64>,
        /// A grid event is in force now (for the jobs' accounting of time in events).
        /// Sent only while true; an agent older than this field refuses such a lease.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        event_in_force: bool,
        /// The sending controller's leadership epoch: it rises each time a
        /// controller takes leadership of the site. An agent keeps the highest epoch it
        /// has accepted and refuses a lease from a lower one ([`Body::Fenced`]), so a
        /// controller that lost leadership can never steer beside the one that took it.
        /// Absent (0) from a single controller, and from one older than this field. An
        /// agent older than this field refuses a lease that carries it: upgrade the
        /// agents before enabling `[controller.ha]`.
        #[serde(default, skip_serializing_if = "is_zero")]
        epoch: u64,
    },
    /// Agent → controller: a lease was refused for its epoch. The agent has accepted a
    /// lease of `accepted_epoch` from a controller that took leadership after the
    /// sender: the sender must stop steering (it is fenced). The agent then closes the
    /// connection and looks for the active controller.
    Fenced {
        /// The refused lease's epoch.
        lease_epoch: u64,
        /// The highest epoch this agent has accepted.
        accepted_epoch: u64,
    },
    /// Controller → agent, in answer to a hello (or to a live session when the
    /// controller steps down): this controller is a standby and does not steer. The
    /// agent closes the connection and tries its next controller address.
    Standby {
        /// Why, for the agent's log (e.g. "standby: the active controller is ctld-a").
        reason: String,
    },
    /// Controller → agent: these final shares (from the node's reports' `ended`) are
    /// taken for good: their job's record is written (or was before). The agent stops
    /// re-sending them. At most [`crate::report::MAX_ACKS_PER_MESSAGE`]. Sent only to a node whose
    /// report carried final shares; an agent older than this message logs it as
    /// refused and ignores it (it re-sends its shares for a while as before).
    Acked { finals: Vec<FinalRef> },
}

type HmacSha256 = Hmac<Sha256>;

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

fn nonce_from_hex(field: &str, text: &str) -> Result<Nonce, LinkError> {
    unhex(text)
        .and_then(|b| Nonce::try_from(b.as_slice()).ok())
        .ok_or_else(|| {
            LinkError::Malformed(format!(
                "{field} is not {NONCE_BYTES} bytes of hex ({} hex digits)",
                2 * NONCE_BYTES
            ))
        })
}

/// Whether `name` can name a node on the link: 1 to [`MAX_NODE_NAME_BYTES`] ASCII
/// letters, digits, `.`, `_` or `-`, and not [`CONTROLLER`] (Slurm node names fit).
pub fn valid_node_name(name: &str) -> bool {
    powerflex_core::slurm_record::valid_node_name(name) && name != CONTROLLER
}

fn check_node_name(name: &str) -> Result<(), LinkError> {
    if valid_node_name(name) {
        Ok(())
    } else {
        Err(LinkError::BadNodeName {
            name: name.chars().take(80).collect(),
        })
    }
}

/// Node `node`'s link key, derived from the site key: the hex text of
/// HKDF-SHA256(salt "powerflex link v2 node key", input the site key, context the node
/// name), 64 bytes. This text is what the node's key file holds and what it seals with.
pub fn node_key(site_key: &[u8], node: &str) -> Result<Vec<u8>, LinkError> {
    check_node_name(node)?;
    let kdf = hkdf::Hkdf::<Sha256>::new(Some(NODE_KEY_SALT), site_key);
    let mut okm = [0u8; 32];
    // 32 bytes is far below HKDF-SHA256's 8160-byte limit: expand cannot fail.
    kdf.expand(node.as_bytes(), &mut okm)
        .map_err(|e| LinkError::Malformed(format!("key derivation: {e}")))?;
    Ok(hex(&okm).into_bytes())
}

/// A fresh nonce from the operating system's random source.
pub fn fresh_nonce() -> Result<Nonce, LinkError> {
    let mut nonce = [0u8; NONCE_BYTES];
    getrandom::fill(&mut nonce).map_err(|e| LinkError::NoRandom(e.to_string()))?;
    Ok(nonce)
}

/// What a frame says of itself, outside its payload. Authenticated with the payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub from: String,
    pub to: String,
    pub seq: u64,
    /// Sender's wall clock, Unix ms.
    pub ts_ms: u64,
}

fn mac_over(key: &[u8], signed: &[u8]) -> Result<HmacSha256, LinkError> {
    let mut mac = HmacSha256::new_from_slice(key)
        .map_err(|e| LinkError::Malformed(format!("mac key: {e}")))?;
    mac.update(signed);
    Ok(mac)
}

/// Seals `body` as one frame (newline included) with `key`. Refuses a frame longer than
/// `limit` bytes (at most [`MAX_LINK_LINE_BYTES`]), and header names that are neither a
/// valid node name nor [`CONTROLLER`].
pub fn seal(key: &[u8], header: &Header, body: &Body, limit: usize) -> Result<String, LinkError> {
    for name in [&header.from, &header.to] {
        if name != CONTROLLER {
            check_node_name(name)?;
        }
    }
    let payload =
        serde_json::to_string(body).map_err(|e| LinkError::Malformed(format!("payload: {e}")))?;
    let mut line = format!(
        "{PREFIX} {} {} {} {} {payload}",
        header.from, header.to, header.seq, header.ts_ms
    );
    let mac = hex(&mac_over(key, line.as_bytes())?.finalize().into_bytes());
    line.push(' ');
    line.push_str(&mac);
    line.push('\n');
    let limit = limit.min(MAX_LINK_LINE_BYTES);
    if line.len() > limit {
        return Err(LinkError::TooLarge {
            bytes: line.len(),
            limit_bytes: limit,
        });
    }
    Ok(line)
}

/// A frame split into its parts, its MAC not checked yet: the header tells the receiver
/// which key to check it with ([`Framed::verify`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Framed<'a> {
    pub header: Header,
    signed: &'a str,
    payload: &'a str,
    mac: Vec<u8>,
}

/// What a version 1 envelope is parsed for: its version only.
#[derive(Deserialize)]
struct V1Probe {
    v: Option<u64>,
}

fn field<'a>(parts: &mut impl Iterator<Item = &'a str>, name: &str) -> Result<&'a str, LinkError> {
    parts
        .next()
        .filter(|p| !p.is_empty())
        .ok_or_else(|| LinkError::Malformed(format!("frame without {name}")))
}

fn number(name: &str, text: &str) -> Result<u64, LinkError> {
    if text.is_empty() || text.len() > 20 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(LinkError::Malformed(format!(
            "{name} is not a decimal number of 1-20 digits"
        )));
    }
    text.parse()
        .map_err(|_| LinkError::Malformed(format!("{name} exceeds 2^64-1")))
}

/// Splits one received line (trailing newline optional) into a [`Framed`]. Refuses
/// longer lines than `limit`, version 1 envelopes and other versions
/// ([`LinkError::Version`]), and anything that is not a frame.
pub fn unframe(line: &str, limit: usize) -> Result<Framed<'_>, LinkError> {
    if line.len() > limit.min(MAX_LINK_LINE_BYTES) {
        return Err(LinkError::TooLarge {
            bytes: line.len(),
            limit_bytes: limit.min(MAX_LINK_LINE_BYTES),
        });
    }
    let line = line.strip_suffix('\n').unwrap_or(line);
    if line.starts_with('{') {
        // A version 1 envelope (JSON): refuse it by its version, clearly.
        let got = serde_json::from_str::<V1Probe>(line)
            .ok()
            .and_then(|p| p.v)
            .unwrap_or(1);
        return Err(LinkError::Version { got });
    }
    let (signed, mac) = line
        .rsplit_once(' ')
        .ok_or_else(|| LinkError::Malformed("frame without a mac".into()))?;
    let mut parts = signed.splitn(6, ' ');
    let prefix = field(&mut parts, "a version")?;
    if prefix != PREFIX {
        let got = prefix
            .strip_prefix("pf")
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| {
                LinkError::Malformed(format!(
                    "not a powerflex link frame; accepted: lines starting \"{PREFIX} \""
                ))
            })?;
        return Err(LinkError::Version { got });
    }
    let from = field(&mut parts, "a sender")?;
    let to = field(&mut parts, "a receiver")?;
    let seq = number("seq", field(&mut parts, "a seq")?)?;
    let ts_ms = number("ts_ms", field(&mut parts, "a ts_ms")?)?;
    let payload = field(&mut parts, "a payload")?;
    for name in [from, to] {
        if name != CONTROLLER {
            check_node_name(name)?;
        }
    }
    let mac = unhex(mac)
        .filter(|m| m.len() == 32)
        .ok_or_else(|| LinkError::BadMac { from: from.into() })?;
    Ok(Framed {
        header: Header {
            from: from.into(),
            to: to.into(),
            seq,
            ts_ms,
        },
        signed,
        payload,
        mac,
    })
}

impl Framed<'_> {
    /// Checks the MAC over the received bytes with `key` (in constant time), then parses
    /// the payload. Nothing of the payload is read before the MAC holds.
    pub fn verify(self, key: &[u8]) -> Result<(Header, Body), LinkError> {
        mac_over(key, self.signed.as_bytes())?
            .verify_slice(&self.mac)
            .map_err(|_| LinkError::BadMac {
                from: self.header.from.clone(),
            })?;
        let body = serde_json::from_str(self.payload)
            .map_err(|e| LinkError::Malformed(format!("payload: {e}")))?;
        Ok((self.header, body))
    }
}

fn check_skew(header: &Header, now_ms: u64) -> Result<(), LinkError> {
    let skew = header.ts_ms.abs_diff(now_ms);
    if skew > MAX_SKEW_MS {
        return Err(LinkError::Stale {
            from: header.from.clone(),
            skew_ms: skew,
        });
    }
    Ok(())
}

fn check_route(header: &Header, from: &str, to: &str) -> Result<(), LinkError> {
    if header.from != from || header.to != to {
        return Err(LinkError::WrongPeer {
            expected: format!("{from} -> {to}"),
            got: format!("{} -> {}", header.from, header.to),
        });
    }
    Ok(())
}

/// A version 1 envelope a version 1 peer parses and refuses with "unsupported protocol
/// version 2", its `from` saying why. Sent once before closing on a version 1 peer.
pub fn v1_refusal_line() -> String {
    format!(
        "{{\"v\":{LINK_VERSION},\"from\":\"controller: link version 1 refused; accepted: version {LINK_VERSION} (upgrade this agent)\",\"seq\":0,\"ts_ms\":0,\"body\":{{\"type\":\"hello\",\"gpus\":[]}},\"mac\":\"\"}}\n"
    )
}

/// One side of an authenticated connection: the session key both sides derived from the
/// node key and both nonces, who this side and its peer are, and the sequence numbers
/// sent and accepted so far.
#[derive(Clone)]
pub struct Session {
    key: [u8; 32],
    me: String,
    peer: String,
    sent: u64,
    received: u64,
}

impl std::fmt::Debug for Session {
    // The key stays out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("me", &self.me)
            .field("peer", &self.peer)
            .field("sent", &self.sent)
            .field("received", &self.received)
            .finish_non_exhaustive()
    }
}

impl Session {
    fn derive(node_key: &[u8], agent: &Nonce, controller: &Nonce, me: &str, peer: &str) -> Session {
        let mut salt = [0u8; 2 * NONCE_BYTES];
        salt[..NONCE_BYTES].copy_from_slice(agent);
        salt[NONCE_BYTES..].copy_from_slice(controller);
        let kdf = hkdf::Hkdf::<Sha256>::new(Some(&salt), node_key);
        let mut key = [0u8; 32];
        // 32 bytes never exceeds HKDF-SHA256's output limit.
        let _ = kdf.expand(SESSION_INFO, &mut key);
        Session {
            key,
            me: me.into(),
            peer: peer.into(),
            sent: 0,
            received: 0,
        }
    }

    /// This side's name.
    pub fn me(&self) -> &str {
        &self.me
    }

    /// The peer's name (the node, on the controller's side).
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Seals `body` as the next frame to the peer, at `now_ms`.
    pub fn seal(&mut self, body: &Body, now_ms: u64) -> Result<String, LinkError> {
        let header = Header {
            from: self.me.clone(),
            to: self.peer.clone(),
            seq: self.sent + 1,
            ts_ms: now_ms,
        };
        let line = seal(&self.key, &header, body, MAX_LINK_LINE_BYTES)?;
        self.sent += 1;
        Ok(line)
    }

    /// Opens the next frame from the peer: framing, route (from the peer, to this side),
    /// MAC under this session's key, clock skew, and a `seq` above the last accepted.
    pub fn open(&mut self, line: &str, now_ms: u64) -> Result<Body, LinkError> {
        self.open_limited(line, now_ms, MAX_LINK_LINE_BYTES)
    }

    /// [`Session::open`] with a tighter size limit (the controller's, before hello).
    pub fn open_limited(
        &mut self,
        line: &str,
        now_ms: u64,
        limit: usize,
    ) -> Result<Body, LinkError> {
        let framed = unframe(line, limit)?;
        check_route(&framed.header, &self.peer, &self.me)?;
        let (header, body) = framed.verify(&self.key)?;
        check_skew(&header, now_ms)?;
        if header.seq <= self.received {
            return Err(LinkError::Replayed {
                from: header.from,
                seq: header.seq,
                last: self.received,
            });
        }
        self.received = header.seq;
        Ok(body)
    }
}

/// The agent's side of the handshake, between its `Open` and the controller's
/// `Challenge`.
#[derive(Debug, Clone)]
pub struct AgentHandshake {
    node_key: Vec<u8>,
    node: String,
    nonce: Nonce,
}

impl AgentHandshake {
    /// Starts a connection as node `node` with its key and a fresh `nonce`: the
    /// handshake state and the `Open` frame to send.
    pub fn start(
        node_key: &[u8],
        node: &str,
        nonce: Nonce,
        now_ms: u64,
    ) -> Result<(AgentHandshake, String), LinkError> {
        check_node_name(node)?;
        let header = Header {
            from: node.into(),
            to: CONTROLLER.into(),
            seq: 1,
            ts_ms: now_ms,
        };
        let open = Body::Open { nonce: hex(&nonce) };
        let line = seal(node_key, &header, &open, MAX_HANDSHAKE_LINE_BYTES)?;
        Ok((
            AgentHandshake {
                node_key: node_key.to_vec(),
                node: node.into(),
                nonce,
            },
            line,
        ))
    }

    /// Checks the controller's answer: a `Challenge` to this node from the controller,
    /// under the node key, echoing this connection's nonce. Gives the session.
    pub fn finish(self, line: &str, now_ms: u64) -> Result<Session, LinkError> {
        let framed = unframe(line, MAX_HANDSHAKE_LINE_BYTES)?;
        check_route(&framed.header, CONTROLLER, &self.node)?;
        let (header, body) = framed.verify(&self.node_key)?;
        check_skew(&header, now_ms)?;
        let Body::Challenge {
            agent_nonce,
            controller_nonce,
        } = body
        else {
            return Err(LinkError::Unexpected {
                expected: "challenge",
                got: body.kind(),
            });
        };
        if nonce_from_hex("agent_nonce", &agent_nonce)? != self.nonce {
            return Err(LinkError::NonceMismatch { from: header.from });
        }
        let controller_nonce = nonce_from_hex("controller_nonce", &controller_nonce)?;
        Ok(Session::derive(
            &self.node_key,
            &self.nonce,
            &controller_nonce,
            &self.node,
            CONTROLLER,
        ))
    }
}

/// The controller's side of the handshake: checks an agent's `Open` under the key
/// derived for the node it names, and answers a `Challenge` with the controller's fresh
/// `nonce`. Gives the session (not yet trusted: the peer is only known to hold the node
/// key once a frame under the session key opens, since an `Open` can be replayed) and
/// the challenge frame.
pub fn controller_accept(
    site_key: &[u8],
    line: &str,
    nonce: Nonce,
    now_ms: u64,
) -> Result<(Session, String), LinkError> {
    let framed = unframe(line, MAX_HANDSHAKE_LINE_BYTES)?;
    if framed.header.to != CONTROLLER || framed.header.from == CONTROLLER {
        return Err(LinkError::WrongPeer {
            expected: format!("<node> -> {CONTROLLER}"),
            got: format!("{} -> {}", framed.header.from, framed.header.to),
        });
    }
    let node = framed.header.from.clone();
    let key = node_key(site_key, &node)?;
    let (header, body) = framed.verify(&key)?;
    check_skew(&header, now_ms)?;
    let Body::Open { nonce: agent_nonce } = body else {
        return Err(LinkError::Unexpected {
            expected: "open",
            got: body.kind(),
        });
    };
    let agent_nonce = nonce_from_hex("nonce", &agent_nonce)?;
    let challenge = Body::Challenge {
        agent_nonce: hex(&agent_nonce),
        controller_nonce: hex(&nonce),
    };
    let reply = Header {
        from: CONTROLLER.into(),
        to: node.clone(),
        seq: 1,
        ts_ms: now_ms,
    };
    let line = seal(&key, &reply, &challenge, MAX_HANDSHAKE_LINE_BYTES)?;
    Ok((
        Session::derive(&key, &agent_nonce, &nonce, CONTROLLER, &node),
        line,
    ))
}

impl From<NodeReport> for Body {
    /// The report as the link carries it.
    fn from(report: NodeReport) -> Body {
        let NodeReport {
            jobs,
            power_w,
            failsafe,
            cap_mismatches,
            ended,
            observe_only,
        } = report;
        Body::Report {
            jobs,
            power_w,
            failsafe,
            cap_mismatches,
            ended,
            observe_only,
        }
    }
}

impl Body {
    /// The message's type as the wire names it.
    pub fn kind(&self) -> &'static str {
        match self {
            Body::Open { .. } => "open",
            Body::Challenge { .. } => "challenge",
            Body::Hello { .. } => "hello",
            Body::Report { .. } => "report",
            Body::Lease { .. } => "lease",
            Body::Acked { .. } => "acked",
            Body::Fenced { .. } => "fenced",
            Body::Standby { .. } => "standby",
        }
    }
}

/// Why a link frame was refused. [`LinkError::reason`] names the kind for metrics.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LinkError {
    #[error(transparent)]
    Proto(#[from] ProtoError),
    #[error("malformed link frame: {0}")]
    Malformed(String),
    #[error("link frame of {bytes} bytes exceeds the {limit_bytes}-byte limit")]
    TooLarge { bytes: usize, limit_bytes: usize },
    #[error(
        "link version {got} refused; accepted: version {LINK_VERSION} (frames starting \"pf2 \")"
    )]
    Version { got: u64 },
    #[error(
        "bad node name {name:?}; accepted: 1-{MAX_NODE_NAME_BYTES} ASCII letters, digits, '.', '_' or '-', not \"{CONTROLLER}\""
    )]
    BadNodeName { name: String },
    #[error("message from {from} fails authentication (wrong key, altered, or recorded on an earlier connection)")]
    BadMac { from: String },
    #[error("message from {from} replayed: sequence {seq} not above {last}")]
    Replayed { from: String, seq: u64, last: u64 },
    #[error(
        "message from {from} is {skew_ms} ms away from this host's clock (limit {MAX_SKEW_MS} ms)"
    )]
    Stale { from: String, skew_ms: u64 },
    #[error("message routed {got}; accepted on this connection: {expected}")]
    WrongPeer { expected: String, got: String },
    #[error("challenge from {from} does not echo this connection's nonce (replayed)")]
    NonceMismatch { from: String },
    #[error("{got} message where a {expected} was due")]
    Unexpected {
        expected: &'static str,
        got: &'static str,
    },
    #[error("no random bytes for a nonce: {0}")]
    NoRandom(String),
}

impl LinkError {
    /// A short name of the refusal, for the `reason` label of refusal counters.
    pub fn reason(&self) -> &'static str {
        match self {
            LinkError::Proto(_) | LinkError::Malformed(_) | LinkError::BadNodeName { .. } => {
                "malformed"
            }
            LinkError::TooLarge { .. } => "oversize",
            LinkError::Version { .. } => "version",
            LinkError::BadMac { .. } => "mac",
            LinkError::Replayed { .. } | LinkError::NonceMismatch { .. } => "replay",
            LinkError::Stale { .. } => "stale",
            LinkError::WrongPeer { .. } => "wrong_peer",
            LinkError::Unexpected { .. } => "unexpected",
            LinkError::NoRandom(_) => "internal",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::point::from_array;
    use crate::report::{
        validate_acks, validate_final_shares, validate_gpus, validate_report_totals,
        MAX_ACKS_PER_MESSAGE, MAX_ENDED_PER_REPORT,
    };

    const SITE: &[u8] = b"site key for tests";
    const NOW: u64 = 1_700_000_000_000;

    fn lease(node: &str, cap_w: f64) -> Body {
        Body::Lease {
            node: node.into(),
            caps: [("42".to_string(), cap_w)].into(),
            ttl_s: 30.0,
            start_cap_w: Some(300.0),
            recalibrate: Vec::new(),
            learn: Vec::new(),
            next_event_in_s: None,
            walk_to_w: Default::default(),
            event_in_force: false,
            epoch: 0,
        }
    }

    /// One full handshake for `node`: the agent's and the controller's sessions.
    fn connect(node: &str, agent_nonce: Nonce, ctld_nonce: Nonce) -> (Session, Session) {
        let key = node_key(SITE, node).expect("node key");
        let (hs, open) = AgentHandshake::start(&key, node, agent_nonce, NOW).expect("open");
        let (ctld, challenge) = controller_accept(SITE, &open, ctld_nonce, NOW).expect("accept");
        let agent = hs.finish(&challenge, NOW).expect("challenge");
        (agent, ctld)
    }

    #[test]
    fn node_keys_differ_per_node_and_are_stable_hex() {
        let a = node_key(SITE, "n1").expect("n1");
        let b = node_key(SITE, "n2").expect("n2");
        assert_eq!(a.len(), 64);
        assert!(a.iter().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
        assert_eq!(a, node_key(SITE, "n1").expect("again"));
        assert_ne!(
            a,
            node_key(b"another site key!!", "n1").expect("other site")
        );
        // Root on a node holds its key: deriving from that key (as if it were a site key)
        // gives neither its neighbour's key nor its own.
        assert_ne!(node_key(&a, "n2").expect("from a"), b);
        for bad in ["", "controller", "n 1", "n1\n", "../n1", &"x".repeat(65)] {
            assert!(
                matches!(node_key(SITE, bad), Err(LinkError::BadNodeName { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_handshake_gives_both_sides_one_session_and_frames_flow_both_ways() {
        let (mut agent, mut ctld) = connect("n1", [1; 16], [2; 16]);
        assert_eq!((agent.me(), agent.peer()), ("n1", CONTROLLER));
        assert_eq!((ctld.me(), ctld.peer()), (CONTROLLER, "n1"));
        let hello = Body::Hello { gpus: Vec::new() };
        let line = agent.seal(&hello, NOW).expect("seal");
        assert!(line.starts_with("pf2 n1 controller 1 "), "{line}");
        assert_eq!(ctld.open(&line, NOW + 5), Ok(hello));
        let line = ctld.seal(&lease("n1", 450.0), NOW).expect("seal");
        assert_eq!(agent.open(&line, NOW), Ok(lease("n1", 450.0)));
        // Once only.
        assert!(matches!(
            agent.open(&line, NOW),
            Err(LinkError::Replayed {
                seq: 1,
                last: 1,
                ..
            })
        ));
        // A frame the agent sealed cannot be reflected back to it as the controller's.
        let own = agent
            .seal(&Body::Hello { gpus: vec![] }, NOW)
            .expect("seal");
        assert!(matches!(
            agent.open(&own, NOW),
            Err(LinkError::WrongPeer { .. })
        ));
    }

    #[test]
    fn a_lease_from_an_earlier_connection_fails_on_a_later_one() {
        let (mut agent, mut ctld) = connect("n1", [1; 16], [2; 16]);
        let recorded = ctld.seal(&lease("n1", 700.0), NOW).expect("seal");
        assert!(agent.open(&recorded, NOW).is_ok());
        // Reconnect (or either side restarted): new nonces, new session key.
        let (mut agent2, _) = connect("n1", [3; 16], [4; 16]);
        assert!(matches!(
            agent2.open(&recorded, NOW),
            Err(LinkError::BadMac { .. })
        ));
        // Even if only the controller's nonce is new.
        let (mut agent3, _) = connect("n1", [1; 16], [5; 16]);
        assert!(matches!(
            agent3.open(&recorded, NOW),
            Err(LinkError::BadMac { .. })
        ));
    }

    #[test]
    fn a_replayed_challenge_or_open_buys_nothing() {
        let key = node_key(SITE, "n1").expect("key");
        let (_, open) = AgentHandshake::start(&key, "n1", [1; 16], NOW).expect("open");
        let (_, old_challenge) = controller_accept(SITE, &open, [2; 16], NOW).expect("accept");
        // A new connection (new agent nonce) fed the old challenge refuses it.
        let (hs, _) = AgentHandshake::start(&key, "n1", [9; 16], NOW).expect("open");
        assert!(matches!(
            hs.finish(&old_challenge, NOW),
            Err(LinkError::NonceMismatch { .. })
        ));
        // A replayed open gets a challenge, but the session differs from the real one, so
        // whoever replays it cannot seal a hello the controller accepts.
        let (mut replayed, _) = controller_accept(SITE, &open, [7; 16], NOW).expect("accept");
        let (mut real_agent, _) = connect("n1", [1; 16], [2; 16]);
        let hello = real_agent
            .seal(&Body::Hello { gpus: vec![] }, NOW)
            .expect("seal");
        assert!(matches!(
            replayed.open(&hello, NOW),
            Err(LinkError::BadMac { .. })
        ));
    }

    #[test]
    fn one_nodes_key_cannot_speak_for_another_node() {
        let key_a = node_key(SITE, "nA").expect("a");
        // Root on node A claims to be node B with A's key: the controller checks it under
        // B's key and refuses.
        let (_, open) = AgentHandshake::start(&key_a, "nB", [1; 16], NOW).expect("open");
        assert!(matches!(
            controller_accept(SITE, &open, [2; 16], NOW),
            Err(LinkError::BadMac { .. })
        ));
        // Root on A plays the controller to node B: B checks the challenge under its key.
        let key_b = node_key(SITE, "nB").expect("b");
        let (hs_b, open_b) = AgentHandshake::start(&key_b, "nB", [3; 16], NOW).expect("open");
        let framed = unframe(&open_b, MAX_HANDSHAKE_LINE_BYTES).expect("frame");
        let Body::Open { nonce } = framed.verify(&key_b).expect("b's own").1 else {
            panic!("open expected")
        };
        let forged = seal(
            &key_a,
            &Header {
                from: CONTROLLER.into(),
                to: "nB".into(),
                seq: 1,
                ts_ms: NOW,
            },
            &Body::Challenge {
                agent_nonce: nonce,
                controller_nonce: hex(&[4; 16]),
            },
            MAX_HANDSHAKE_LINE_BYTES,
        )
        .expect("seal");
        assert!(matches!(
            hs_b.finish(&forged, NOW),
            Err(LinkError::BadMac { .. })
        ));
        // And a lease the controller sealed for A, sent to B's session, is refused.
        let (_, mut ctld_a) = connect("nA", [5; 16], [6; 16]);
        let (mut agent_b, _) = connect("nB", [5; 16], [6; 16]);
        let for_a = ctld_a.seal(&lease("nA", 700.0), NOW).expect("seal");
        assert!(matches!(
            agent_b.open(&for_a, NOW),
            Err(LinkError::WrongPeer { .. })
        ));
    }

    #[test]
    fn the_mac_covers_the_bytes_on_the_wire() {
        let (mut agent, mut ctld) = connect("n1", [1; 16], [2; 16]);
        let line = ctld.seal(&lease("n1", 450.0), NOW).expect("seal");
        // Any byte changed, anywhere before the MAC, fails: also changes that parse to
        // the same value (450.0 vs 450.00, reordered keys, added spaces).
        for altered in [
            line.replace("450.0", "700.0"),
            line.replace("450.0", "450.00"),
            line.replace("\"ttl_s\":30.0", "\"ttl_s\": 30.0"),
            line.replacen("pf2 controller n1 1 ", "pf2 controller n1 2 ", 1),
        ] {
            assert_ne!(altered, line);
            assert!(
                matches!(
                    agent.clone().open(&altered, NOW),
                    Err(LinkError::BadMac { .. })
                ),
                "{altered}"
            );
        }
        // Floats survive, since nothing is re-serialised: the exact value arrives.
        let odd = 0.1 + 0.2;
        let line = ctld.seal(&lease("n1", odd), NOW).expect("seal");
        assert_eq!(agent.open(&line, NOW), Ok(lease("n1", odd)));
    }

    #[test]
    fn malformed_frames_are_refused_with_what_is_accepted() {
        let (mut agent, _) = connect("n1", [1; 16], [2; 16]);
        let mac = "0".repeat(64);
        for (line, reason) in [
            ("", "malformed"),
            ("\n", "malformed"),
            ("garbage", "malformed"),
            ("pf2", "malformed"),
            ("pf2 controller n1 1 5 {} zz", "mac"),
            (&format!("pf2 controller n1 x 5 {{}} {mac}"), "malformed"),
            (&format!("pf2 controller n1 -1 5 {{}} {mac}"), "malformed"),
            (
                &format!("pf2 controller n1 99999999999999999999 5 {{}} {mac}"),
                "malformed",
            ),
            (&format!("pf2 controller n/1 1 5 {{}} {mac}"), "malformed"),
            (&format!("pf2 controller n1 1 5 {mac}"), "malformed"),
            (&format!("pf3 controller n1 1 5 {{}} {mac}"), "version"),
            ("{\"v\":1,\"from\":\"controller\",\"seq\":1}", "version"),
            ("{not json", "version"),
            (&format!("http/1.1 x y 1 2 {{}} {mac}"), "malformed"),
        ] {
            let err = agent.open(line, NOW).expect_err(line);
            assert_eq!(err.reason(), reason, "{line:?}: {err}");
        }
        let v1 = agent
            .open("{\"v\":1,\"from\":\"controller\"}", NOW)
            .expect_err("v1");
        assert_eq!(v1, LinkError::Version { got: 1 });
        assert!(v1.to_string().contains("accepted: version 2"), "{v1}");
        let too_long = "x".repeat(MAX_LINK_LINE_BYTES + 1);
        assert!(matches!(
            agent.open(&too_long, NOW),
            Err(LinkError::TooLarge { .. })
        ));
        // A valid MAC over a payload that is not a body is still refused, after the MAC.
        let key = node_key(SITE, "n1").expect("key");
        let signed = format!("pf2 n1 controller 1 {NOW} {{\"type\":\"nope\"}}");
        let good_mac = hex(&mac_over(&key, signed.as_bytes())
            .expect("mac")
            .finalize()
            .into_bytes());
        let line = format!("{signed} {good_mac}\n");
        let framed = unframe(&line, MAX_LINK_LINE_BYTES).expect("frames");
        assert!(matches!(framed.verify(&key), Err(LinkError::Malformed(_))));
    }

    #[test]
    fn seal_refuses_oversize_and_stale_frames_are_refused() {
        let (mut agent, mut ctld) = connect("n1", [1; 16], [2; 16]);
        let huge = Body::Lease {
            node: "n1".into(),
            caps: (0..20_000).map(|i| (format!("{i}"), 450.0)).collect(),
            ttl_s: 30.0,
            start_cap_w: None,
            recalibrate: Vec::new(),
            learn: Vec::new(),
            next_event_in_s: None,
            walk_to_w: Default::default(),
            event_in_force: false,
            epoch: 0,
        };
        assert!(matches!(
            ctld.seal(&huge, NOW),
            Err(LinkError::TooLarge { .. })
        ));
        // A refused seal does not use up a sequence number.
        let line = ctld.seal(&lease("n1", 450.0), NOW).expect("seal");
        assert!(line.starts_with("pf2 controller n1 1 "), "{line}");
        assert!(matches!(
            agent.open(&line, NOW + MAX_SKEW_MS + 1),
            Err(LinkError::Stale { .. })
        ));
    }

    #[test]
    fn a_version_1_peer_reads_a_refusal_naming_version_2() {
        #[derive(Deserialize)]
        struct V1Envelope {
            v: u32,
            from: String,
        }
        let refusal: V1Envelope =
            serde_json::from_str(v1_refusal_line().trim_end()).expect("a v1 peer parses it");
        assert_eq!(refusal.v, 2);
        assert!(
            refusal.from.contains("accepted: version 2"),
            "{}",
            refusal.from
        );
    }

    #[test]
    fn any_float_arrives_exactly() {
        use proptest::prelude::*;
        let (agent, ctld) = connect("n1", [1; 16], [2; 16]);
        proptest!(|(power in 0.0f64..1e7, cap in 100.0f64..1000.0, t in 0.0f64..1e6)| {
            let (mut agent, mut ctld) = (agent.clone(), ctld.clone());
            let body = Body::Report {
                jobs: vec![JobReport {
                    job_id: "1".into(),
                    tier: "flex1".into(),
                    gpus: 8,
                    cap_w: Some(cap),
                    power_w: Some(power),
                    throughput: Some(t),
                    throughput_unit: Some(crate::usage::ThroughputUnit::Tokens),
                    pfi: Some(t / 1e6),
                    pfi_source: Some(crate::status::PfiSource::Measured),
                    points: vec![from_array([cap, power, t])],
                    gpu_uuids: Vec::new(),
                    power_cap_w: Some(cap),
                    power_cap_steady_s: Some(t / 1e3),
                    calibrating: t > 5e5,
                    curve_in_question: t > 7e5,
                    curve: Vec::new(),
                    calibration_cost_pct: None,
                    owner_uid: Some(1000),
                    usage: None,
                }],
                power_w: power * 0.97,
                failsafe: false,
                cap_mismatches: 0,
                ended: Vec::new(),
                observe_only: false,
            };
            let line = agent.seal(&body, NOW).expect("seal");
            prop_assert_eq!(ctld.open(&line, NOW), Ok(body));
        });
    }

    /// The fuzz seeds `v2_*` were made by an independent implementation (Python's hmac
    /// and hashlib, HKDF written from RFC 5869): the derivations and the framing here
    /// must agree with it byte for byte.
    #[test]
    fn frames_made_by_another_implementation_open() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/controller_link");
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).expect(name);
        const SITE: &[u8] = b"fuzzing site key";
        const AT: u64 = 1_800_000_000_000;
        let key = node_key(SITE, "n1").expect("key");
        let (hs, open) = AgentHandshake::start(&key, "n1", [1; 16], AT).expect("open");
        assert_eq!(open, read("v2_open"));
        let (mut ctld, challenge) =
            controller_accept(SITE, &read("v2_open"), [2; 16], AT).expect("accept");
        assert_eq!(challenge, read("v2_challenge"));
        let mut agent = hs.finish(&read("v2_challenge"), AT).expect("challenge");
        assert_eq!(
            ctld.open(&read("v2_hello"), AT),
            Ok(Body::Hello { gpus: Vec::new() })
        );
        assert!(matches!(
            ctld.open(&read("v2_report"), AT),
            Ok(Body::Report { .. })
        ));
        assert_eq!(agent.open(&read("v2_lease"), AT), Ok(lease("n1", 450.0)));
    }

    #[test]
    fn arbitrary_lines_never_panic() {
        use proptest::prelude::*;
        let (agent, _) = connect("n1", [1; 16], [2; 16]);
        proptest!(|(line in ".{0,300}")| {
            let mut agent = agent.clone();
            let _ = agent.open(&line, NOW);
            let _ = controller_accept(SITE, &line, [0; 16], NOW);
            let _ = unframe(&format!("pf2 controller n1 1 {NOW} {line}"), MAX_LINK_LINE_BYTES);
        });
    }

    fn gpu(uuid: &str) -> GpuInfo {
        GpuInfo {
            uuid: uuid.into(),
            name: "NVIDIA H200 (simulated)".into(),
            min_w: 200.0,
            max_w: 700.0,
            default_w: 700.0,
        }
    }

    fn job(id: &str, gpus: u32) -> JobReport {
        JobReport {
            job_id: id.into(),
            tier: "flex2".into(),
            gpus,
            cap_w: Some(500.0),
            power_w: Some(480.0 * f64::from(gpus)),
            throughput: Some(1000.0),
            throughput_unit: Some(crate::usage::ThroughputUnit::Tokens),
            pfi: Some(1.4),
            pfi_source: Some(crate::status::PfiSource::Measured),
            points: vec![from_array([700.0, 690.0 * f64::from(gpus), 1100.0])],
            gpu_uuids: Vec::new(),
            power_cap_w: Some(500.0),
            power_cap_steady_s: Some(3.0),
            calibrating: false,
            curve_in_question: false,
            curve: Vec::new(),
            calibration_cost_pct: None,
            owner_uid: None,
            usage: None,
        }
    }

    #[test]
    fn a_lease_carries_its_epoch_and_one_without_reads_as_epoch_0() {
        // A single controller's lease (epoch 0) is what an older controller sends: the
        // field stays off the wire, and an agent reads its absence as 0.
        let plain = lease("n1", 450.0);
        let text = serde_json::to_string(&plain).expect("json");
        assert!(!text.contains("epoch"), "{text}");
        assert!(matches!(
            serde_json::from_str::<Body>(&text).expect("parse"),
            Body::Lease { epoch: 0, .. }
        ));
        let mut led = plain;
        if let Body::Lease { epoch, .. } = &mut led {
            *epoch = 7;
        }
        let (mut agent, mut ctld) = connect("n1", [1; 16], [2; 16]);
        let line = ctld.seal(&led, NOW).expect("seal");
        assert!(line.contains("\"epoch\":7"), "{line}");
        assert_eq!(agent.open(&line, NOW).expect("open"), led);
        // The refusal and the standby answer are typed both ways.
        let fenced = Body::Fenced {
            lease_epoch: 3,
            accepted_epoch: 7,
        };
        let line = agent.seal(&fenced, NOW).expect("seal");
        assert_eq!(ctld.open(&line, NOW).expect("open"), fenced);
        let standby = Body::Standby {
            reason: "standby".into(),
        };
        let line = ctld.seal(&standby, NOW).expect("seal");
        assert_eq!(agent.open(&line, NOW).expect("open"), standby);
        assert_eq!((fenced.kind(), standby.kind()), ("fenced", "standby"));
    }

    #[test]
    fn a_lease_may_announce_the_next_event_and_an_older_one_reads_as_none() {
        let plain = lease("n1", 450.0);
        let text = serde_json::to_string(&plain).expect("json");
        assert!(!text.contains("next_event_in_s"), "{text}");
        let mut announced = plain.clone();
        assert!(!text.contains("walk_to_w"), "{text}");
        if let Body::Lease {
            next_event_in_s,
            walk_to_w,
            ..
        } = &mut announced
        {
            *next_event_in_s = Some(600.0);
            walk_to_w.insert("42".into(), 275.0);
        }
        let (mut agent, mut ctld) = connect("n1", [1; 16], [2; 16]);
        let line = ctld.seal(&announced, NOW).expect("seal");
        assert!(line.contains("\"walk_to_w\":{\"42\":275.0}"), "{line}");
        assert_eq!(agent.open(&line, NOW).expect("open"), announced);
        let back: Body = serde_json::from_str(&text).expect("parse");
        assert!(matches!(
            back,
            Body::Lease {
                next_event_in_s: None,
                ref walk_to_w,
                ..
            } if walk_to_w.is_empty()
        ));
    }

    #[test]
    fn a_report_carries_its_owner_and_one_without_reads_as_unknown() {
        let mut owned = job("7", 1);
        owned.owner_uid = Some(1001);
        let text = serde_json::to_string(&owned).expect("json");
        assert!(text.contains("\"owner_uid\":1001"), "{text}");
        let back: JobReport = serde_json::from_str(&text).expect("parse");
        assert_eq!(back.owner_uid, Some(1001));
        // An agent from before the field: the owner is unknown, not root's or anyone's.
        let old = serde_json::to_string(&job("7", 1)).expect("json");
        assert!(!old.contains("owner_uid"), "{old}");
        let back: JobReport = serde_json::from_str(&old).expect("parse");
        assert_eq!(back.owner_uid, None);
        let wrong = serde_json::from_str::<JobReport>(&text.replace("1001", "\"bob\""));
        assert!(wrong.is_err(), "a uid is a number");
    }

    #[test]
    fn reports_that_cannot_be_true_are_refused_with_the_field_named() {
        let node: Vec<GpuInfo> = (0..4).map(|i| gpu(&format!("GPU-{i}"))).collect();
        assert_eq!(validate_gpus(&node), Ok(()));
        assert_eq!(job("7", 2).validate(&node), Ok(()));
        let refused = |j: JobReport| match j.validate(&node) {
            Err(ProtoError::Invalid { field, .. }) => field,
            other => panic!("expected a refusal, got {other:?}"),
        };
        let mut nan = job("7", 2);
        nan.power_w = Some(f64::NAN);
        assert_eq!(refused(nan), "job 7 power_w");
        let mut negative = job("7", 2);
        negative.power_w = Some(-500.0);
        assert_eq!(refused(negative), "job 7 power_w");
        assert_eq!(refused(job("7", u32::MAX)), "job 7 gpus");
        assert_eq!(refused(job("7", 0)), "job 7 gpus");
        let mut inf = job("7", 2);
        inf.throughput = Some(f64::INFINITY);
        assert_eq!(refused(inf), "job 7 throughput");
        let mut point = job("7", 2);
        point.points.push(from_array([f64::NAN, 1.0, 1.0]));
        assert_eq!(refused(point), "job 7 point cap_w");
        let mut pfi = job("7", 2);
        pfi.pfi = Some(0.0);
        assert_eq!(refused(pfi), "job 7 pfi");
        let mut foreign = job("7", 1);
        foreign.gpu_uuids = vec!["GPU-elsewhere".into()];
        assert_eq!(refused(foreign), "job 7 gpu_uuids");
        assert_eq!(job("../x", 1).validate(&node), Err(ProtoError::BadJobId));
    }

    #[test]
    fn node_totals_are_checked_without_overflow() {
        let node: Vec<GpuInfo> = (0..4).map(|i| gpu(&format!("GPU-{i}"))).collect();
        assert_eq!(
            validate_report_totals(&[job("1", 2), job("2", 2)], 1900.0, &node),
            Ok(())
        );
        // Two jobs whose counts add past u32::MAX, and more GPUs in jobs than the node has.
        assert!(
            validate_report_totals(&[job("1", u32::MAX), job("2", u32::MAX)], 100.0, &node)
                .is_err()
        );
        assert!(validate_report_totals(&[job("1", 3), job("2", 2)], 100.0, &node).is_err());
        assert!(validate_report_totals(&[job("1", 1), job("1", 1)], 100.0, &node).is_err());
        assert!(validate_report_totals(&[], -1.0, &node).is_err());
        assert!(validate_report_totals(&[], f64::NAN, &node).is_err());
        let mut a = job("1", 1);
        a.gpu_uuids = vec!["GPU-0".into()];
        let mut b = job("2", 1);
        b.gpu_uuids = vec!["GPU-0".into()];
        assert!(validate_report_totals(&[a, b], 100.0, &node).is_err());
    }

    #[test]
    fn impossible_gpus_are_refused() {
        let mut bad = gpu("GPU-0");
        bad.min_w = 0.0;
        assert!(bad.validate().is_err());
        let mut bad = gpu("GPU-0");
        bad.max_w = 100.0;
        assert!(bad.validate().is_err());
        let mut bad = gpu("GPU-0");
        bad.default_w = f64::NAN;
        assert!(bad.validate().is_err());
        assert!(validate_gpus(&[gpu("GPU-0"), gpu("GPU-0")]).is_err());
    }

    fn final_share(job: &str) -> crate::usage::NodeUsage {
        crate::usage::NodeUsage {
            job_id: job.into(),
            node: "n1".into(),
            uid: 1000,
            tier: "flex2".into(),
            gpus: vec![],
            energy_mj: 1,
            energy_source: crate::usage::EnergySource::Counter,
            from_unix_ms: 1,
            to_unix_ms: 2,
            peak_power_w: 0.0,
            observed_s: 0.0,
            capped_s: 0.0,
            event_s: 0.0,
            power_throttled_s: 0.0,
            throttle_known_s: 0.0,
            caps: vec![],
            slowdown_pct: None,
            bound_pct: None,
            bound_held: None,
            bound_judgement: None,
            saved_estimate_j: None,
            work: None,
            work_unit: None,
            pfi: None,
            ended: true,
            simulated: false,
        }
    }

    #[test]
    fn final_shares_and_acks_from_a_peer_are_bounded() {
        let many = vec![final_share("7"); MAX_ENDED_PER_REPORT];
        assert!(validate_final_shares(&many).is_ok());
        let too_many = vec![final_share("7"); MAX_ENDED_PER_REPORT + 1];
        let e = validate_final_shares(&too_many).expect_err("too many");
        assert!(e.to_string().contains("at most 16"), "{e}");
        let mut running = final_share("7");
        running.ended = false;
        assert!(validate_final_shares(&[running]).is_err());
        let mut nan = final_share("7");
        nan.event_s = f64::NAN;
        assert!(validate_final_shares(&[nan]).is_err());
        let ack = |job: &str| FinalRef {
            job_id: job.into(),
            from_unix_ms: 5,
        };
        assert!(validate_acks(&vec![ack("7"); MAX_ACKS_PER_MESSAGE]).is_ok());
        assert!(validate_acks(&vec![ack("7"); MAX_ACKS_PER_MESSAGE + 1]).is_err());
        assert_eq!(validate_acks(&[ack("")]), Err(ProtoError::BadJobId));
        // On the wire: typed, and unknown fields refused like every other message.
        let body = Body::Acked {
            finals: vec![ack("7")],
        };
        let text = serde_json::to_string(&body).expect("json");
        assert_eq!(
            text,
            r#"{"type":"acked","finals":[{"job_id":"7","from_unix_ms":5}]}"#
        );
        assert_eq!(serde_json::from_str::<Body>(&text).expect("parse"), body);
        assert!(serde_json::from_str::<Body>(
            r#"{"type":"acked","finals":[{"job_id":"7","from_unix_ms":5,"x":1}]}"#
        )
        .is_err());
        assert!(serde_json::from_str::<Body>(
            r#"{"type":"acked","finals":[{"job_id":"7","from_unix_ms":-5}]}"#
        )
        .is_err());
    }
}
