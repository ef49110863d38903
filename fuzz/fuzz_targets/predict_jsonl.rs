//! One input line of `recsys predict`: any bytes must parse or be refused with a message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use recsys_cli::jsonl::{parse_line, MAX_LINE_BYTES};

fuzz_target!(|data: &[u8]| {
    if data.len() > MAX_LINE_BYTES {
        return;
    }
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = parse_line(text);
    }
});
