//! Control messages: arbitrary bytes give a message or an error; a parsed message re-encodes
//! to something that parses to the same message.
#![no_main]
use libfuzzer_sys::fuzz_target;
use starling_proto::msg::{Message, check};

fuzz_target!(|data: &[u8]| {
    let _ = check(data);
    if let Ok((m, n)) = Message::decode(data) {
        assert!(n <= data.len());
        let mut again = Vec::new();
        m.encode(&mut again);
        assert_eq!(again.len(), m.encoded_len());
        assert_eq!(Message::decode(&again).map(|x| x.0), Ok(m));
    }
});
