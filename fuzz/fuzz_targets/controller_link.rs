//! Messages on the agent<->controller link: every line a peer could send is opened
//! (MAC, sequence, staleness) without a panic; whatever opens re-seals to the same MAC
//! (the controller verifies re-serialised envelopes); and a message sealed from any
//! sender name and body the fuzzer makes opens again, unless it is over the link's size
//! limit, which `open` refuses as too long.
#![no_main]
use libfuzzer_sys::fuzz_target;
use powerflex_proto::link::{Body, Envelope, LinkError, MAX_LINK_LINE_BYTES};
use powerflex_proto::ProtoError;

const KEY: &[u8] = b"fuzzing key";
const NOW_MS: u64 = 1_800_000_000_000;

fuzz_target!(|data: &[u8]| {
    let line = String::from_utf8_lossy(data);
    let _ = Envelope::open(KEY, &line, u64::MAX, NOW_MS);
    let _ = Envelope::open(b"", &line, 0, 0);
    if let Ok(opened) = Envelope::open(KEY, &line, 0, NOW_MS) {
        let resealed = Envelope::seal(
            KEY,
            &opened.from,
            opened.seq,
            opened.ts_ms,
            opened.body.clone(),
        )
        .expect("reseal");
        assert_eq!(resealed.mac, opened.mac);
    }
    // A body from the input (when it is one), sealed and opened again.
    let body = serde_json::from_str::<Body>(&line).unwrap_or(Body::Hello { gpus: Vec::new() });
    // Sealing does not bound the size (the sender's name is the whole input here), so a
    // line over the link's limit is refused as too long, and any other opens again.
    if let Ok(sealed) = Envelope::seal(KEY, &line, 7, NOW_MS, body) {
        let sealed_line = sealed.to_line();
        match Envelope::open(KEY, &sealed_line, 6, NOW_MS) {
            Ok(_) => {}
            Err(LinkError::Proto(ProtoError::TooLong(len)))
                if sealed_line.len() > MAX_LINK_LINE_BYTES && len == sealed_line.len() => {}
            Err(e) => panic!("a sealed message of {} bytes does not open: {e}", sealed_line.len()),
        }
    }
});
