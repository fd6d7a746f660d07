//! A code cell's rich outputs on a terminal: the text of what it displayed, and with
//! `run --outputs DIR` its images and HTML written to files.

use std::io::Write;
use std::path::{Path, PathBuf};

use agent_sandbox::{Output, OutputKind};
use base64::Engine as _;

/// The file extension of each MIME type `--outputs` writes, and whether its content is
/// base64.
const FILES: &[(&str, &str, bool)] = &[
    ("image/png", "png", true),
    ("image/jpeg", "jpg", true),
    ("image/svg+xml", "svg", false),
    ("text/html", "html", false),
];

/// Prints the `text/plain` of every displayed output (the cell's value is already in its
/// stdout, as an interactive interpreter echoes it).
pub(crate) fn print_text(outputs: &[Output], out: &mut impl Write) -> std::io::Result<()> {
    for o in outputs.iter().filter(|o| o.kind == OutputKind::DisplayData) {
        if let Some(t) = o.text() {
            writeln!(out, "{t}")?;
        }
    }
    Ok(())
}

/// Writes each output's images and HTML into `dir` (made if missing) as
/// `output-N.EXT` (N counts from 1 in the cell's order); returns the files written.
pub(crate) fn write_files(outputs: &[Output], dir: &Path) -> Result<Vec<PathBuf>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("--outputs {}: {e}", dir.display()))?;
    let mut written = Vec::new();
    for (i, o) in outputs.iter().enumerate() {
        for &(mime, ext, binary) in FILES {
            let Some(content) = o.get(mime) else {
                continue;
            };
            let bytes = if binary {
                match base64::engine::general_purpose::STANDARD.decode(content) {
                    Ok(b) => b,
                    Err(e) => return Err(format!("output {}: {mime} is not base64: {e}", i + 1)),
                }
            } else {
                content.as_bytes().to_vec()
            };
            let path = dir.join(format!("output-{}.{ext}", i + 1));
            std::fs::write(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
            written.push(path);
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn displayed_text_is_printed_and_files_are_written() {
        let outs = vec![
            Output::new(
                OutputKind::DisplayData,
                [("text/plain", "<Figure>"), ("image/png", "iVBORw0KGgo=")],
            ),
            Output::new(
                OutputKind::ExecuteResult,
                [("text/plain", "df"), ("text/html", "<table></table>")],
            ),
        ];
        let mut buf = Vec::new();
        print_text(&outs, &mut buf).unwrap();
        assert_eq!(buf, b"<Figure>\n");
        let dir = tempfile::tempdir().unwrap();
        let files = write_files(&outs, &dir.path().join("out")).unwrap();
        let names: Vec<_> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["output-1.png", "output-2.html"]);
        assert_eq!(std::fs::read(&files[0]).unwrap(), b"\x89PNG\r\n\x1a\n");
        let bad = vec![Output::new(
            OutputKind::DisplayData,
            [("text/plain", "x"), ("image/png", "%%%")],
        )];
        assert!(write_files(&bad, dir.path()).is_err());
    }
}
