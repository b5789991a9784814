//! The controller's admin socket lines and the CLI's time, power and cut arguments.
#![no_main]
use libfuzzer_sys::fuzz_target;
use powerflex_controller_machine::schedule::{parse_duration_ms, parse_reduce, parse_start_ms};
use powerflex_core::Watts;
use powerflex_proto::admin::AdminRequest;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = AdminRequest::from_line(text);
    let _ = parse_duration_ms(text);
    let _ = parse_reduce(text);
    let _ = parse_start_ms(text, 1_800_000_000_000);
    let _ = Watts::parse(text);
    let _ = powerflex_core::gpus::parse_gpu_list(text);
});
