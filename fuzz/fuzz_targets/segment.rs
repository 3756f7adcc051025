//! Segment bodies and every part decoder they reach, against a fixed base.
#![no_main]
use libfuzzer_sys::fuzz_target;
use starling_proto::delta::segment::Segment;

fuzz_target!(|data: &[u8]| {
    if let Ok(seg) = Segment::decode_body(data) {
        for p in &seg.parts {
            if p.len <= 1 << 16 {
                // Weight-like values over several exponents, for the base-conditioned codecs.
                let base: Vec<u16> = (0..p.len)
                    .map(|i| 0x3C00 | ((i as u16).wrapping_mul(0x9E37) & 0x83FF))
                    .collect();
                let _ = p.decode(Some(&base));
            }
        }
    }
});
