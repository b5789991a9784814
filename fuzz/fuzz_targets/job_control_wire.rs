//! Lines on the agent's sockets: job-control requests and replies, progress reports.
#![no_main]
use libfuzzer_sys::fuzz_target;
use powerflex_proto::{ControlReply, ControlRequest, ProgressReport};

fuzz_target!(|data: &[u8]| {
    let line = String::from_utf8_lossy(data);
    if let Ok(request) = ControlRequest::from_line(&line) {
        // What parses, serialises and parses back the same.
        let again = ControlRequest::from_line(&request.to_line()).expect("round trip");
        assert_eq!(again, request);
    }
    let _ = ControlReply::from_line(&line);
    let _ = ProgressReport::from_line(&line);
});
