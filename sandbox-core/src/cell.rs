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
}
