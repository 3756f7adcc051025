//! The UDP link emulator (being built).
