#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    lockstep_kv::fuzzing::parse_all(data);
});
