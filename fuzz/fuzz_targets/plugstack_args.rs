//! The SPANK plugin's plugstack.conf arguments (whitespace-separated words).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let words: Vec<String> = text.split_whitespace().map(str::to_string).collect();
    let _ = power_flex::logic::parse_args(&words);
});
