//! Frames on a byte stream: a fixed [`HEADER_LEN`]-byte header `[u32 payload length][u8
//! kind][u32 id]` (little endian), then the payload. The kind says what the payload is, the
//! id which request it belongs to (each agent decides what ids mean; 0 when it has none).
//!
//! A reader checks the length against its bound before it allocates anything, and a frame
//! refused as too large can be skipped ([`skip_bytes`]) without buffering it.

use std::fmt;
use std::io::{self, Read, Write};

use crate::codec::Enc;

/// Size of a frame header: payload length (`u32`), kind (`u8`), id (`u32`).
pub const HEADER_LEN: usize = 9;

/// A frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Payload length.
    pub len: u32,
    /// Message kind.
    pub kind: u8,
    /// Request id.
    pub id: u32,
}

impl Header {
    /// Parses the fixed-size header.
    pub fn parse(b: &[u8; HEADER_LEN]) -> Header {
        Header {
            len: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            kind: b[4],
            id: u32::from_le_bytes([b[5], b[6], b[7], b[8]]),
        }
    }

    /// The header's bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[..4].copy_from_slice(&self.len.to_le_bytes());
        b[4] = self.kind;
        b[5..].copy_from_slice(&self.id.to_le_bytes());
        b
    }

    /// The header of a frame of `kind` and `id` carrying `payload_len` bytes; `None` when
    /// that does not fit a `u32`.
    pub fn for_payload(kind: u8, id: u32, payload_len: usize) -> Option<Header> {
        Some(Header {
            len: u32::try_from(payload_len).ok()?,
            kind,
            id,
        })
    }

    /// The payload length, if it is at most `max`; else [`ReadError::TooLarge`] (check it
    /// before allocating the payload's buffer).
    pub fn checked_len(&self, max: usize) -> Result<usize, ReadError> {
        match usize::try_from(self.len) {
            Ok(n) if n <= max => Ok(n),
            _ => Err(ReadError::TooLarge(*self)),
        }
    }
}

/// Why [`read_frame`] returned no frame.
#[derive(Debug)]
pub enum ReadError {
    /// The stream ended in the middle of a frame.
    Truncated,
    /// The header announced a payload over the limit; nothing of it was read.
    TooLarge(Header),
    /// The underlying read failed.
    Io(io::Error),
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Truncated => f.write_str("the stream ended in the middle of a frame"),
            ReadError::TooLarge(h) => write!(
                f,
                "a frame (kind {}, id {}) announces {} bytes, over the limit",
                h.kind, h.id, h.len
            ),
            ReadError::Io(_) => f.write_str("reading a frame failed"),
        }
    }
}

impl std::error::Error for ReadError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ReadError::Io(e) => Some(e),
            _ => None,
        }
    }
}

impl From<ReadError> for io::Error {
    fn from(e: ReadError) -> io::Error {
        match e {
            ReadError::Io(e) => e,
            ReadError::Truncated => io::Error::new(io::ErrorKind::UnexpectedEof, e),
            ReadError::TooLarge(_) => io::Error::new(io::ErrorKind::InvalidData, e),
        }
    }
}

/// Reads one frame: `Ok(None)` on a clean end of stream (at a frame boundary). The payload
/// buffer is allocated only after its length was checked against `max`.
pub fn read_frame<R: Read + ?Sized>(
    r: &mut R,
    max: usize,
) -> Result<Option<(Header, Vec<u8>)>, ReadError> {
    let mut h = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match r.read(&mut h[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(ReadError::Truncated),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    let hdr = Header::parse(&h);
    let len = hdr.checked_len(max)?;
    let mut payload = vec![0u8; len];
    match r.read_exact(&mut payload) {
        Ok(()) => Ok(Some((hdr, payload))),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Err(ReadError::Truncated),
        Err(e) => Err(ReadError::Io(e)),
    }
}

/// Writes one frame of `kind` and `id` carrying `payload`, then flushes `w`.
pub fn write_frame<W: Write + ?Sized>(
    w: &mut W,
    kind: u8,
    id: u32,
    payload: &[u8],
) -> io::Result<()> {
    let h = Header::for_payload(kind, id, payload.len())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "frame too long"))?;
    let mut frame = Vec::with_capacity(HEADER_LEN + payload.len());
    frame.extend_from_slice(&h.to_bytes());
    frame.extend_from_slice(payload);
    w.write_all(&frame)?;
    w.flush()
}

/// Reads and drops `n` bytes (the payload of a frame refused as too large), so the stream
/// stays in sync without buffering it.
pub fn skip_bytes<R: Read + ?Sized>(r: &mut R, mut n: u64) -> io::Result<()> {
    let mut buf = [0u8; 8192];
    while n > 0 {
        let want = buf.len().min(usize::try_from(n).unwrap_or(usize::MAX));
        match r.read(&mut buf[..want]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(k) => n = n.saturating_sub(k as u64),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Enc {
    /// A frame under construction: its header (the length filled in by
    /// [`Enc::finish_frame`]), then the payload appended as usual.
    pub fn frame(kind: u8, id: u32) -> Enc {
        let mut e = Enc::new();
        e.0.extend_from_slice(&[0, 0, 0, 0, kind]);
        e.0.extend_from_slice(&id.to_le_bytes());
        e
    }

    /// Writes the payload length into the header [`Enc::frame`] started and returns the
    /// whole frame (a payload over `u32::MAX` bytes saturates: the receiver refuses it).
    pub fn finish_frame(mut self) -> Vec<u8> {
        let n = self.0.len().saturating_sub(HEADER_LEN);
        let n = u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
        if let Some(len) = self.0.get_mut(..4) {
            len.copy_from_slice(&n);
        }
        self.0
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[test]
    fn headers_round_trip() {
        let h = Header {
            len: 0x0102_0304,
            kind: 7,
            id: u32::MAX - 1,
        };
        assert_eq!(h.to_bytes(), [4, 3, 2, 1, 7, 0xfe, 0xff, 0xff, 0xff]);
        assert_eq!(Header::parse(&h.to_bytes()), h);
        assert_eq!(h.checked_len(0x0102_0304).unwrap(), 0x0102_0304);
        assert!(matches!(h.checked_len(3), Err(ReadError::TooLarge(x)) if x == h));
    }

    #[test]
    fn built_frames_read_back() {
        let mut e = Enc::frame(5, 9);
        e.str("abc");
        let f = e.finish_frame();
        let mut w = Vec::new();
        write_frame(&mut w, 5, 9, &f[HEADER_LEN..]).unwrap();
        assert_eq!(w, f);
        let mut r = &f[..];
        let (h, p) = read_frame(&mut r, 64).unwrap().unwrap();
        assert_eq!((h.kind, h.id, h.len), (5, 9, 7));
        assert_eq!(p, [3, 0, 0, 0, b'a', b'b', b'c']);
        assert!(read_frame(&mut r, 64).unwrap().is_none());
    }

    #[test]
    fn read_frame_checks_length_before_allocating() {
        let mut f = u32::MAX.to_le_bytes().to_vec();
        f.extend_from_slice(&[5, 7, 0, 0, 0]);
        match read_frame(&mut &f[..], 1 << 20) {
            Err(ReadError::TooLarge(h)) => assert_eq!((h.id, h.len), (7, u32::MAX)),
            other => panic!("{other:?}"),
        }
        // Clean EOF, EOF inside the header, EOF inside the payload.
        assert!(matches!(read_frame(&mut &[][..], 16), Ok(None)));
        assert!(matches!(
            read_frame(&mut &[1u8, 0][..], 16),
            Err(ReadError::Truncated)
        ));
        let mut w = Vec::new();
        write_frame(&mut w, 1, 3, b"abc").unwrap();
        assert!(matches!(
            read_frame(&mut &w[..w.len() - 1], 16),
            Err(ReadError::Truncated)
        ));
        let e: io::Error = ReadError::Truncated.into();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn skip_bytes_keeps_the_stream_in_sync() {
        let mut data = vec![1u8; 20_000];
        write_frame(&mut data, 2, 9, b"").unwrap();
        let mut r = &data[..];
        skip_bytes(&mut r, 20_000).unwrap();
        let (h, _) = read_frame(&mut r, 16).unwrap().unwrap();
        assert_eq!(h.id, 9);
        assert!(skip_bytes(&mut &[0u8; 3][..], 4).is_err());
    }
}
