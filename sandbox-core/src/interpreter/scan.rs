//! Splits a driver's output stream into the cell's own bytes and the driver's frames
//! (`MARK + JSON + "\n"`). The stream comes from the sandbox: a frame longer than the
//! scanner's limit is dropped as it streams by (never held whole), and a mark split across
//! chunks is still found.

use bytes::Bytes;

/// One piece of a scanned stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Piece {
    /// The cell's own output.
    Text(Bytes),
    /// A frame's JSON (the mark and the newline removed).
    Frame(Vec<u8>),
    /// A frame longer than the limit, dropped.
    Dropped,
}

#[derive(Debug)]
pub(crate) struct Scanner {
    mark: Vec<u8>,
    /// Text bytes that may be the start of a mark.
    held: Vec<u8>,
    /// Inside a frame: its bytes so far (`None` while dropping one too long).
    frame: Option<Option<Vec<u8>>>,
    /// The longest frame kept.
    pub(crate) limit: usize,
}

impl Scanner {
    pub(crate) fn new(mark: &[u8], limit: usize) -> Self {
        Scanner {
            mark: mark.to_vec(),
            held: Vec::new(),
            frame: None,
            limit,
        }
    }

    /// Scans one chunk, appending what it completes to `out`.
    pub(crate) fn push(&mut self, chunk: &[u8], out: &mut Vec<Piece>) {
        let mut data = chunk;
        let mut owned: Vec<u8>;
        while !data.is_empty() {
            match &mut self.frame {
                Some(body) => {
                    let end = data.iter().position(|&b| b == b'\n');
                    let part = &data[..end.unwrap_or(data.len())];
                    if let Some(b) = body {
                        if b.len().saturating_add(part.len()) <= self.limit {
                            b.extend_from_slice(part);
                        } else {
                            *body = None;
                        }
                    }
                    let Some(end) = end else { return };
                    out.push(match self.frame.take().flatten() {
                        Some(b) => Piece::Frame(b),
                        None => Piece::Dropped,
                    });
                    data = &data[end + 1..];
                }
                None => {
                    let mut next = std::mem::take(&mut self.held);
                    next.extend_from_slice(data);
                    owned = next;
                    if let Some(at) = find(&owned, &self.mark) {
                        if at > 0 {
                            out.push(Piece::Text(Bytes::copy_from_slice(&owned[..at])));
                        }
                        self.frame = Some(Some(Vec::new()));
                        data = &owned[at + self.mark.len()..];
                        continue;
                    }
                    // Keep back the longest tail that could begin a mark.
                    let keep = (1..self.mark.len().min(owned.len() + 1))
                        .rev()
                        .find(|&n| self.mark.starts_with(&owned[owned.len() - n..]))
                        .unwrap_or(0);
                    let text = owned.len() - keep;
                    if text > 0 {
                        out.push(Piece::Text(Bytes::copy_from_slice(&owned[..text])));
                    }
                    self.held = owned[text..].to_vec();
                    return;
                }
            }
        }
    }

    /// The text held back at the end of the stream (a mark that never came).
    pub(crate) fn finish(&mut self) -> Option<Bytes> {
        self.frame = None;
        let held = std::mem::take(&mut self.held);
        (!held.is_empty()).then(|| Bytes::from(held))
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(limit: usize, chunks: &[&[u8]]) -> Vec<Piece> {
        let mut s = Scanner::new(b"\x1eMK:", limit);
        let mut out = Vec::new();
        for c in chunks {
            s.push(c, &mut out);
        }
        out.extend(s.finish().map(Piece::Text));
        // Adjacent text pieces joined, as a reader sees them.
        let mut joined: Vec<Piece> = Vec::new();
        for p in out {
            match (joined.last_mut(), p) {
                (Some(Piece::Text(a)), Piece::Text(b)) => {
                    *a = Bytes::from([a.as_ref(), b.as_ref()].concat());
                }
                (_, p) => joined.push(p),
            }
        }
        joined
    }

    fn text(s: &str) -> Piece {
        Piece::Text(Bytes::copy_from_slice(s.as_bytes()))
    }

    #[test]
    fn text_and_frames_apart() {
        assert_eq!(
            scan(100, &[b"hi\n\x1eMK:{\"t\":1}\nbye"]),
            [
                text("hi\n"),
                Piece::Frame(b"{\"t\":1}".to_vec()),
                text("bye")
            ]
        );
    }

    #[test]
    fn a_mark_and_a_frame_split_anywhere() {
        let whole = b"ab\x1eMK:{\"x\":2}\n\x1eMK:{}\ncd\x1eM";
        for cut in 0..whole.len() {
            for cut2 in cut..whole.len() {
                let got = scan(100, &[&whole[..cut], &whole[cut..cut2], &whole[cut2..]]);
                assert_eq!(
                    got,
                    [
                        text("ab"),
                        Piece::Frame(b"{\"x\":2}".to_vec()),
                        Piece::Frame(b"{}".to_vec()),
                        text("cd\x1eM"),
                    ],
                    "cut at {cut}/{cut2}"
                );
            }
        }
    }

    #[test]
    fn a_frame_over_the_limit_is_dropped_as_it_streams() {
        let mut s = Scanner::new(b"\x1eMK:", 8);
        let mut out = Vec::new();
        s.push(b"\x1eMK:0123", &mut out);
        for _ in 0..1000 {
            s.push(&[b'9'; 4096], &mut out);
        }
        assert!(out.is_empty());
        assert!(matches!(&s.frame, Some(None)), "nothing of it is held");
        s.push(b"\nafter", &mut out);
        assert_eq!(out, [Piece::Dropped, text("after")]);
    }
}
