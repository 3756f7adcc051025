//! Every index decoder on arbitrary payloads; the first bytes choose codec, count and range.
//! Decoders that need the base (the exponent-class mask) get a base of weight-like values
//! whose exponents the next byte spreads or concentrates.
#![no_main]
use libfuzzer_sys::fuzz_target;
use starling_proto::delta::codec::{IndexCodec, index};

fuzz_target!(|data: &[u8]| {
    if data.len() < 7 {
        return;
    }
    let codec = IndexCodec::ALL[data[0] as usize % IndexCodec::ALL.len()];
    let count = u64::from(u16::from_le_bytes([data[1], data[2]]));
    let range = u64::from(u16::from_le_bytes([data[3], data[4]])) << (data[5] % 40);
    if (codec == IndexCodec::BitmapZstd || codec.needs_base()) && range > 1 << 20 {
        return;
    }
    let spread = u64::from(data[6] % 32) + 1;
    let base: Vec<u16> = if codec.needs_base() {
        (0..range)
            .map(|i| {
                let h = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                let e = 100 + (h % spread) as u16;
                ((h >> 8) as u16 & 0x8000) | (e << 7) | ((h >> 16) as u16 & 0x7F)
            })
            .collect()
    } else {
        Vec::new()
    };
    if let Ok(p) = index::decode(codec, &data[7..], count, range, Some(&base)) {
        assert_eq!(p.len() as u64, count);
        assert!(p.windows(2).all(|w| w[0] < w[1]));
        assert!(p.iter().all(|&x| x < range));
    }
});
