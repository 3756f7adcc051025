//! The whole container reader: arbitrary bytes must give a delta or an error, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use starling_proto::delta::container::read_delta;
use starling_proto::delta::manifest::TrustPolicy;

fuzz_target!(|data: &[u8]| {
    let _ = read_delta(data, &TrustPolicy::AnySigner);
});
