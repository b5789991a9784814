//! Frames on the agent<->controller link (v2): every line a peer could send goes through
//! the controller's handshake and an established session on both sides without a panic;
//! whatever opens was sealed under the key it is checked with; and any body the fuzzer
//! makes, sealed by one side of a session, opens on the other exactly (nothing is
//! re-serialised), unless it is over the link's size limit, which `seal` refuses.
#![no_main]
use libfuzzer_sys::fuzz_target;
use powerflex_proto::link::{
    controller_accept, node_key, unframe, AgentHandshake, Body, LinkError, MAX_LINK_LINE_BYTES,
};

const SITE_KEY: &[u8] = b"fuzzing site key";
const NOW_MS: u64 = 1_800_000_000_000;

fuzz_target!(|data: &[u8]| {
    let line = String::from_utf8_lossy(data);
    // The controller's first look at an unauthenticated peer.
    let _ = controller_accept(SITE_KEY, &line, [3; 16], NOW_MS);
    let _ = unframe(&line, MAX_LINK_LINE_BYTES);
    // A real session, then the input on both sides of it.
    let key = node_key(SITE_KEY, "n1").expect("node key");
    let (hs, open) = AgentHandshake::start(&key, "n1", [1; 16], NOW_MS).expect("open");
    let (mut ctld, challenge) =
        controller_accept(SITE_KEY, &open, [2; 16], NOW_MS).expect("accept");
    let mut agent = hs.clone().finish(&challenge, NOW_MS).expect("challenge");
    let _ = hs.finish(&line, NOW_MS);
    let _ = ctld.clone().open(&line, NOW_MS);
    let _ = agent.clone().open(&line, NOW_MS);
    // A body from the input (when it is one), sealed by the agent and opened by the
    // controller: the same body, or a refusal to seal it as too large.
    let body = serde_json::from_str::<Body>(&line).unwrap_or(Body::Hello { gpus: Vec::new() });
    match agent.seal(&body, NOW_MS) {
        Ok(sealed) => assert_eq!(ctld.open(&sealed, NOW_MS).as_ref(), Ok(&body)),
        Err(LinkError::TooLarge { bytes, limit_bytes }) => {
            assert!(bytes > limit_bytes && limit_bytes == MAX_LINK_LINE_BYTES)
        }
        Err(e) => panic!("a body does not seal: {e}"),
    }
});
