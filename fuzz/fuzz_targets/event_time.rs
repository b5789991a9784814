//! `powerflexctl event add --start/--duration/--ramp` values (jiff underneath), with two
//! properties besides "no panic": a time the parser accepts prints (as `event list` and the
//! plot print it) and parses back to the same second, and a duration prints and parses
//! back to the same millisecond.
#![no_main]
use libfuzzer_sys::fuzz_target;
use powerflex_controller_machine::schedule::{
    duration_text, parse_duration_ms, parse_event_duration_ms, parse_start, utc_text, Start,
};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(Start::At { unix_ms }) = parse_start(text) {
        let printed = utc_text(unix_ms);
        if let Some(rfc3339) = printed
            .strip_suffix(" UTC")
            .map(|t| format!("{}Z", t.replacen(' ', "T", 1)))
        {
            assert_eq!(
                parse_start(&rfc3339),
                Ok(Start::At {
                    unix_ms: unix_ms - unix_ms % 1000
                }),
                "{text:?} printed as {printed:?}"
            );
        }
    }
    if let Ok(ms) = parse_duration_ms(text) {
        let printed = duration_text(ms);
        assert_eq!(parse_duration_ms(&printed), Ok(ms), "{text:?} printed as {printed:?}");
        assert_eq!(parse_event_duration_ms(text).is_ok(), ms > 0);
    }
});
