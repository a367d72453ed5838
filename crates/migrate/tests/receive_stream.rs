//! The receiver's state machine into plain memory, fed a recorded stream
//! (the receiver fuzz target's seed): it must get all the way to COMMIT,
//! and any truncation of it must fail cleanly, never land a VM.

use tsubame_migrate::destination::{receive_stream, MemoryLanding, ReceiveOptions};

const RECORDED: &[u8] = include_bytes!("../../../fuzz/corpus/receiver/migration-8M-idle-codecs");

fn land(stream: &[u8]) -> (Result<u32, String>, MemoryLanding) {
    let mut landing = MemoryLanding { max_bytes: 32 << 20, memory: None, started: false };
    let mut input = stream;
    let result = receive_stream(&mut input, &mut Vec::new(), &mut landing, &ReceiveOptions::default())
        .map_err(|e| e.to_string());
    (result, landing)
}

#[test]
fn recorded_stream_lands_and_commits() {
    let (result, landing) = land(RECORDED);
    assert!(result.is_ok(), "{result:?}");
    assert!(landing.started);
    assert_eq!(landing.memory.map(|m| tsubame_vmm::memory::page_count(&m)), Some(2048));
}

#[test]
fn truncated_streams_never_commit() {
    for cut in (0..RECORDED.len() - 1).step_by(997) {
        let (result, landing) = land(&RECORDED[..cut]);
        assert!(result.is_err() && !landing.started, "cut at {cut}");
    }
}

#[test]
fn memory_above_the_cap_is_refused() {
    let mut landing = MemoryLanding { max_bytes: 4 << 20, memory: None, started: false };
    let mut input = RECORDED;
    let err = receive_stream(&mut input, &mut Vec::new(), &mut landing, &ReceiveOptions::default()).unwrap_err();
    assert!(err.to_string().contains("exceed"), "{err}");
}
