//! Every value and dense decoder on arbitrary payloads, against a base whose exponents and
//! signs vary (so the context-modelled codecs visit many contexts).
#![no_main]
use libfuzzer_sys::fuzz_target;
use starling_proto::delta::codec::{DenseCodec, ValueCodec, dense, value};

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    let count = usize::from(u16::from_le_bytes([data[1], data[2]]));
    let base: Vec<u16> = (0..count)
        .map(|i| (i as u16).wrapping_mul(0x9E37).rotate_left(3))
        .collect();
    let payload = &data[3..];
    if data[0] & 1 == 0 {
        let codec = ValueCodec::ALL[(data[0] >> 1) as usize % ValueCodec::ALL.len()];
        if let Ok(v) = value::decode(codec, payload, count, Some(&base)) {
            assert_eq!(v.len(), count);
        }
    } else {
        let codec = DenseCodec::ALL[(data[0] >> 1) as usize % DenseCodec::ALL.len()];
        if let Ok(v) = dense::decode(codec, payload, count, Some(&base)) {
            assert_eq!(v.len(), count);
        }
    }
});
