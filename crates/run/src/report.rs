//! What the monitor tells the user and the injector: events, queued while a stop is handled
//! and written after it (logging never delays the replicas, for example while a fault is
//! masked), and the count of detections among them.

use lockstep_core::{Event, EventSink};

pub struct Report {
    sink: EventSink,
    queued: Vec<Event>,
    /// Divergences, timeouts and halts so far: what `lockstep inject --replica` counts as
    /// a detection even when TMR masked the fault.
    detections: u64,
}

impl Report {
    pub fn new(sink: EventSink) -> Report {
        Report {
            sink,
            queued: Vec::new(),
            detections: 0,
        }
    }

    /// Queues `event`; returns its place in the queue, valid until the next flush.
    pub fn emit(&mut self, event: Event) -> usize {
        if matches!(event.kind, "divergence" | "timeout" | "halt") {
            self.detections += 1;
        }
        self.queued.push(event);
        self.queued.len() - 1
    }

    /// Completes the queued event at `index` (see [`Report::emit`]).
    pub fn amend(&mut self, index: usize, complete: impl FnOnce(&mut Event)) {
        complete(&mut self.queued[index]);
    }

    /// Writes the queued events.
    pub fn flush(&mut self) {
        for event in self.queued.drain(..) {
            self.sink.emit(event);
        }
    }

    pub fn detections(&self) -> u64 {
        self.detections
    }
}
