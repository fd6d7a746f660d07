//! A Python cell's rich outputs, as the session's driver (`python::SETUP`) reports them
//! through the door: the last expression's bundle (and its JSON value), every `display`,
//! the exception that ended the cell, and that matplotlib's `pyplot` was imported (its open
//! figures are then collected after each cell). The frames come from guest code, which can
//! forge any of them: each is parsed, checked and counted against the call's output cap.

use sandbox_core::cell::{Collector, FrameKind};

/// Frame prefixes (a NUL first: never the start of a tool request, which is JSON).
pub(crate) const RESULT: &[u8] = b"\0agent-sandbox/result\0";
pub(crate) const DISPLAY: &[u8] = b"\0agent-sandbox/display\0";
pub(crate) const ERROR: &[u8] = b"\0agent-sandbox/error\0";
pub(crate) const PYPLOT: &[u8] = b"\0agent-sandbox/pyplot\0";
pub(crate) const FIGURE: &[u8] = b"\0agent-sandbox/figure\0";
pub(crate) const WATCH: &[u8] = b"\0agent-sandbox/watch\0";
/// The longest prefix, which is all the door reads before it knows a frame's kind.
pub(crate) const PREFIX_MAX: usize = 24;
/// Frame bytes one call may have read beyond twice its cap (malformed and dropped frames
/// count too, so a cell cannot make the host parse without end).
const READ_SLACK: u64 = 64 << 10;

/// What the door does with a frame that starts with one of our prefixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Frame {
    /// An output or error, for the [`Collector`].
    Cell(FrameKind),
    /// `matplotlib.pyplot` is being imported.
    Pyplot,
    /// A figure was made (the driver's watch on matplotlib's figure managers).
    Figure,
    /// That watch is in place: cells that make no figure need no flush.
    Watch,
}

impl Frame {
    /// The kind of a frame that starts with `head` (at least the prefix's bytes).
    pub(crate) fn of(head: &[u8]) -> Option<(Frame, usize)> {
        [
            (RESULT, Frame::Cell(FrameKind::Result)),
            (DISPLAY, Frame::Cell(FrameKind::Display)),
            (ERROR, Frame::Cell(FrameKind::Error)),
            (PYPLOT, Frame::Pyplot),
            (FIGURE, Frame::Figure),
            (WATCH, Frame::Watch),
        ]
        .into_iter()
        .find(|(p, _)| head.starts_with(p))
        .map(|(p, f)| (f, p.len()))
    }
}

/// One call's outputs, and the session's pyplot flags.
#[derive(Debug, Default)]
pub(crate) struct CellSink {
    /// This call's outputs and error.
    pub(crate) collector: Collector,
    /// Frame bytes read from guest memory this call.
    read: u64,
    cap: u64,
    /// `matplotlib.pyplot` was imported in this interpreter (kept across calls).
    pub(crate) pyplot: bool,
    /// The driver watches figures being made (kept across calls).
    pub(crate) watching: bool,
    /// A figure was made during this call.
    pub(crate) figure: bool,
}

impl CellSink {
    /// Starts a call whose outputs may take `cap` bytes.
    pub(crate) fn begin(&mut self, cap: u64) {
        self.collector = Collector::new(cap);
        self.read = 0;
        self.figure = false;
        self.cap = cap;
    }

    /// Whether a frame was dropped for the cap this call.
    pub(crate) fn truncated(&self) -> bool {
        self.collector.truncated()
    }

    /// How many bytes of a frame of `len` to read: the whole frame when it fits what is
    /// left of the cap (and of the call's read budget), else none (the call is marked
    /// truncated). A pyplot frame's body is never read.
    pub(crate) fn admits(&mut self, frame: Frame, len: usize) -> Option<usize> {
        let Frame::Cell(kind) = frame else {
            return Some(0);
        };
        let len64 = len as u64;
        let budget = self
            .cap
            .saturating_mul(2)
            .saturating_add(READ_SLACK)
            .saturating_sub(self.read);
        if len64 > budget {
            self.collector.mark_truncated();
            return None;
        }
        if !self.collector.room(kind, len) {
            return None;
        }
        self.read = self.read.saturating_add(len64);
        Some(len)
    }

    /// Takes one frame's body (the prefix removed). Malformed frames are ignored.
    pub(crate) fn take(&mut self, frame: Frame, body: &[u8]) {
        match frame {
            Frame::Pyplot => self.pyplot = true,
            Frame::Figure => self.figure = true,
            Frame::Watch => self.watching = true,
            Frame::Cell(kind) => {
                self.collector.take(kind, body);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sink(cap: u64) -> CellSink {
        let mut s = CellSink::default();
        s.begin(cap);
        s
    }

    #[test]
    fn frames_are_recognised_by_prefix() {
        assert_eq!(
            Frame::of(b"\0agent-sandbox/result\0{}"),
            Some((Frame::Cell(FrameKind::Result), 22))
        );
        assert_eq!(
            Frame::of(b"\0agent-sandbox/pyplot\0"),
            Some((Frame::Pyplot, 22))
        );
        assert_eq!(Frame::of(b"{\"v\":1}"), None);
        assert!([RESULT, DISPLAY, ERROR, PYPLOT, FIGURE, WATCH]
            .iter()
            .all(|p| p.len() <= PREFIX_MAX));
    }

    #[test]
    fn the_cap_and_the_read_budget_hold() {
        let display = Frame::Cell(FrameKind::Display);
        let mut s = sink(100);
        assert_eq!(s.admits(display, 101), None);
        assert!(s.truncated());
        assert_eq!(s.admits(Frame::Pyplot, 1 << 30), Some(0), "never read");
        // Frames that keep nothing still spend the call's read budget.
        let mut s = sink(1000);
        let mut read = 0;
        while s.admits(display, 500).is_some() {
            s.take(display, b"not json");
            read += 500;
        }
        let budget = 2000 + READ_SLACK as usize;
        assert!(read <= budget && read + 500 > budget, "{read}");
        assert!(s.truncated());
    }
}
