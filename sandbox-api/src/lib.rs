//! # sandbox-api
//!
//! The wire form of `agent-sandbox serve`'s HTTP API, version 1: what clients send and get
//! back, with no HTTP stack. The server (`sandbox-server`) answers with these types and the
//! remote client (`sandbox-remote`) sends and reads them, so the two cannot drift apart, and a
//! client links serde, not the server.
//!
//! | module | what |
//! |---|---|
//! | [`bodies`] (re-exported at the root) | request and answer bodies: [`CreateSandbox`], [`ExecBody`], [`SandboxInfo`], [`TierList`]... |
//! | [`error`] | the error answer's JSON ([`ErrorBody`]) and the stable error kinds ([`error::kind_of`]) |
//! | [`snapshot_tar`] | a snapshot sent or fetched as one body: [`write_snapshot_tar`], [`read_snapshot_tar`] |
//!
//! Requests refuse unknown fields (a misspelt option is an error, not silently ignored);
//! answers may gain fields.

#![forbid(unsafe_code)]

pub mod bodies;
pub mod error;
pub mod snapshot_tar;

pub use bodies::*;
pub use error::{BadRequest, ErrorBody, ErrorDetail};
pub use snapshot_tar::{read_snapshot_tar, write_snapshot_tar};
