//! Segment bodies and every part decoder they reach, against a fixed base.
#![no_main]
use libfuzzer_sys::fuzz_target;
use starling_proto::segment::Segment;

fuzz_target!(|data: &[u8]| {
    if let Ok(seg) = Segment::decode_body(data) {
        for p in &seg.parts {
            if p.len <= 1 << 16 {
                let base = vec![0x3F80u16; p.len as usize];
                let _ = p.decode(Some(&base));
            }
        }
    }
});
