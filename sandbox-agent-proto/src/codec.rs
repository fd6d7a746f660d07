//! Message codec primitives: [`Enc`] appends values, [`Dec`] reads them back, every read
//! bounds-checked.
//!
//! One byte order, little endian. Integers as their fixed-size bytes; a `bool` as one byte,
//! 0 or 1; byte strings and UTF-8 strings as a `u32` length then the bytes; lists as a `u32`
//! count then the items. A failed read consumes nothing, and a list's count is checked
//! against the bytes left before anything is reserved for it.

use std::fmt;

/// Why a payload did not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeError {
    /// A field needed more bytes than were left.
    Truncated {
        /// Where the field starts.
        offset: usize,
        /// Bytes the field needs.
        needed: usize,
        /// Bytes that were left.
        left: usize,
    },
    /// A string is not valid UTF-8.
    InvalidUtf8 {
        /// Where the string's length starts.
        offset: usize,
    },
    /// A `bool` byte other than 0 or 1.
    InvalidBool {
        /// Where the byte is.
        offset: usize,
        /// The byte.
        value: u8,
    },
    /// A list count larger than the bytes left could hold.
    CountTooLarge {
        /// Where the count starts.
        offset: usize,
        /// The count.
        count: u32,
        /// Bytes that were left after it.
        left: usize,
    },
    /// Bytes remain after the last field.
    TrailingBytes {
        /// Where they start.
        offset: usize,
        /// How many.
        left: usize,
    },
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            DecodeError::Truncated {
                offset,
                needed,
                left,
            } => write!(
                f,
                "truncated message: a field at byte {offset} needs {needed} bytes, {left} left"
            ),
            DecodeError::InvalidUtf8 { offset } => {
                write!(f, "the string at byte {offset} is not UTF-8")
            }
            DecodeError::InvalidBool { offset, value } => {
                write!(f, "byte {offset} is {value}, not a boolean (0 or 1)")
            }
            DecodeError::CountTooLarge {
                offset,
                count,
                left,
            } => write!(
                f,
                "the list at byte {offset} claims {count} items, more than its {left} bytes hold"
            ),
            DecodeError::TrailingBytes { offset, left } => {
                write!(
                    f,
                    "{left} unexpected bytes after the message, at byte {offset}"
                )
            }
        }
    }
}

impl std::error::Error for DecodeError {}

/// Appends little-endian values to a buffer (the field: what was encoded so far; a message
/// header, when there is one, is written into it first).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Enc(pub Vec<u8>);

impl Enc {
    /// An empty encoder.
    pub fn new() -> Enc {
        Enc(Vec::with_capacity(64))
    }
    /// The bytes encoded.
    pub fn into_vec(self) -> Vec<u8> {
        self.0
    }
    /// Appends a byte.
    pub fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    /// Appends a `bool` as one byte, 0 or 1.
    pub fn bool(&mut self, v: bool) {
        self.0.push(u8::from(v));
    }
    /// Appends a `u16`.
    pub fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// Appends a `u32`.
    pub fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// Appends an `i32`.
    pub fn i32(&mut self, v: i32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// Appends a `u64`.
    pub fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// Appends a length or count as a `u32`. Lengths above `u32::MAX` cannot be framed
    /// anyway: it saturates, and the receiver refuses the message.
    pub fn len(&mut self, n: usize) {
        self.u32(u32::try_from(n).unwrap_or(u32::MAX));
    }
    /// Appends a byte string: its length, then the bytes.
    pub fn bytes(&mut self, b: &[u8]) {
        self.len(b.len());
        self.0.extend_from_slice(b);
    }
    /// Appends a UTF-8 string (as [`Enc::bytes`]).
    pub fn str(&mut self, s: &str) {
        self.bytes(s.as_bytes());
    }
    /// Appends a string list: its count, then each string.
    pub fn strs(&mut self, v: &[String]) {
        self.list(v, |e, s| e.str(s));
    }
    /// Appends a list: its count, then each item as `item` encodes it.
    pub fn list<T>(&mut self, items: &[T], mut item: impl FnMut(&mut Enc, &T)) {
        self.len(items.len());
        for x in items {
            item(self, x);
        }
    }
}

/// Reads what [`Enc`] wrote, from a borrowed buffer; every read is bounds-checked and a
/// failed one consumes nothing.
#[derive(Debug, Clone)]
pub struct Dec<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Dec<'a> {
    /// A decoder at the start of `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Dec { buf, pos: 0 }
    }
    /// What is left after the values read so far.
    pub fn rest(&self) -> &'a [u8] {
        self.buf.get(self.pos..).unwrap_or_default()
    }
    /// How many bytes were read so far.
    pub fn position(&self) -> usize {
        self.pos
    }
    /// `Ok` when every byte was read, else [`DecodeError::TrailingBytes`].
    pub fn end(&self) -> Result<(), DecodeError> {
        match self.rest().len() {
            0 => Ok(()),
            left => Err(DecodeError::TrailingBytes {
                offset: self.pos,
                left,
            }),
        }
    }
    /// The next `n` bytes, borrowed from the buffer.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let truncated = DecodeError::Truncated {
            offset: self.pos,
            needed: n,
            left: self.rest().len(),
        };
        let end = self.pos.checked_add(n).ok_or(truncated)?;
        let s = self.buf.get(self.pos..end).ok_or(truncated)?;
        self.pos = end;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    /// Reads a byte.
    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.arr::<1>()?[0])
    }
    /// Reads a `bool`: one byte, 0 or 1 (anything else is [`DecodeError::InvalidBool`]).
    pub fn bool(&mut self) -> Result<bool, DecodeError> {
        let offset = self.pos;
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            value => {
                self.pos = offset;
                Err(DecodeError::InvalidBool { offset, value })
            }
        }
    }
    /// Reads a `u16`.
    pub fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.arr()?))
    }
    /// Reads a `u32`.
    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    /// Reads an `i32`.
    pub fn i32(&mut self) -> Result<i32, DecodeError> {
        Ok(i32::from_le_bytes(self.arr()?))
    }
    /// Reads a `u64`.
    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    /// Reads a byte string written by [`Enc::bytes`] (borrowed from the buffer).
    pub fn bytes(&mut self) -> Result<&'a [u8], DecodeError> {
        let offset = self.pos;
        let n = self.u32()? as usize;
        self.take(n).inspect_err(|_| self.pos = offset)
    }
    /// Reads a UTF-8 string written by [`Enc::str`].
    pub fn str(&mut self) -> Result<String, DecodeError> {
        let offset = self.pos;
        let b = self.bytes()?;
        match std::str::from_utf8(b) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => {
                self.pos = offset;
                Err(DecodeError::InvalidUtf8 { offset })
            }
        }
    }
    /// Reads a list count whose items take at least `min_item` bytes each (at least 1),
    /// checked against the bytes left: a forged count cannot make the caller reserve
    /// memory for items that are not there.
    pub fn count(&mut self, min_item: usize) -> Result<usize, DecodeError> {
        let offset = self.pos;
        let count = self.u32()?;
        let left = self.rest().len();
        let n = count as usize;
        if n.saturating_mul(min_item.max(1)) > left {
            self.pos = offset;
            return Err(DecodeError::CountTooLarge {
                offset,
                count,
                left,
            });
        }
        Ok(n)
    }
    /// Reads a list written by [`Enc::list`]: its count (checked as [`Dec::count`] does with
    /// `min_item`), then each item as `item` decodes it.
    pub fn list<T, E: From<DecodeError>>(
        &mut self,
        min_item: usize,
        mut item: impl FnMut(&mut Dec<'a>) -> Result<T, E>,
    ) -> Result<Vec<T>, E> {
        let n = self.count(min_item)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(item(self)?);
        }
        Ok(v)
    }
    /// Reads a string list written by [`Enc::strs`].
    pub fn strs(&mut self) -> Result<Vec<String>, DecodeError> {
        self.list(4, |d| d.str())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn scalars_and_strings_round_trip() {
        let mut e = Enc::new();
        e.u8(0xab);
        e.bool(true);
        e.bool(false);
        e.u16(0xbeef);
        e.i32(-2);
        e.u32(u32::MAX);
        e.u64(1 << 40);
        e.bytes(b"\0raw\xff");
        e.str("text ñ");
        e.strs(&["a".into(), String::new()]);
        e.list(&[(1u32, 2u64)], |e, (a, b)| {
            e.u32(*a);
            e.u64(*b);
        });
        e.0.extend_from_slice(b"tail");
        let b = e.into_vec();
        let mut d = Dec::new(&b);
        assert_eq!(d.u8(), Ok(0xab));
        assert_eq!(d.bool(), Ok(true));
        assert_eq!(d.bool(), Ok(false));
        assert_eq!(d.u16(), Ok(0xbeef));
        assert_eq!(d.i32(), Ok(-2));
        assert_eq!(d.u32(), Ok(u32::MAX));
        assert_eq!(d.u64(), Ok(1 << 40));
        assert_eq!(d.bytes(), Ok(&b"\0raw\xff"[..]));
        assert_eq!(d.str(), Ok("text ñ".to_string()));
        assert_eq!(d.strs(), Ok(vec!["a".to_string(), String::new()]));
        let pairs: Result<Vec<(u32, u64)>, DecodeError> = d.list(12, |d| Ok((d.u32()?, d.u64()?)));
        assert_eq!(pairs, Ok(vec![(1, 2)]));
        assert_eq!(d.rest(), b"tail");
        assert_eq!(
            d.end(),
            Err(DecodeError::TrailingBytes {
                offset: b.len() - 4,
                left: 4
            })
        );
        assert_eq!(d.take(4), Ok(&b"tail"[..]));
        assert_eq!(d.end(), Ok(()));
    }

    #[test]
    fn integers_are_little_endian() {
        let mut e = Enc::new();
        e.u32(0x0102_0304);
        e.u16(0x0506);
        e.u64(7);
        assert_eq!(e.0, [4, 3, 2, 1, 6, 5, 7, 0, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn a_failed_read_consumes_nothing() {
        let mut d = Dec::new(&[1, 2, 3]);
        assert_eq!(
            d.u32(),
            Err(DecodeError::Truncated {
                offset: 0,
                needed: 4,
                left: 3
            })
        );
        assert!(d.u64().is_err());
        assert!(d.i32().is_err());
        assert!(d.bytes().is_err());
        assert!(d.count(1).is_err());
        assert_eq!(d.rest(), [1, 2, 3]);
        assert_eq!(d.u8(), Ok(1));
        assert_eq!(d.position(), 1);
        assert!(Dec::new(&[]).u8().is_err());
        assert!(Dec::new(&[]).rest().is_empty());
        // A string whose length is there but not its bytes: the length is not consumed.
        let mut d = Dec::new(&[5, 0, 0, 0, b'a']);
        assert!(d.str().is_err());
        assert_eq!(d.position(), 0);
    }

    #[test]
    fn bad_values_say_what_and_where() {
        let mut d = Dec::new(&[0, 2]);
        assert_eq!(d.bool(), Ok(false));
        assert_eq!(
            d.bool(),
            Err(DecodeError::InvalidBool {
                offset: 1,
                value: 2
            })
        );
        let mut e = Enc::new();
        e.u8(9);
        e.bytes(b"/bad\xff");
        let mut d = Dec::new(&e.0);
        d.u8().unwrap();
        assert_eq!(d.str(), Err(DecodeError::InvalidUtf8 { offset: 1 }));
        assert_eq!(d.position(), 1);
        let err = DecodeError::InvalidUtf8 { offset: 1 };
        assert_eq!(err.to_string(), "the string at byte 1 is not UTF-8");
    }

    #[test]
    fn huge_lengths_and_counts_fail_without_huge_allocations() {
        let max = u32::MAX.to_le_bytes();
        assert!(Dec::new(&max).bytes().is_err());
        assert!(Dec::new(&max).str().is_err());
        assert_eq!(
            Dec::new(&max).strs(),
            Err(DecodeError::CountTooLarge {
                offset: 0,
                count: u32::MAX,
                left: 0
            })
        );
        // A count that fits in the bytes left at one byte per item, but not at four.
        let mut b = 3u32.to_le_bytes().to_vec();
        b.extend_from_slice(&[0; 8]);
        assert_eq!(Dec::new(&b).count(1), Ok(3));
        assert!(Dec::new(&b).count(4).is_err());
        // A zero item size counts as one.
        assert!(Dec::new(&max).count(0).is_err());
    }

    #[test]
    fn lengths_saturate() {
        let mut e = Enc::new();
        e.len(usize::MAX);
        assert_eq!(e.0, u32::MAX.to_le_bytes());
    }
}
