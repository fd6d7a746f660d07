//! Masking responses: the [`ResponseMasker`], and the encoded forms of a value it replaces.

use std::fmt;
use std::sync::Arc;

use base64::Engine as _;

use super::MIN_VALUE_LEN;

/// Replaces each secret's value (and its encoded forms) by its placeholder in a response,
/// chunk by chunk; a value split across chunks is still found. Only a chunk's tail that
/// could still become a value (a proper prefix of one) is held back, until the next chunk or
/// [`finish`](Self::finish); everything else is passed on at once.
///
/// Held bytes are never given up on by time: the caller calls [`finish`](Self::finish) where
/// what it masks ends (a response body's end, the end of the stream), so that a value whose
/// halves arrive far apart is still masked whole. It masks whole values only: a server that
/// echoes part of a value reveals that part.
///
/// On the hot path of every intercepted download: all forms of all values are searched in one
/// pass (Aho-Corasick, SIMD prefilters where the CPU has them), and
/// [`push_into`](Self::push_into) appends to the caller's buffer, so a chunk without a value
/// costs one search and one copy.
pub struct ResponseMasker {
    pub(super) masks: Arc<Masks>,
    carry: Vec<u8>,
    masked: u64,
}

/// What a masker looks for (every form of every value) and what each becomes.
pub(super) struct Masks {
    /// Leftmost-longest: where two forms start together, the longer one wins.
    finder: Option<aho_corasick::AhoCorasick>,
    needles: Vec<Vec<u8>>,
    replacements: Vec<Vec<u8>>,
    /// The bytes a needle starts with.
    starts: [bool; 256],
    /// The longest needle, less one: the most a chunk's tail can be held.
    hold: usize,
}

impl fmt::Debug for ResponseMasker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the values.
        f.debug_struct("ResponseMasker")
            .field("forms", &self.masks.needles.len())
            .field("holding", &self.carry.len())
            .field("masked", &self.masked)
            .finish()
    }
}

impl fmt::Debug for Masks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the values.
        f.debug_struct("Masks")
            .field("forms", &self.needles.len())
            .finish_non_exhaustive()
    }
}

impl Masks {
    pub(super) fn new(pairs: Vec<(Vec<u8>, Vec<u8>)>) -> Self {
        let mut needles: Vec<Vec<u8>> = Vec::with_capacity(pairs.len());
        let mut replacements = Vec::with_capacity(pairs.len());
        for (v, p) in pairs {
            if v.is_empty() || v.len() != p.len() || needles.contains(&v) {
                continue;
            }
            needles.push(v);
            replacements.push(p);
        }
        let mut starts = [false; 256];
        for n in &needles {
            starts[usize::from(n[0])] = true;
        }
        let hold = needles
            .iter()
            .map(|n| n.len().saturating_sub(1))
            .max()
            .unwrap_or(0);
        // A few short patterns: building cannot run into the automaton's limits (a failure
        // would leave the finder out, and `ResponseMasker::is_active` false).
        let finder = if needles.is_empty() {
            None
        } else {
            aho_corasick::AhoCorasick::builder()
                .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                .build(&needles)
                .ok()
        };
        Masks {
            finder,
            needles,
            replacements,
            starts,
            hold,
        }
    }

    fn is_proper_prefix(&self, tail: &[u8]) -> bool {
        self.needles
            .iter()
            .any(|n| n.len() > tail.len() && n.starts_with(tail))
    }
}

impl ResponseMasker {
    pub(super) fn with(masks: Arc<Masks>) -> Self {
        ResponseMasker {
            masks,
            carry: Vec::new(),
            masked: 0,
        }
    }

    /// Whether it masks anything (no bound secret: bytes pass through as they are).
    pub fn is_active(&self) -> bool {
        self.masks.finder.is_some()
    }

    /// How many values (in any form) it replaced so far.
    pub fn masked(&self) -> u64 {
        self.masked
    }

    /// The next chunk: what may be sent on now (possibly less than was pushed).
    pub fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(chunk.len() + self.carry.len());
        self.push_into(chunk, &mut out);
        out
    }

    /// [`push`](Self::push), appending what may be sent on now to `out`.
    pub fn push_into(&mut self, chunk: &[u8], out: &mut Vec<u8>) {
        if !self.is_active() {
            out.extend_from_slice(chunk);
            return;
        }
        if self.carry.is_empty() {
            let kept = self.mask(chunk, out, false);
            self.carry.extend_from_slice(&chunk[chunk.len() - kept..]);
        } else {
            // A held tail: searched together with the new bytes (it is shorter than the
            // longest form, so this copy is small unless the chunks are).
            let mut buf = std::mem::take(&mut self.carry);
            buf.extend_from_slice(chunk);
            let kept = self.mask(&buf, out, false);
            buf.drain(..buf.len() - kept);
            self.carry = buf;
        }
    }

    /// Appends `buf` to `out` with every value replaced, except (unless `last`) a tail that
    /// could still become a value; returns that tail's length.
    fn mask(&mut self, buf: &[u8], out: &mut Vec<u8>, last: bool) -> usize {
        let masks = Arc::clone(&self.masks);
        let Some(finder) = &masks.finder else {
            out.extend_from_slice(buf);
            return 0;
        };
        // Where a form could still begin and end beyond `buf`: a proper prefix of one runs to
        // the end (only the last `hold` bytes can be).
        let pending: Vec<usize> = if last {
            Vec::new()
        } else {
            (buf.len().saturating_sub(masks.hold)..buf.len())
                .filter(|&q| masks.starts[usize::from(buf[q])] && masks.is_proper_prefix(&buf[q..]))
                .collect()
        };
        let first_pending = |from: usize| {
            pending
                .iter()
                .copied()
                .find(|q| *q >= from)
                .unwrap_or(buf.len())
        };
        let mut i = 0;
        for m in finder.find_iter(buf) {
            // A form that may still complete starts at or before this match: it decides
            // (leftmost, then longest) once more bytes came.
            if first_pending(i) <= m.start() {
                break;
            }
            out.extend_from_slice(&buf[i..m.start()]);
            out.extend_from_slice(&masks.replacements[m.pattern().as_usize()]);
            self.masked += 1;
            i = m.end();
        }
        let held = first_pending(i);
        out.extend_from_slice(&buf[i..held]);
        buf.len() - held
    }

    /// The end of what is masked (a response body, the stream): what was held back, masked
    /// (a proper prefix of a value at most stays as it is: nothing follows it).
    pub fn finish(&mut self) -> Vec<u8> {
        let carry = std::mem::take(&mut self.carry);
        let mut out = Vec::with_capacity(carry.len());
        self.mask(&carry, &mut out, true);
        out
    }

    /// Whether bytes are held back, waiting to see if a value follows.
    pub fn holding(&self) -> bool {
        !self.carry.is_empty()
    }
}

/// The forms of `value` a masker replaces, each with the same form of `placeholder` (as long
/// as the value, so every form keeps its length): the value itself; base64, standard and
/// URL-safe, at each alignment, only the symbols that encode value bits alone; hexadecimal,
/// lower and upper case; percent-encoded, reserved bytes or every byte, either case.
pub(super) fn masked_forms(value: &[u8], placeholder: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    use base64::engine::general_purpose::{STANDARD_NO_PAD, URL_SAFE_NO_PAD};
    let mut forms = vec![(value.to_vec(), placeholder.to_vec())];
    if value.len() != placeholder.len() {
        return forms;
    }
    for engine in [&STANDARD_NO_PAD, &URL_SAFE_NO_PAD] {
        for offset in 0..3 {
            forms.push((
                base64_core(engine, offset, value),
                base64_core(engine, offset, placeholder),
            ));
        }
    }
    for upper in [false, true] {
        forms.push((hex(value, upper), hex(placeholder, upper)));
        for all in [false, true] {
            forms.push(percent(value, placeholder, upper, all));
        }
    }
    // Short cores (a short value at an awkward alignment) would match ordinary text.
    forms.retain(|(v, _)| v.len() >= MIN_VALUE_LEN);
    forms
}

/// The base64 symbols of `x` that depend on `x` alone, when `x` starts `offset` bytes into a
/// 3-byte group of a longer encoded text: the symbols shared with the bytes before and after
/// are left out.
fn base64_core(engine: &base64::engine::GeneralPurpose, offset: usize, x: &[u8]) -> Vec<u8> {
    let mut input = vec![0u8; offset];
    input.extend_from_slice(x);
    let enc = engine.encode(&input).into_bytes();
    // Offset 1: the 2nd symbol mixes the byte before with ours; offset 2: the 3rd.
    let skip = [0, 2, 3][offset % 3];
    // An incomplete last group: its last symbol mixes ours with the byte after.
    let keep = if input.len().is_multiple_of(3) {
        enc.len()
    } else {
        enc.len() - 1
    };
    enc.get(skip..keep).unwrap_or_default().to_vec()
}

fn hex(x: &[u8], upper: bool) -> Vec<u8> {
    let digits: &[u8; 16] = if upper {
        b"0123456789ABCDEF"
    } else {
        b"0123456789abcdef"
    };
    x.iter()
        .flat_map(|b| [digits[usize::from(b >> 4)], digits[usize::from(b & 15)]])
        .collect()
}

/// The value percent-encoded (every byte, or all but the unreserved ones), and the
/// placeholder encoded at the same positions, so both have the same length.
fn percent(value: &[u8], placeholder: &[u8], upper: bool, all: bool) -> (Vec<u8>, Vec<u8>) {
    let (mut v, mut p) = (Vec::new(), Vec::new());
    for (a, b) in value.iter().zip(placeholder) {
        let encode = all || !(a.is_ascii_alphanumeric() || b"-._~".contains(a));
        if encode {
            v.push(b'%');
            v.extend(hex(&[*a], upper));
            p.push(b'%');
            p.extend(hex(&[*b], upper));
        } else {
            v.push(*a);
            p.push(*b);
        }
    }
    (v, p)
}
