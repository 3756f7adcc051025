//! Control messages: arbitrary bytes give a message or an error; a parsed message re-encodes
//! to something that parses to the same message. Rollout payloads (`Jobs`, `Submit`) that
//! decode keep their invariants (`validate`), and compare bit for bit (log-probabilities
//! included, NaN payloads too: `Sample` compares floats by bits).
#![no_main]
use libfuzzer_sys::fuzz_target;
use starling_proto::protocol::msg::{Message, check};

fuzz_target!(|data: &[u8]| {
    let _ = check(data);
    if let Ok((m, n)) = Message::decode(data) {
        assert!(n <= data.len());
        match &m {
            Message::Jobs { jobs } => assert!(jobs.iter().all(|j| j.validate().is_ok())),
            Message::Submit { results } => assert!(results.iter().all(|r| r.validate().is_ok())),
            _ => {}
        }
        let mut again = Vec::new();
        m.encode(&mut again);
        assert_eq!(again.len(), m.encoded_len());
        assert_eq!(Message::decode(&again).map(|x| x.0), Ok(m));
    }
});
