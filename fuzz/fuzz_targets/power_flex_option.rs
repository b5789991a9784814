//! `--power-flex=VALUE` as users type it: never a panic, and whatever parses prints back
//! (canonical form) to a value that parses to the same request.
#![no_main]
use libfuzzer_sys::fuzz_target;
use powerflex_core::flex::{parse_power_flex, TierTable};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let table = TierTable::default_table();
    if let Ok(request) = parse_power_flex(text, &table) {
        let canonical = request.to_string();
        let again = parse_power_flex(&canonical, &table)
            .unwrap_or_else(|e| panic!("{text:?} -> {canonical:?} does not parse: {e}"));
        assert_eq!(again, request, "{text:?} -> {canonical:?}");
    }
});
