//! Rich results of a code cell, following Jupyter's display model: the cell's last
//! expression (`execute_result`) and every `display(...)` (`display_data`) as MIME bundles,
//! and a failed cell's exception as a structured [`CellError`].
//!
//! ```
//! use sandbox_core::cell::{Output, OutputKind, mime};
//!
//! let out = Output::new(OutputKind::ExecuteResult, [(mime::TEXT_PLAIN, "4")]);
//! assert_eq!(out.text(), Some("4"));
//! assert!(out.get(mime::IMAGE_PNG).is_none());
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::secrets::Redactor;

/// The MIME types the interpreters produce (any other `type/subtype` a cell's object
/// offers through `_repr_mimebundle_` is kept as well).
pub mod mime {
    /// Plain text: every bundle has it (Python's `repr`).
    pub const TEXT_PLAIN: &str = "text/plain";
    /// HTML (a pandas `DataFrame`'s table).
    pub const TEXT_HTML: &str = "text/html";
    /// Markdown.
    pub const TEXT_MARKDOWN: &str = "text/markdown";
    /// LaTeX.
    pub const TEXT_LATEX: &str = "text/latex";
    /// A PNG image, base64 (a matplotlib figure).
    pub const IMAGE_PNG: &str = "image/png";
    /// A JPEG image, base64.
    pub const IMAGE_JPEG: &str = "image/jpeg";
    /// An SVG image (text).
    pub const IMAGE_SVG: &str = "image/svg+xml";
    /// JSON, as its text.
    pub const APPLICATION_JSON: &str = "application/json";

    /// Whether a bundle's value of `mime` is base64 of binary data rather than text.
    pub fn is_binary(mime: &str) -> bool {
        mime.starts_with("image/") && mime != IMAGE_SVG
    }
}

/// Where an output came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum OutputKind {
    /// The value of the cell's last expression (Jupyter's `execute_result`); at most one a
    /// cell.
    ExecuteResult,
    /// Something the cell displayed: `display(obj)`, or a matplotlib figure left open at the
    /// end of the cell (Jupyter's `display_data`).
    DisplayData,
}

/// One rich output of a cell: the representations of one object, by MIME type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Output {
    /// Where it came from.
    pub kind: OutputKind,
    /// MIME type to content: text as it is, binary types ([`mime::is_binary`]) as base64,
    /// `application/json` as JSON text. Always has `text/plain`.
    pub data: BTreeMap<String, String>,
}

impl Output {
    /// An output of `kind` with these representations.
    pub fn new<K: Into<String>, V: Into<String>>(
        kind: OutputKind,
        data: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        Output {
            kind,
            data: data
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        }
    }

    /// The representation of `mime`, if the object had one.
    pub fn get(&self, mime: &str) -> Option<&str> {
        self.data.get(mime).map(String::as_str)
    }

    /// The `text/plain` representation.
    pub fn text(&self) -> Option<&str> {
        self.get(mime::TEXT_PLAIN)
    }

    /// The bytes this output holds (what the output cap counts).
    pub fn size(&self) -> usize {
        self.data.iter().map(|(k, v)| k.len() + v.len()).sum()
    }
}

/// The exception that ended a cell, besides its traceback on stderr.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CellError {
    /// The exception's type (`ZeroDivisionError`).
    pub name: String,
    /// Its message (`division by zero`).
    pub value: String,
    /// The formatted traceback, one entry per line as Python's `traceback` formats it.
    pub traceback: Vec<String>,
}

impl CellError {
    /// An error of type `name` with message `value` and these traceback lines.
    pub fn new(name: impl Into<String>, value: impl Into<String>, traceback: Vec<String>) -> Self {
        CellError {
            name: name.into(),
            value: value.into(),
            traceback,
        }
    }
}

impl CellError {
    /// The bytes this error holds (what the output cap counts).
    pub fn size(&self) -> usize {
        self.name.len() + self.value.len() + self.traceback.iter().map(String::len).sum::<usize>()
    }
}

/// Text with `redactor`'s secret values hidden.
pub fn redact_text(redactor: &Redactor, s: String) -> String {
    if redactor.is_empty() {
        return s;
    }
    String::from_utf8_lossy(&redactor.redact(s.as_bytes())).into_owned()
}

/// JSON text with `redactor`'s secret values hidden: in the text as written, and in every
/// string it holds once decoded (JSON escapes a secret's quotes, backslashes and non-ASCII
/// characters, so the text alone may not show it).
pub fn redact_json(redactor: &Redactor, s: String) -> String {
    if redactor.is_empty() {
        return s;
    }
    /// Redacts the strings of `v`; whether any changed.
    fn walk(r: &Redactor, v: &mut serde_json::Value) -> bool {
        match v {
            serde_json::Value::String(t) => {
                let red = redact_text(r, t.clone());
                let changed = red != *t;
                *t = red;
                changed
            }
            serde_json::Value::Array(a) => a.iter_mut().fold(false, |c, v| walk(r, v) | c),
            serde_json::Value::Object(m) => m.values_mut().fold(false, |c, v| walk(r, v) | c),
            _ => false,
        }
    }
    // Written anew only when a secret was in it (the text is kept as it was otherwise).
    if let Ok(mut v) = serde_json::from_str::<serde_json::Value>(&s) {
        if walk(redactor, &mut v) {
            return redact_text(redactor, serde_json::to_string(&v).unwrap_or_default());
        }
    }
    redact_text(redactor, s)
}

impl Output {
    /// This output with `redactor`'s secrets hidden in its text representations (base64
    /// images are left whole: a redaction inside one would only break the image).
    pub fn redacted(mut self, redactor: &Redactor) -> Output {
        if redactor.is_empty() {
            return self;
        }
        for (k, v) in self.data.iter_mut() {
            if k == mime::APPLICATION_JSON {
                *v = redact_json(redactor, std::mem::take(v));
            } else if !mime::is_binary(k) {
                *v = redact_text(redactor, std::mem::take(v));
            }
        }
        self
    }
}

impl CellError {
    /// This error with `redactor`'s secrets hidden.
    pub fn redacted(self, redactor: &Redactor) -> CellError {
        if redactor.is_empty() {
            return self;
        }
        CellError::new(
            redact_text(redactor, self.name),
            redact_text(redactor, self.value),
            self.traceback
                .into_iter()
                .map(|l| redact_text(redactor, l))
                .collect(),
        )
    }
}

/// Representations one bundle may carry.
pub const MAX_MIMES: usize = 16;
/// Outputs one cell may produce (each also counts against the byte cap).
pub const MAX_OUTPUTS: usize = 256;
/// Traceback lines kept.
pub const MAX_TRACEBACK: usize = 512;
/// The largest error frame read, whatever the cap (the drivers send far less).
pub const MAX_ERROR_FRAME: usize = 256 << 10;

/// What a driver's frame reports (see [`Collector`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FrameKind {
    /// The last expression's value and bundle: `{"value": JSON text, "data": {mime: ..}}`.
    Result,
    /// A `display(...)`'s bundle: `{"data": {mime: ..}}`.
    Display,
    /// The exception that ended the cell: `{"name", "value", "traceback": [lines]}`.
    Error,
}

/// A cell's rich outputs as its driver inside the sandbox reports them, frame by frame.
/// The frames come from code in the sandbox, which can forge any of them: each is parsed,
/// checked (MIME-shaped keys, base64 for binary types, `text/plain` present) and counted
/// against the output cap; what does not fit is dropped and [`Collector::truncated`] says
/// so. Every tier's interpreter collects through this one type.
#[derive(Debug, Default)]
pub struct Collector {
    outputs: Vec<Output>,
    error: Option<CellError>,
    value: Option<String>,
    truncated: bool,
    bytes: u64,
    cap: u64,
}

/// What a [`Collector`] kept of a cell.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Collected {
    /// The outputs, in order.
    pub outputs: Vec<Output>,
    /// The exception that ended the cell.
    pub error: Option<CellError>,
    /// The last expression's value as JSON text (when it was JSON-shaped).
    pub value: Option<String>,
    /// Something was dropped for the cap.
    pub truncated: bool,
}

#[derive(Deserialize)]
struct BundleFrame {
    /// The value as JSON text (Python's `json.dumps` of it, or of its `repr`).
    #[serde(default)]
    value: Option<String>,
    /// Kept as the frame's own text: parsed into a tree, a frame's numbers and arrays would
    /// take many times their size in host memory.
    data: BTreeMap<String, Box<serde_json::value::RawValue>>,
}

#[derive(Deserialize)]
struct ErrorFrame {
    name: String,
    value: String,
    #[serde(default)]
    traceback: Vec<String>,
}

impl Collector {
    /// A cell whose outputs and error may take `cap` bytes.
    pub fn new(cap: u64) -> Self {
        Collector {
            cap,
            ..Collector::default()
        }
    }

    /// Whether a frame of `kind` and `len` bytes may be read: it fits what is left of the
    /// cap (and the output count). When not, the cell is marked truncated.
    pub fn room(&mut self, kind: FrameKind, len: usize) -> bool {
        let fits = (len as u64) <= self.cap.saturating_sub(self.bytes)
            && match kind {
                FrameKind::Error => len <= MAX_ERROR_FRAME,
                _ => self.outputs.len() < MAX_OUTPUTS,
            };
        if !fits {
            self.truncated = true;
        }
        fits
    }

    /// Marks the cell truncated (a frame was dropped before it was read).
    pub fn mark_truncated(&mut self) {
        self.truncated = true;
    }

    /// Takes one frame's JSON body; whether it was kept (malformed frames are ignored, and
    /// what does not fit is dropped). A kept result or display is the last of
    /// [`outputs`](Self::outputs); a kept error is [`error`](Self::error).
    pub fn take(&mut self, kind: FrameKind, body: &[u8]) -> bool {
        match kind {
            FrameKind::Error => {
                let Ok(e) = serde_json::from_slice::<ErrorFrame>(body) else {
                    return false;
                };
                let mut tb = e.traceback;
                tb.truncate(MAX_TRACEBACK);
                let err = CellError::new(e.name, e.value, tb);
                let old = self.error.as_ref().map_or(0, CellError::size);
                let bytes = self.bytes.saturating_sub(old as u64);
                if bytes.saturating_add(err.size() as u64) > self.cap {
                    self.truncated = true;
                    return false;
                }
                self.bytes = bytes + err.size() as u64;
                self.error = Some(err);
                true
            }
            FrameKind::Result | FrameKind::Display => {
                let Ok(b) = serde_json::from_slice::<BundleFrame>(body) else {
                    return false;
                };
                let Some(data) = checked_bundle(b.data) else {
                    return false;
                };
                let out_kind = if kind == FrameKind::Result {
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
                let out = Output::new(out_kind, data);
                let size = out.size() as u64;
                if self.bytes.saturating_add(size) > self.cap {
                    self.truncated = true;
                    return false;
                }
                self.bytes += size;
                self.outputs.push(out);
                true
            }
        }
    }

    /// The outputs so far, in order.
    pub fn outputs(&self) -> &[Output] {
        &self.outputs
    }

    /// The error so far.
    pub fn error(&self) -> Option<&CellError> {
        self.error.as_ref()
    }

    /// The last expression's JSON value so far.
    pub fn value(&self) -> Option<&str> {
        self.value.as_deref()
    }

    /// Whether something was dropped for the cap.
    pub fn truncated(&self) -> bool {
        self.truncated
    }

    /// What was kept.
    pub fn finish(self) -> Collected {
        Collected {
            outputs: self.outputs,
            error: self.error,
            value: self.value,
            truncated: self.truncated,
        }
    }
}

/// A bundle's representations, checked: MIME-shaped keys, string values (base64 for the
/// binary types; JSON text for `application/json`), `text/plain` present; `None` when
/// unusable.
fn checked_bundle(
    raw: BTreeMap<String, Box<serde_json::value::RawValue>>,
) -> Option<BTreeMap<String, String>> {
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

    #[test]
    fn outputs_round_trip_as_json() {
        let o = Output::new(
            OutputKind::DisplayData,
            [
                (mime::TEXT_PLAIN, "<Figure>"),
                (mime::IMAGE_PNG, "iVBORw0KGgo="),
            ],
        );
        let j = serde_json::to_string(&o).unwrap();
        assert!(j.contains("\"kind\":\"display_data\""), "{j}");
        let back: Output = serde_json::from_str(&j).unwrap();
        assert_eq!(back, o);
        assert_eq!(o.size(), "text/plain<Figure>image/pngiVBORw0KGgo=".len());
        assert!(mime::is_binary(mime::IMAGE_PNG));
        assert!(!mime::is_binary(mime::IMAGE_SVG));
        assert!(!mime::is_binary(mime::TEXT_HTML));
    }

    fn take(c: &mut Collector, kind: FrameKind, body: &[u8]) {
        if c.room(kind, body.len()) {
            c.take(kind, body);
        }
    }

    #[test]
    fn a_result_and_displays_in_order() {
        let mut c = Collector::new(1 << 20);
        take(
            &mut c,
            FrameKind::Display,
            br#"{"data":{"text/plain":"a","text/html":"<b>a</b>"}}"#,
        );
        take(
            &mut c,
            FrameKind::Result,
            br#"{"value":"4","data":{"text/plain":"4"}}"#,
        );
        take(
            &mut c,
            FrameKind::Result,
            br#"{"value":"[5, 6]","data":{"text/plain":"[5, 6]"}}"#,
        );
        assert_eq!(c.outputs().len(), 2);
        assert_eq!(c.outputs()[0].kind, OutputKind::DisplayData);
        assert_eq!(c.outputs()[0].get("text/html"), Some("<b>a</b>"));
        assert_eq!(c.outputs()[1].text(), Some("[5, 6]"));
        assert_eq!(c.value(), Some("[5, 6]"));
        take(
            &mut c,
            FrameKind::Result,
            br#"{"value":"{not json","data":{"text/plain":"x"}}"#,
        );
        assert_eq!((c.outputs().len(), c.value()), (2, None));
    }

    #[test]
    fn forged_frames_are_dropped() {
        let mut c = Collector::new(1 << 20);
        for bad in [
            &b"not json"[..],
            br#"{"data":{"text/html":"<b>no plain</b>"}}"#,
            br#"{"data":{"text/plain":5}}"#,
            br#"{"data":[1]}"#,
        ] {
            take(&mut c, FrameKind::Display, bad);
        }
        assert!(c.outputs().is_empty());
        take(
            &mut c,
            FrameKind::Display,
            br#"{"data":{"text/plain":"x","Bad Key":"y","../x":"z","application/json":{"a":1}}}"#,
        );
        let d = &c.outputs()[0].data;
        assert_eq!(
            d.keys().collect::<Vec<_>>(),
            ["application/json", "text/plain"]
        );
        assert_eq!(d["application/json"], r#"{"a":1}"#);
        take(
            &mut c,
            FrameKind::Display,
            br#"{"data":{"text/plain":"p","image/png":"not base64!","image/jpeg":"/9j/"}}"#,
        );
        let d = &c.outputs()[1].data;
        assert_eq!(d.keys().collect::<Vec<_>>(), ["image/jpeg", "text/plain"]);
        take(&mut c, FrameKind::Error, br#"{"name":1}"#);
        assert!(c.error().is_none());
    }

    #[test]
    fn the_cap_holds_and_says_so() {
        let mut c = Collector::new(100);
        assert!(!c.room(FrameKind::Display, 101));
        assert!(c.truncated());
        let mut c = Collector::new(100);
        let big = format!(r#"{{"data":{{"text/plain":"{}"}}}}"#, "x".repeat(60));
        take(&mut c, FrameKind::Display, big.as_bytes());
        take(&mut c, FrameKind::Display, big.as_bytes());
        assert_eq!(c.outputs().len(), 1);
        assert!(c.truncated());
        let mut c = Collector::new(1 << 30);
        for _ in 0..MAX_OUTPUTS {
            take(
                &mut c,
                FrameKind::Display,
                br#"{"data":{"text/plain":"x"}}"#,
            );
        }
        assert!(!c.room(FrameKind::Display, 10));
        // An error counts against the cap.
        let mut c = Collector::new(100);
        let e = format!(
            r#"{{"name":"E","value":"{}","traceback":[]}}"#,
            "v".repeat(200)
        );
        assert!(!c.room(FrameKind::Error, e.len()));
        let e = format!(
            r#"{{"name":"E","value":"{}","traceback":[]}}"#,
            "v".repeat(20)
        );
        take(&mut c, FrameKind::Error, e.as_bytes());
        assert_eq!(c.error().map(|e| e.value.len()), Some(20));
        assert_eq!(c.finish().error.map(|e| e.size()), Some(21));
    }

    #[test]
    fn secrets_are_hidden_even_where_json_escapes_them() {
        let r = Redactor::new([("T".to_string(), "p\u{e4}ss\"w0rd".to_string())]);
        let o = Output::new(
            OutputKind::ExecuteResult,
            [
                (mime::TEXT_PLAIN, "'p\u{e4}ss\"w0rd'"),
                (mime::APPLICATION_JSON, r#"{"k":["p\u00e4ss\"w0rd"]}"#),
                (mime::IMAGE_PNG, "cGFzcw=="),
            ],
        )
        .redacted(&r);
        assert_eq!(o.text(), Some("'[REDACTED:T]'"));
        assert_eq!(
            o.get(mime::APPLICATION_JSON),
            Some(r#"{"k":["[REDACTED:T]"]}"#)
        );
        assert_eq!(o.get(mime::IMAGE_PNG), Some("cGFzcw=="));
        assert_eq!(
            redact_json(&r, r#""p\u00e4ss\"w0rd""#.into()),
            r#""[REDACTED:T]""#
        );
        assert_eq!(
            redact_json(&r, r#"["a", 1]"#.into()),
            r#"["a", 1]"#,
            "kept as written"
        );
        let e =
            CellError::new("E", "p\u{e4}ss\"w0rd", vec!["x p\u{e4}ss\"w0rd".into()]).redacted(&r);
        assert_eq!(
            (e.value.as_str(), e.traceback[0].as_str()),
            ("[REDACTED:T]", "x [REDACTED:T]")
        );
    }
}
