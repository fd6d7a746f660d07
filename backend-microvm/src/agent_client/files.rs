//! Files of the guest's workspace: written in as many frames as needed, read whole up to a
//! limit, and listed.

use super::*;

impl AgentClient {
    /// Writes a file in the guest's workspace (parents are created), in as many frames as
    /// needed. `mode` 0 means 0644.
    pub fn write_file(
        &self,
        path: &str,
        data: &[u8],
        mode: u32,
        timeout: Duration,
    ) -> Result<(), AgentError> {
        let mut first = true;
        let mut chunks = data.chunks(proto::WRITE_CHUNK);
        loop {
            let chunk = chunks.next();
            if chunk.is_none() && !first {
                return Ok(());
            }
            let call = self.start(&Request::WriteFile {
                path: path.to_string(),
                mode,
                append: !first,
                data: chunk.unwrap_or_default().to_vec(),
            })?;
            match call.recv(Some(timeout))? {
                Response::Ok => {}
                r => return Err(unexpected(&r)),
            }
            first = false;
        }
    }

    /// Reads a whole file of the guest's workspace, refusing files over `max` bytes
    /// ([`ErrorKind::TooLarge`]). `timeout` applies to each chunk.
    pub fn read_file(
        &self,
        path: &str,
        max: u64,
        timeout: Duration,
    ) -> Result<Vec<u8>, AgentError> {
        let call = self.start(&Request::ReadFile {
            path: path.to_string(),
            max,
        })?;
        let mut out = Vec::new();
        loop {
            match call.recv(Some(timeout))? {
                Response::Data(d) => {
                    if (out.len() as u64).saturating_add(d.len() as u64) > max {
                        return Err(AgentError::Protocol(format!(
                            "the agent sent more than the {max} bytes asked for"
                        )));
                    }
                    out.extend_from_slice(&d);
                }
                Response::Ok => return Ok(out),
                r => return Err(unexpected(&r)),
            }
        }
    }

    /// Lists a directory of the guest's workspace (sorted by name, symlinks not followed).
    pub fn list(&self, path: &str, timeout: Duration) -> Result<Vec<Entry>, AgentError> {
        let call = self.start(&Request::List {
            path: path.to_string(),
        })?;
        match call.recv(Some(timeout))? {
            Response::Entries(v) => Ok(v),
            r => Err(unexpected(&r)),
        }
    }
}
