//! A Python cell's rich outputs, as the session's driver (`python::SETUP`) reports them
//! through the door: the last expression's bundle (and its JSON value), every `display`,
//! the exception that ended the cell, and that matplotlib's `pyplot` was imported (its open
//! figures are then collected after each cell). The frames come from guest code, which can
//! forge any of them: each is parsed, checked and counted against the call's output cap.

use std::collections::BTreeMap;

use sandbox_core::cell::{mime, CellError, Output, OutputKind};
use serde::Deserialize;
use serde_json::value::RawValue;

/// Frame prefixes (a NUL first: never the start of a tool request, which is JSON).
pub(crate) const RESULT: &[u8] = b"\0agent-sandbox/result\0";
pub(crate) const DISPLAY: &[u8] = b"\0agent-sandbox/display\0";
pub(crate) const ERROR: &[u8] = b"\0agent-sandbox/error\0";
pub(crate) const PYPLOT: &[u8] = b"\0agent-sandbox/pyplot\0";
pub(crate) const FIGURE: &[u8] = b"\0agent-sandbox/figure\0";
pub(crate) const WATCH: &[u8] = b"\0agent-sandbox/watch\0";
/// The longest prefix, which is all the door reads before it knows a frame's kind.
pub(crate) const PREFIX_MAX: usize = 24;
/// Representations one bundle may carry.
const MAX_MIMES: usize = 16;
/// Outputs one cell may produce (each also counts against the byte cap).
pub(crate) const MAX_OUTPUTS: usize = 256;
/// Traceback lines kept.
const MAX_TRACEBACK: usize = 512;
/// The largest error frame read, whatever the cap (the driver sends far less).
const MAX_ERROR_FRAME: usize = 256 << 10;
/// Frame bytes one call may have read beyond twice its cap (malformed and dropped frames
/// count too, so a cell cannot make the host parse without end).
const READ_SLACK: u64 = 64 << 10;

/// What the door does with a frame that starts with one of our prefixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Frame {
    Result,
    Display,
    Error,
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
            (RESULT, Frame::Result),
            (DISPLAY, Frame::Display),
            (ERROR, Frame::Error),
            (PYPLOT, Frame::Pyplot),
            (FIGURE, Frame::Figure),
            (WATCH, Frame::Watch),
        ]
        .into_iter()
        .find(|(p, _)| head.starts_with(p))
        .map(|(p, f)| (f, p.len()))
    }
}

/// One call's outputs, and the session's pyplot flag.
#[derive(Debug, Default)]
pub(crate) struct CellSink {
    pub(crate) outputs: Vec<Output>,
    pub(crate) error: Option<CellError>,
    /// The JSON value of the last expression (what `ExecResult::value` reports).
    pub(crate) value: Option<String>,
    /// Some output was dropped for the cap.
    pub(crate) truncated: bool,
    /// Bytes of outputs and error kept.
    bytes: u64,
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

#[derive(Deserialize)]
struct BundleFrame {
    /// The value as JSON text (Python's `json.dumps` of it, or of its `repr`).
    #[serde(default)]
    value: Option<String>,
    /// Kept as the frame's own text: parsed into a tree, a frame's numbers and arrays would
    /// take many times their size in host memory.
    data: BTreeMap<String, Box<RawValue>>,
}

#[derive(Deserialize)]
struct ErrorFrame {
    name: String,
    value: String,
    #[serde(default)]
    traceback: Vec<String>,
}

impl CellSink {
    /// Starts a call whose outputs may take `cap` bytes.
    pub(crate) fn begin(&mut self, cap: u64) {
        self.outputs.clear();
        self.error = None;
        self.value = None;
        self.truncated = false;
        self.bytes = 0;
        self.read = 0;
        self.figure = false;
        self.cap = cap;
    }

    /// How many bytes of a frame of `len` to read: the whole frame when it fits what is
    /// left of the cap (and of the call's read budget), else none (the call is marked
    /// truncated). A pyplot frame's body is never read.
    pub(crate) fn admits(&mut self, frame: Frame, len: usize) -> Option<usize> {
        if matches!(frame, Frame::Pyplot | Frame::Figure | Frame::Watch) {
            return Some(0);
        }
        let len64 = len as u64;
        let left = self.cap.saturating_sub(self.bytes);
        let budget = self
            .cap
            .saturating_mul(2)
            .saturating_add(READ_SLACK)
            .saturating_sub(self.read);
        let fits = len64 <= left
            && len64 <= budget
            && match frame {
                Frame::Error => len <= MAX_ERROR_FRAME,
                _ => self.outputs.len() < MAX_OUTPUTS,
            };
        if !fits {
            self.truncated = true;
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
            Frame::Error => {
                if let Ok(e) = serde_json::from_slice::<ErrorFrame>(body) {
                    let mut tb = e.traceback;
                    tb.truncate(MAX_TRACEBACK);
                    let size =
                        e.name.len() + e.value.len() + tb.iter().map(String::len).sum::<usize>();
                    let old = self.error.as_ref().map_or(0, |o| {
                        o.name.len()
                            + o.value.len()
                            + o.traceback.iter().map(String::len).sum::<usize>()
                    });
                    let bytes = self.bytes.saturating_sub(old as u64);
                    if bytes.saturating_add(size as u64) > self.cap {
                        self.truncated = true;
                        return;
                    }
                    self.bytes = bytes + size as u64;
                    self.error = Some(CellError::new(e.name, e.value, tb));
                }
            }
            Frame::Result | Frame::Display => {
                let Ok(b) = serde_json::from_slice::<BundleFrame>(body) else {
                    return;
                };
                let Some(data) = bundle(b.data) else {
                    return;
                };
                let kind = if frame == Frame::Result {
                    // One result a cell: a later one replaces the earlier.
                    if let Some(i) = self
                        .outputs
                        .iter()
                        .position(|o| o.kind == OutputKind::ExecuteResult)
                    {
                        let old = self.outputs.remove(i);
                        self.bytes = self.bytes.saturating_sub(old.size() as u64);
                    }
                    self.value = b
                        .value
                        .filter(|v| serde_json::from_str::<serde::de::IgnoredAny>(v).is_ok());
                    OutputKind::ExecuteResult
                } else {
                    OutputKind::DisplayData
                };
                let out = Output::new(kind, data);
                let size = out.size() as u64;
                if self.bytes.saturating_add(size) > self.cap {
                    self.truncated = true;
                    return;
                }
                self.bytes += size;
                self.outputs.push(out);
            }
        }
    }
}

/// A bundle's representations, checked: MIME-shaped keys, string values (base64 for the
/// binary types; JSON text for `application/json`), `text/plain` present; `None` when
/// unusable.
fn bundle(raw: BTreeMap<String, Box<RawValue>>) -> Option<BTreeMap<String, String>> {
    if raw.len() > MAX_MIMES {
        return None;
    }
    let mut data = BTreeMap::new();
    for (k, v) in raw {
        if !is_mime(&k) {
            continue;
        }
        let text = if k == mime::APPLICATION_JSON {
            v.get().to_string()
        } else {
            match serde_json::from_str::<String>(v.get()) {
                Ok(s) if !mime::is_binary(&k) || is_base64(&s) => s,
                _ => continue,
            }
        };
        data.insert(k, text);
    }
    data.contains_key(mime::TEXT_PLAIN).then_some(data)
}

fn is_base64(s: &str) -> bool {
    s.len().is_multiple_of(4)
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/' || b == b'=')
}

fn is_mime(s: &str) -> bool {
    let ok = |p: &str| {
        p.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
            && p.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+-.".contains(&b))
    };
    s.len() <= 127 && s.split_once('/').is_some_and(|(a, b)| ok(a) && ok(b))
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
            Some((Frame::Result, 22))
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
    fn a_result_and_displays_in_order() {
        let mut s = sink(1 << 20);
        s.take(
            Frame::Display,
            br#"{"data":{"text/plain":"a","text/html":"<b>a</b>"}}"#,
        );
        s.take(Frame::Result, br#"{"value":"4","data":{"text/plain":"4"}}"#);
        s.take(
            Frame::Result,
            br#"{"value":"[5, 6]","data":{"text/plain":"[5, 6]"}}"#,
        );
        assert_eq!(s.outputs.len(), 2);
        assert_eq!(s.outputs[0].kind, OutputKind::DisplayData);
        assert_eq!(s.outputs[0].get("text/html"), Some("<b>a</b>"));
        assert_eq!(s.outputs[1].text(), Some("[5, 6]"));
        assert_eq!(s.value.as_deref(), Some("[5, 6]"));
        s.take(
            Frame::Result,
            br#"{"value":"{not json","data":{"text/plain":"x"}}"#,
        );
        assert_eq!((s.outputs.len(), s.value.as_deref()), (2, None));
    }

    #[test]
    fn forged_frames_are_dropped() {
        let mut s = sink(1 << 20);
        for bad in [
            &b"not json"[..],
            br#"{"data":{"text/html":"<b>no plain</b>"}}"#,
            br#"{"data":{"text/plain":5}}"#,
            br#"{"data":[1]}"#,
        ] {
            s.take(Frame::Display, bad);
        }
        assert!(s.outputs.is_empty());
        s.take(
            Frame::Display,
            br#"{"data":{"text/plain":"x","Bad Key":"y","../x":"z","application/json":{"a":1}}}"#,
        );
        let d = &s.outputs[0].data;
        assert_eq!(
            d.keys().collect::<Vec<_>>(),
            ["application/json", "text/plain"]
        );
        assert_eq!(d["application/json"], r#"{"a":1}"#);
        s.take(
            Frame::Display,
            br#"{"data":{"text/plain":"p","image/png":"not base64!","image/jpeg":"/9j/"}}"#,
        );
        let d = &s.outputs[1].data;
        assert_eq!(d.keys().collect::<Vec<_>>(), ["image/jpeg", "text/plain"]);
        s.take(Frame::Error, br#"{"name":1}"#);
        assert!(s.error.is_none());
    }

    #[test]
    fn the_cap_holds_and_says_so() {
        let mut s = sink(100);
        assert_eq!(s.admits(Frame::Display, 101), None);
        assert!(s.truncated);
        assert_eq!(s.admits(Frame::Pyplot, 1 << 30), Some(0), "never read");
        let mut s = sink(100);
        let big = format!(r#"{{"data":{{"text/plain":"{}"}}}}"#, "x".repeat(60));
        assert!(s.admits(Frame::Display, big.len()).is_some());
        s.take(Frame::Display, big.as_bytes());
        s.take(Frame::Display, big.as_bytes());
        assert_eq!(s.outputs.len(), 1);
        assert!(s.truncated);
        let mut s = sink(1 << 30);
        for _ in 0..MAX_OUTPUTS {
            assert!(s.admits(Frame::Display, 10).is_some());
            s.take(Frame::Display, br#"{"data":{"text/plain":"x"}}"#);
        }
        assert_eq!(s.admits(Frame::Display, 10), None);
        // Frames that keep nothing still spend the call's read budget.
        let mut s = sink(1000);
        let mut read = 0;
        while s.admits(Frame::Display, 500).is_some() {
            s.take(Frame::Display, b"not json");
            read += 500;
        }
        let budget = 2000 + READ_SLACK as usize;
        assert!(read <= budget && read + 500 > budget, "{read}");
        // An error counts against the cap.
        let mut s = sink(100);
        let e = format!(
            r#"{{"name":"E","value":"{}","traceback":[]}}"#,
            "v".repeat(200)
        );
        assert!(s.admits(Frame::Error, e.len()).is_none());
        let e = format!(
            r#"{{"name":"E","value":"{}","traceback":[]}}"#,
            "v".repeat(20)
        );
        assert!(s.admits(Frame::Error, e.len()).is_some());
        s.take(Frame::Error, e.as_bytes());
        assert_eq!(s.error.as_ref().map(|e| e.value.len()), Some(20));
    }
}
