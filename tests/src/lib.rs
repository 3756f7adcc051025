//! End-to-end tests live in `tests/tests/`; they run the real `starling-hub` binary.
