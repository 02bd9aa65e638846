//! Entry points shared by the fuzz targets (`crates/kv/fuzz`) and the stable replay of
//! their corpora: whatever the bytes, these must return without panicking.

use crate::command::Command;
use crate::protocol::{parse, Parsed};
use crate::store::{Limits, Store};
use lockstep_guard::Unpacker;

/// Parse a client byte stream request by request, as a connection does.
pub fn parse_all(data: &[u8]) {
    let mut at = 0;
    while at < data.len() {
        match parse(&data[at..], 4096) {
            Parsed::Incomplete => break,
            Parsed::Request { consumed, .. } | Parsed::Error { consumed, .. } => {
                assert!(
                    consumed > 0 && consumed <= data.len() - at,
                    "the parser must make progress"
                );
                at += consumed;
            }
        }
    }
}

/// Decode untrusted bytes as a command, and restore them as a snapshot and apply the
/// command to the result.
pub fn decode_all(data: &[u8]) {
    let cmd = Command::decode(&mut Unpacker::new(data));
    let limits = Limits {
        buckets: 16,
        memory_bytes: 1 << 20,
        item_max: 4096,
    };
    if let Ok(mut store) = Store::restore(limits, data) {
        if let Ok(cmd) = cmd {
            let mut delta = lockstep_guard::Delta::new();
            store.apply(&cmd, 1, &mut delta);
        }
        let _ = store.digest();
        let _ = store.snapshot();
    }
}

#[cfg(test)]
mod tests {
    /// Replays every saved fuzz input (the regression corpus) through both entry points.
    #[test]
    fn fuzz_corpora_replay() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz")
            .join("corpus");
        let mut n = 0;
        for (target, f) in [
            ("protocol", super::parse_all as fn(&[u8])),
            ("decode", super::decode_all),
        ] {
            let dir = root.join(target);
            let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()));
            for e in entries.flatten() {
                f(&std::fs::read(e.path()).unwrap());
                n += 1;
            }
        }
        assert!(n > 0, "no corpus under {}", root.display());
    }
}
