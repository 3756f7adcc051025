//! Every index decoder on arbitrary payloads; the first bytes choose codec, count and range.
#![no_main]
use libfuzzer_sys::fuzz_target;
use starling_proto::codec::{IndexCodec, index};

fuzz_target!(|data: &[u8]| {
    if data.len() < 6 {
        return;
    }
    let codec = IndexCodec::ALL[data[0] as usize % IndexCodec::ALL.len()];
    let count = u64::from(u16::from_le_bytes([data[1], data[2]]));
    let range = u64::from(u16::from_le_bytes([data[3], data[4]])) << (data[5] % 40);
    if codec == IndexCodec::BitmapZstd && range > 1 << 20 {
        return;
    }
    if let Ok(p) = index::decode(codec, &data[6..], count, range) {
        assert_eq!(p.len() as u64, count);
        assert!(p.windows(2).all(|w| w[0] < w[1]));
        assert!(p.iter().all(|&x| x < range));
    }
});
