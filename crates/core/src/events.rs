//! The event contract: every detection, vote, mask, repair, re-integration, timeout and
//! halt is one JSON line (when `--events FILE` is given) and one human line on stderr.

use serde::Serialize;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

/// One event. Fields that do not apply are omitted from the JSON.
#[derive(Clone, Debug, Serialize)]
pub struct Event {
    /// Seconds since the Unix epoch, with microsecond precision.
    pub ts: f64,
    /// "run", "inject", "sei", "kv" or "fs".
    pub component: &'static str,
    /// What happened: "divergence", "vote", "mask", "reintegrate", "timeout", "halt", ...
    pub kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica: Option<u32>,
    /// What was compared or acted on, e.g. "write(fd=1)" or an object id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub object: Option<String>,
    /// The values that were compared, per replica, as strings.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<String>,
    /// What lockstep did about it: "continue", "kill", "halt", "fork", ...
    pub action: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_us: Option<u64>,
    /// One human sentence.
    pub message: String,
}

impl Event {
    pub fn new(component: &'static str, kind: &'static str, action: &'static str) -> Self {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        Event {
            ts,
            component,
            kind,
            replica: None,
            object: None,
            values: Vec::new(),
            action,
            duration_us: None,
            message: String::new(),
        }
    }
    pub fn replica(mut self, r: u32) -> Self {
        self.replica = Some(r);
        self
    }
    pub fn object(mut self, o: impl Into<String>) -> Self {
        self.object = Some(o.into());
        self
    }
    pub fn values(mut self, v: Vec<String>) -> Self {
        self.values = v;
        self
    }
    pub fn duration_us(mut self, us: u64) -> Self {
        self.duration_us = Some(us);
        self
    }
    pub fn message(mut self, m: impl Into<String>) -> Self {
        self.message = m.into();
        self
    }

    /// The stderr form: `lockstep run: [kind] message`.
    pub fn human_line(&self) -> String {
        let mut line = format!("lockstep {}: [{}] {}", self.component, self.kind, self.message);
        if let Some(us) = self.duration_us {
            line.push_str(&format!(" ({us} µs)"));
        }
        line
    }
}

/// Where events go. Writing an event never fails the caller: a broken events file is
/// reported once on stderr and then ignored, because losing a log line must not stop
/// the protected program.
pub struct EventSink {
    file: Option<BufWriter<File>>,
    stderr: bool,
    count: u64,
}

impl EventSink {
    /// `path`: the JSONL file (truncated). `stderr`: print human lines.
    pub fn new(path: Option<&Path>, stderr: bool) -> std::io::Result<Self> {
        let file = match path {
            Some(p) => Some(BufWriter::new(File::create(p)?)),
            None => None,
        };
        Ok(EventSink { file, stderr, count: 0 })
    }

    /// Like `new`, but appends to an existing file (a restarted process keeps the history).
    pub fn append(path: Option<&Path>, stderr: bool) -> std::io::Result<Self> {
        let file = match path {
            Some(p) => Some(BufWriter::new(
                std::fs::OpenOptions::new().create(true).append(true).open(p)?,
            )),
            None => None,
        };
        Ok(EventSink { file, stderr, count: 0 })
    }

    /// A sink that only prints to stderr.
    pub fn stderr_only() -> Self {
        EventSink {
            file: None,
            stderr: true,
            count: 0,
        }
    }

    pub fn emit(&mut self, event: Event) {
        self.count += 1;
        if self.stderr {
            eprintln!("{}", event.human_line());
        }
        if let Some(f) = self.file.as_mut() {
            let ok = serde_json::to_writer(&mut *f, &event).is_ok() && f.write_all(b"\n").is_ok() && f.flush().is_ok();
            if !ok {
                eprintln!("lockstep: cannot write the events file; further events go to stderr only");
                self.file = None;
            }
        }
    }

    /// Number of events emitted so far.
    pub fn count(&self) -> u64 {
        self.count
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonl_roundtrip() {
        let dir = std::env::temp_dir().join(format!("lockstep-events-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("e.jsonl");
        let mut sink = EventSink::new(Some(&path), false).unwrap();
        sink.emit(
            Event::new("run", "vote", "kill")
                .replica(2)
                .object("write(fd=1)")
                .values(vec!["a".into(), "b".into()])
                .duration_us(5)
                .message("m"),
        );
        sink.emit(Event::new("run", "halt", "halt").message("x"));
        drop(sink);
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["kind"], "vote");
        assert_eq!(lines[0]["replica"], 2);
        assert_eq!(lines[0]["duration_us"], 5);
        assert!(lines[0]["ts"].as_f64().unwrap() > 1.0e9);
        assert!(lines[1].get("replica").is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
