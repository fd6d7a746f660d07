use std::net::SocketAddr;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::DEADLINE;

/// A whole answer.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {} {}", self.status, self.text()))
    }
}

/// A request: `Connection: close`, a `Content-Length` unless `headers` states one.
pub fn request(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-length"))
    {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(body);
    out
}

/// Sends `raw` and reads the answer to the connection's end. `Err`: the server closed
/// the connection without an answer.
pub async fn exchange(addr: SocketAddr, raw: &[u8]) -> Result<Resp, String> {
    exchange_with(addr, raw, false).await
}

/// As [`exchange`]; `half_close`: the client then shuts its sending side (no more body
/// comes, whatever the head said).
pub async fn exchange_with(addr: SocketAddr, raw: &[u8], half_close: bool) -> Result<Resp, String> {
    tokio::time::timeout(DEADLINE, async {
        let mut s = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        // The server may answer (and close) before it reads all of a body it refuses.
        let _ = s.write_all(raw).await;
        if half_close {
            let _ = s.shutdown().await;
        }
        let mut got = Vec::new();
        let mut buf = [0u8; 16 << 10];
        loop {
            match s.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if got.is_empty() => return Err(format!("no answer: {e}")),
                Err(_) => break,
            }
        }
        parse(&got)
    })
    .await
    .unwrap_or_else(|_| panic!("no answer within {DEADLINE:?}"))
}

fn parse(got: &[u8]) -> Result<Resp, String> {
    let end = got
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| format!("no answer head in {:?}", String::from_utf8_lossy(got)))?;
    let head = String::from_utf8_lossy(&got[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status = status_of(lines.next().unwrap_or(""))?;
    let headers = headers_of(lines);
    let rest = &got[end + 4..];
    let chunked = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    });
    let body = if chunked {
        dechunk(rest)?
    } else if let Some(len) = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse::<usize>().ok())
    {
        rest.get(..len)
            .ok_or_else(|| format!("a body of {} bytes, {len} stated", rest.len()))?
            .to_vec()
    } else {
        rest.to_vec()
    };
    Ok(Resp {
        status,
        headers,
        body,
    })
}

fn status_of(line: &str) -> Result<u16, String> {
    line.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("not a status line: {line:?}"))
}

fn headers_of<'a>(lines: impl Iterator<Item = &'a str>) -> Vec<(String, String)> {
    lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let nl = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("a chunk without its size line")?;
        let size = std::str::from_utf8(&rest[..nl]).map_err(|e| e.to_string())?;
        let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|e| format!("chunk size {size:?}: {e}"))?;
        rest = &rest[nl + 2..];
        if size == 0 {
            return Ok(out);
        }
        let data = rest.get(..size).ok_or("a cut chunk")?;
        out.extend_from_slice(data);
        rest = rest.get(size + 2..).ok_or("a chunk without its CRLF")?;
    }
}

/// An answer read as it comes (a Connect server stream).
pub struct Stream {
    sock: BufReader<TcpStream>,
    pub status: u16,
    pub headers: Vec<(String, String)>,
    chunked: bool,
    buf: Vec<u8>,
    ended: bool,
}

/// How a stream read ended: an envelope, or the connection's end.
#[derive(Debug)]
pub enum Next {
    Envelope(u8, serde_json::Value),
    Closed,
}

impl Stream {
    /// Sends `raw` and reads the answer's head.
    pub async fn open(addr: SocketAddr, raw: &[u8]) -> Stream {
        tokio::time::timeout(DEADLINE, async {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(raw).await.unwrap();
            let mut sock = BufReader::new(s);
            let mut line = String::new();
            sock.read_line(&mut line).await.unwrap();
            let status = status_of(line.trim_end()).unwrap();
            let mut lines = Vec::new();
            loop {
                let mut l = String::new();
                sock.read_line(&mut l).await.unwrap();
                if l == "\r\n" || l.is_empty() {
                    break;
                }
                lines.push(l.trim_end().to_string());
            }
            let headers = headers_of(lines.iter().map(String::as_str));
            let chunked = headers.iter().any(|(k, v)| {
                k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
            });
            Stream {
                sock,
                status,
                headers,
                chunked,
                buf: Vec::new(),
                ended: false,
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no answer head within {DEADLINE:?}"))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Reads more of the body; false at its end (or the connection's).
    async fn fill(&mut self) -> bool {
        if self.ended {
            return false;
        }
        let more = if self.chunked {
            let mut line = String::new();
            match self.sock.read_line(&mut line).await {
                Ok(0) | Err(_) => None,
                Ok(_) => {
                    match usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16) {
                        Ok(0) | Err(_) => None,
                        Ok(n) => {
                            let mut data = vec![0u8; n + 2];
                            match self.sock.read_exact(&mut data).await {
                                Ok(_) => {
                                    data.truncate(n);
                                    Some(data)
                                }
                                Err(_) => None,
                            }
                        }
                    }
                }
            }
        } else {
            let mut data = vec![0u8; 16 << 10];
            match self.sock.read(&mut data).await {
                Ok(0) | Err(_) => None,
                Ok(n) => {
                    data.truncate(n);
                    Some(data)
                }
            }
        };
        match more {
            Some(d) => {
                self.buf.extend_from_slice(&d);
                true
            }
            None => {
                self.ended = true;
                false
            }
        }
    }

    /// The next envelope, or the connection's end; within the deadline.
    pub async fn next(&mut self) -> Next {
        tokio::time::timeout(DEADLINE, async {
            loop {
                if self.buf.len() >= 5 {
                    let len =
                        u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]])
                            as usize;
                    if self.buf.len() >= 5 + len {
                        let flags = self.buf[0];
                        let v = serde_json::from_slice(&self.buf[5..5 + len]).unwrap();
                        self.buf.drain(..5 + len);
                        return Next::Envelope(flags, v);
                    }
                }
                if !self.fill().await {
                    return Next::Closed;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("the stream neither sent nor ended within {DEADLINE:?}"))
    }
}
