//! The OpenAPI 3.1 document of the v1 API, served at `GET /v1/openapi.json`. Written by hand
//! next to the routes (the crate's tests check that every documented operation is routed and
//! every route is documented, and CI validates the document with `openapi-spec-validator`).

use serde_json::{json, Value};

/// Every operation: (method, path). The router serves exactly these (tested).
pub const OPERATIONS: &[(&str, &str)] = &[
    ("get", "/v1/openapi.json"),
    ("get", "/v1/tiers"),
    ("post", "/v1/sandboxes"),
    ("get", "/v1/sandboxes"),
    ("post", "/v1/run"),
    ("get", "/v1/sandboxes/{id}"),
    ("delete", "/v1/sandboxes/{id}"),
    ("post", "/v1/sandboxes/{id}/exec"),
    ("post", "/v1/sandboxes/{id}/exec/stream"),
    ("put", "/v1/sandboxes/{id}/files/{path}"),
    ("get", "/v1/sandboxes/{id}/files/{path}"),
    ("get", "/v1/sandboxes/{id}/list"),
    ("post", "/v1/sandboxes/{id}/snapshot"),
    ("post", "/v1/sandboxes/{id}/pause"),
    ("post", "/v1/sandboxes/{id}/resume"),
    ("put", "/v1/sandboxes/{id}/network"),
    ("get", "/v1/sandboxes/{id}/network/events"),
    ("post", "/v1/sandboxes/{id}/processes"),
    ("get", "/v1/sandboxes/{id}/processes"),
    ("get", "/v1/sandboxes/{id}/processes/{pid}/output"),
    ("post", "/v1/sandboxes/{id}/processes/{pid}/stdin"),
    ("delete", "/v1/sandboxes/{id}/processes/{pid}/stdin"),
    ("post", "/v1/sandboxes/{id}/processes/{pid}/signal"),
    ("post", "/v1/sandboxes/{id}/processes/{pid}/resize"),
    ("post", "/v1/sandboxes/{id}/processes/{pid}/wait"),
    ("post", "/v1/sandboxes/{id}/ports"),
    ("get", "/v1/sandboxes/{id}/ports"),
    ("delete", "/v1/sandboxes/{id}/ports/{host}"),
    ("get", "/v1/snapshots"),
    ("post", "/v1/snapshots"),
    ("get", "/v1/snapshots/{sid}/manifest"),
    ("get", "/v1/snapshots/{sid}/artifacts/{name}"),
    ("get", "/v1/snapshots/{sid}"),
    ("delete", "/v1/snapshots/{sid}"),
    ("post", "/v1/snapshots/{sid}/restore"),
    ("post", "/v1/snapshots/{sid}/fork"),
];

fn error_responses() -> Value {
    json!({
        "400": { "$ref": "#/components/responses/Error" },
        "401": { "$ref": "#/components/responses/Error" },
        "403": { "$ref": "#/components/responses/Error" },
        "404": { "$ref": "#/components/responses/Error" },
        "409": { "$ref": "#/components/responses/Error" },
        "413": { "$ref": "#/components/responses/Error" },
        "429": { "$ref": "#/components/responses/Error" },
        "default": { "$ref": "#/components/responses/Error" }
    })
}

fn with_errors(mut ok: Value) -> Value {
    if let (Some(o), Some(e)) = (ok.as_object_mut(), error_responses().as_object()) {
        for (k, v) in e {
            o.insert(k.clone(), v.clone());
        }
    }
    ok
}

fn id_param() -> Value {
    json!({ "name": "id", "in": "path", "required": true, "schema": { "type": "string" } })
}

fn pid_param() -> Value {
    json!({ "name": "pid", "in": "path", "required": true,
        "description": "A process id, as spawning answered.",
        "schema": { "type": "integer", "minimum": 0 } })
}

fn sid_param() -> Value {
    json!({ "name": "sid", "in": "path", "required": true,
        "description": "A snapshot id: 64 lower-case hex digits.",
        "schema": { "type": "string", "pattern": "^[0-9a-f]{64}$" } })
}

/// The document.
pub fn document() -> Value {
    let json_body = |schema: &str| {
        json!({ "required": true, "content": { "application/json": {
            "schema": { "$ref": format!("#/components/schemas/{schema}") } } } })
    };
    let json_ok = |code: &str, what: &str, schema: &str| {
        with_errors(
            json!({ code: { "description": what, "content": { "application/json": {
            "schema": { "$ref": format!("#/components/schemas/{schema}") } } } } }),
        )
    };
    let mut paths = json!({
            "/v1/openapi.json": { "get": {
                "operationId": "openapi", "summary": "This document.",
                "responses": with_errors(json!({ "200": { "description": "The OpenAPI document.",
                    "content": { "application/json": { "schema": { "type": "object" } } } } }))
            } },
            "/v1/tiers": { "get": {
                "operationId": "listTiers",
                "summary": "Which tiers the server's host can run (the reason and the fix for the others), with what each can do.",
                "responses": json_ok("200", "The tiers.", "TierList")
            } },
            "/v1/sandboxes": {
                "post": {
                    "operationId": "createSandbox",
                    "summary": "Create a sandbox from a spec, on a tier or the selector's choice.",
                    "requestBody": json_body("CreateSandbox"),
                    "responses": json_ok("201", "The new sandbox.", "SandboxInfo")
                },
                "get": {
                    "operationId": "listSandboxes",
                    "summary": "The live sandboxes, filtered by labels (all must match).",
                    "parameters": [ { "name": "label", "in": "query", "required": false,
                        "description": "`key=value`; may be repeated.",
                        "schema": { "type": "string" } } ],
                    "responses": json_ok("200", "The sandboxes, oldest first.", "SandboxList")
                }
            },
            "/v1/run": { "post": {
                "operationId": "runOnce",
                "summary": "One command in a fresh sandbox (a ready one from the server's warm pools when it has one for this spec), destroyed after it: create, exec, network events and destroy in one request. `409 build_mismatch` when `build` is given and the server is another build.",
                "requestBody": json_body("RunBody"),
                "responses": json_ok("200", "The tier, the command's result and the sandbox's egress decisions.", "RunReply")
            } },
            "/v1/sandboxes/{id}": {
                "parameters": [ id_param() ],
                "get": { "operationId": "getSandbox", "summary": "One sandbox.",
                    "responses": json_ok("200", "The sandbox.", "SandboxInfo") },
                "delete": { "operationId": "destroySandbox", "summary": "Destroy a sandbox.",
                    "parameters": [ { "name": "wait", "in": "query", "required": false,
                        "description": "`false`: answer once the sandbox is out of use, its teardown going on in the background (a failure there is logged, not answered). Default `true`.",
                        "schema": { "type": "boolean", "default": true } } ],
                    "responses": with_errors(json!({ "204": { "description": "Destroyed." } })) }
            },
            "/v1/sandboxes/{id}/exec": {
                "parameters": [ id_param() ],
                "post": { "operationId": "exec", "summary": "Run a command to its end.",
                    "requestBody": json_body("ExecBody"),
                    "responses": json_ok("200", "How it ended and its (capped, redacted) output.", "ExecResult") }
            },
            "/v1/sandboxes/{id}/exec/stream": {
                "parameters": [ id_param() ],
                "post": { "operationId": "execStream",
                    "summary": "Run a command, its output as server-sent events: `stdout` and `stderr` ({\"text\"}), then `exit` (the ExecResult) or `error`.",
                    "requestBody": json_body("ExecBody"),
                    "responses": with_errors(json!({ "200": { "description": "The event stream.",
                        "content": { "text/event-stream": { "schema": { "type": "string" } } } } })) }
            },
            "/v1/sandboxes/{id}/files/{path}": {
                "parameters": [ id_param(),
                    { "name": "path", "in": "path", "required": true,
                      "description": "Under /workspace (relative, or absolute under /workspace); may contain slashes.",
                      "schema": { "type": "string" } } ],
                "put": { "operationId": "writeFile", "summary": "Write a file (parents are made).",
                    "requestBody": { "required": true, "content": { "application/octet-stream": {
                        "schema": { "type": "string", "format": "binary" } } } },
                    "responses": with_errors(json!({ "204": { "description": "Written." } })) },
                "get": { "operationId": "readFile", "summary": "Read a file.",
                    "responses": with_errors(json!({ "200": { "description": "Its bytes.",
                        "content": { "application/octet-stream": {
                            "schema": { "type": "string", "format": "binary" } } } } })) }
            },
            "/v1/sandboxes/{id}/list": {
                "parameters": [ id_param(),
                    { "name": "path", "in": "query", "required": false,
                      "description": "A directory under /workspace (default: the workspace).",
                      "schema": { "type": "string" } } ],
                "get": { "operationId": "listFiles", "summary": "List a directory.",
                    "responses": json_ok("200", "Its entries.", "Listing") }
            }
    });
    merge(
        &mut paths,
        json!({
                "/v1/sandboxes/{id}/snapshot": {
                    "parameters": [ id_param() ],
                    "post": { "operationId": "snapshotSandbox",
                        "summary": "Snapshot a sandbox into the server's store (what a snapshot keeps depends on the tier: files, and memory where the tier checkpoints).",
                        "responses": json_ok("201", "The snapshot.", "SnapshotInfo") }
                },
                "/v1/sandboxes/{id}/pause": {
                    "parameters": [ id_param() ],
                    "post": { "operationId": "pauseSandbox",
                        "summary": "Pause every process of a sandbox; the next request that uses it resumes it (409 while another request uses it).",
                        "responses": with_errors(json!({ "204": { "description": "Paused." } })) }
                },
                "/v1/sandboxes/{id}/resume": {
                    "parameters": [ id_param() ],
                    "post": { "operationId": "resumeSandbox", "summary": "Resume a paused sandbox (a running one: nothing happens).",
                        "responses": with_errors(json!({ "204": { "description": "Running." } })) }
                },
                "/v1/sandboxes/{id}/network": {
                    "parameters": [ id_param() ],
                    "put": { "operationId": "setNetworkPolicy",
                        "summary": "Replace the network policy (sandboxes created with a policy other than deny-all); the next connection is decided by the new one.",
                        "requestBody": json_body("NetworkPolicy"),
                        "responses": with_errors(json!({ "204": { "description": "Replaced." } })) }
                },
                "/v1/sandboxes/{id}/network/events": {
                    "parameters": [ id_param() ],
                    "get": { "operationId": "networkEvents", "summary": "The egress decisions so far, oldest first.",
                        "responses": json_ok("200", "The events.", "NetworkEvents") }
                },
                "/v1/sandboxes/{id}/processes": {
                    "parameters": [ id_param() ],
                    "post": { "operationId": "spawnProcess",
                        "summary": "Start a background process (with `tty`: on a terminal). It runs until it exits, is signalled or the sandbox ends; read its output with GET .../output.",
                        "requestBody": json_body("ExecBody"),
                        "responses": json_ok("201", "The process.", "ProcessRef") },
                    "get": { "operationId": "listProcesses", "summary": "The sandbox's processes, running and exited.",
                        "responses": json_ok("200", "The processes.", "ProcessList") }
                },
                "/v1/sandboxes/{id}/processes/{pid}/output": {
                    "parameters": [ id_param(), pid_param() ],
                    "get": { "operationId": "processOutput",
                        "summary": "A process's output as server-sent events: `stdout` and `stderr` ({\"text\"} when UTF-8, else {\"b64\"}), then `exit` (the ExecResult) or `error`. One reader at a time (409 busy); a new reader goes on where the last stopped.",
                        "responses": with_errors(json!({ "200": { "description": "The event stream.",
                            "content": { "text/event-stream": { "schema": { "type": "string" } } } } })) }
                },
                "/v1/sandboxes/{id}/processes/{pid}/stdin": {
                    "parameters": [ id_param(), pid_param() ],
                    "post": { "operationId": "writeStdin", "summary": "Write bytes to a process's stdin (waits while its pipe is full).",
                        "requestBody": { "required": true, "content": { "application/octet-stream": {
                            "schema": { "type": "string", "format": "binary" } } } },
                        "responses": with_errors(json!({ "204": { "description": "Written." } })) },
                    "delete": { "operationId": "closeStdin", "summary": "Close a process's stdin (a terminal gets Ctrl-D).",
                        "responses": with_errors(json!({ "204": { "description": "Closed." } })) }
                },
                "/v1/sandboxes/{id}/processes/{pid}/signal": {
                    "parameters": [ id_param(), pid_param() ],
                    "post": { "operationId": "signalProcess", "summary": "Signal a process's group.",
                        "requestBody": json_body("SignalBody"),
                        "responses": with_errors(json!({ "204": { "description": "Sent." } })) }
                },
                "/v1/sandboxes/{id}/processes/{pid}/resize": {
                    "parameters": [ id_param(), pid_param() ],
                    "post": { "operationId": "resizeTerminal", "summary": "Resize a process's terminal (it gets SIGWINCH).",
                        "requestBody": json_body("ResizeBody"),
                        "responses": with_errors(json!({ "204": { "description": "Resized." } })) }
                },
                "/v1/sandboxes/{id}/processes/{pid}/wait": {
                    "parameters": [ id_param(), pid_param() ],
                    "post": { "operationId": "waitProcess",
                        "summary": "Wait for a process to exit (the body is optional); its unread output up to the spec's cap comes with it. On timeout: 504, and it keeps running.",
                        "requestBody": { "required": false, "content": { "application/json": {
                            "schema": { "$ref": "#/components/schemas/WaitBody" } } } },
                        "responses": json_ok("200", "How it ended.", "ExecResult") }
                },
                "/v1/sandboxes/{id}/ports": {
                    "parameters": [ id_param() ],
                    "post": { "operationId": "publishPort",
                        "summary": "Forward a TCP listener on the server's host (loopback unless the server grants more) to a port inside. Inbound only.",
                        "requestBody": json_body("PublishBody"),
                        "responses": json_ok("201", "Where the server's host listens.", "PublishedPort") },
                    "get": { "operationId": "listPorts", "summary": "The published ports.",
                        "responses": json_ok("200", "The ports.", "PortList") }
                },
                "/v1/sandboxes/{id}/ports/{host}": {
                    "parameters": [ id_param(),
                        { "name": "host", "in": "path", "required": true,
                          "description": "The address publishing answered, e.g. `127.0.0.1:40123`.",
                          "schema": { "type": "string" } } ],
                    "delete": { "operationId": "unpublishPort", "summary": "Close a published port.",
                        "responses": with_errors(json!({ "204": { "description": "Closed." } })) }
                },
                "/v1/snapshots": {
                    "get": { "operationId": "listSnapshots", "summary": "The snapshots in the server's store, oldest first.",
                        "responses": json_ok("200", "The snapshots.", "SnapshotList") },
                    "post": { "operationId": "uploadSnapshot",
                        "summary": "Store a snapshot sent by a client: a tar of `manifest.json` (a snapshot manifest) and `artifacts/NAME` for each artifact it lists, each checked against the manifest's size and SHA-256.",
                        "requestBody": { "required": true, "content": { "application/x-tar": {
                            "schema": { "type": "string", "format": "binary" } } } },
                        "responses": json_ok("201", "The stored snapshot (a new id).", "SnapshotInfo") }
                },
                "/v1/snapshots/{sid}/manifest": {
                    "parameters": [ sid_param() ],
                    "get": { "operationId": "snapshotManifest", "summary": "A snapshot's manifest: its tier, engine, spec and artifacts (names, sizes, SHA-256s).",
                        "responses": with_errors(json!({ "200": { "description": "The manifest.",
                            "content": { "application/json": { "schema": { "type": "object" } } } } })) }
                },
                "/v1/snapshots/{sid}/artifacts/{name}": {
                    "parameters": [ sid_param(),
                        { "name": "name", "in": "path", "required": true, "schema": { "type": "string" } } ],
                    "get": { "operationId": "snapshotArtifact", "summary": "One artifact of a snapshot (checked against the manifest by the store).",
                        "responses": with_errors(json!({ "200": { "description": "Its bytes.",
                            "content": { "application/octet-stream": {
                                "schema": { "type": "string", "format": "binary" } } } } })) }
                },
                "/v1/snapshots/{sid}": {
                    "parameters": [ sid_param() ],
                    "get": { "operationId": "getSnapshot", "summary": "One snapshot.",
                        "responses": json_ok("200", "The snapshot.", "SnapshotInfo") },
                    "delete": { "operationId": "deleteSnapshot", "summary": "Delete a snapshot.",
                        "responses": with_errors(json!({ "204": { "description": "Deleted." } })) }
                },
                "/v1/snapshots/{sid}/restore": {
                    "parameters": [ sid_param() ],
                    "post": { "operationId": "restoreSnapshot", "summary": "A new sandbox from a snapshot (the body is optional).",
                        "requestBody": { "required": false, "content": { "application/json": {
                            "schema": { "$ref": "#/components/schemas/RestoreBody" } } } },
                        "responses": json_ok("201", "The new sandbox.", "SandboxInfo") }
                },
                "/v1/snapshots/{sid}/fork": {
                    "parameters": [ sid_param() ],
                    "post": { "operationId": "forkSnapshot", "summary": "`count` new sandboxes from one snapshot, all or none.",
                        "requestBody": json_body("ForkBody"),
                        "responses": json_ok("201", "The new sandboxes.", "SandboxList") }
                }
        }),
    );
    let mut schemas = json!({
                "Error": { "type": "object", "required": ["error"], "properties": {
                    "error": { "type": "object", "required": ["kind", "message"], "properties": {
                        "kind": { "type": "string" }, "message": { "type": "string" } } } } },
                "CreateSandbox": { "type": "object", "required": ["spec"], "additionalProperties": false,
                    "properties": {
                        "spec": { "type": "object", "description": "The library's SandboxSpec as JSON (at least `language`)." },
                        "tier": { "type": "string", "enum": ["wasm", "container", "gvisor", "microvm"] },
                        "labels": { "type": "object", "additionalProperties": { "type": "string" } },
                        "lifetime": { "$ref": "#/components/schemas/Lifetime" } } }
    });
    merge(
        &mut schemas,
        json!({
                    "Lifetime": { "type": "object", "additionalProperties": false,
                        "description": "How long a sandbox lives: destroyed `ttl_s` seconds after its creation, and `on_idle` after `idle_timeout_s` seconds without a request using it (a paused one resumes on its next request).",
                        "properties": {
                            "ttl_s": { "type": "integer", "minimum": 1 },
                            "idle_timeout_s": { "type": "integer", "minimum": 1 },
                            "on_idle": { "type": "string", "enum": ["pause", "destroy"], "default": "destroy" } } },
                    "SandboxInfo": { "type": "object", "required": ["id", "tier", "labels", "created_at", "state"],
                        "properties": {
                            "id": { "type": "string" }, "tier": { "type": "string" },
                            "labels": { "type": "object", "additionalProperties": { "type": "string" } },
                            "created_at": { "type": "string", "format": "date-time" },
                            "state": { "type": "string", "enum": ["running", "paused"] },
                            "lifetime": { "$ref": "#/components/schemas/Lifetime" },
                            "from_snapshot": { "type": "string" } } },
                    "RestoreBody": { "type": "object", "additionalProperties": false, "properties": {
                        "labels": { "type": "object", "additionalProperties": { "type": "string" } },
                        "lifetime": { "$ref": "#/components/schemas/Lifetime" } } },
                    "ForkBody": { "type": "object", "required": ["count"], "additionalProperties": false, "properties": {
                        "count": { "type": "integer", "minimum": 1, "maximum": 64 },
                        "labels": { "type": "object", "additionalProperties": { "type": "string" } },
                        "lifetime": { "$ref": "#/components/schemas/Lifetime" } } },
                    "SnapshotInfo": { "type": "object", "required": ["id", "tier", "created_at", "bytes"], "properties": {
                        "id": { "type": "string" }, "tier": { "type": "string" },
                        "created_at": { "type": "string", "format": "date-time" },
                        "bytes": { "type": "integer", "minimum": 0 } } },
                    "SnapshotList": { "type": "object", "required": ["snapshots"], "properties": {
                        "snapshots": { "type": "array", "items": { "$ref": "#/components/schemas/SnapshotInfo" } } } },
                    "NetworkPolicy": { "type": "object", "required": ["mode"],
                        "description": "The library's NetworkPolicy as JSON: {\"mode\": \"deny-all\"}, {\"mode\": \"allow\", \"hosts\": [\"api.example.com:443\"], \"cidrs\": [], \"ports\": []} or {\"mode\": \"allow-internet\", \"deny\": [], \"private\": []}.",
                        "properties": { "mode": { "type": "string", "enum": ["deny-all", "allow", "allow-internet"] } } },
                    "NetworkEvents": { "type": "object", "required": ["events"], "properties": {
                        "events": { "type": "array", "items": { "type": "object" } } } },
                    "SandboxList": { "type": "object", "required": ["sandboxes"], "properties": {
                        "sandboxes": { "type": "array", "items": { "$ref": "#/components/schemas/SandboxInfo" } } } },
                    "ExecBody": { "type": "object", "additionalProperties": false,
                        "description": "Exactly one of `argv` and `code`.",
                        "properties": {
                            "argv": { "type": "array", "items": { "type": "string" } },
                            "code": { "type": "string" },
                            "stdin": { "type": "string" },
                            "env": { "type": "object", "additionalProperties": { "type": "string" } },
                            "cwd": { "type": "string" },
                            "timeout_ms": { "type": "integer", "minimum": 0 },
                            "tty": { "type": "object", "required": ["rows", "cols"], "properties": {
                                "rows": { "type": "integer", "minimum": 1 }, "cols": { "type": "integer", "minimum": 1 } },
                                "description": "Spawn only: run on a terminal of this size (stdout and stderr merged)." } } },
                    "ExecResult": { "type": "object", "required": ["exit_code", "stdout", "stderr", "truncated"],
                        "properties": {
                            "exit_code": { "type": ["integer", "null"] },
                            "stdout": { "type": "string" }, "stderr": { "type": "string" },
                            "limit": { "type": ["string", "null"], "description": "The limit that stopped it: wall-time, memory, output, pids, disk..." },
                            "truncated": { "type": "boolean" },
                            "value": { "type": "string" },
                            "outputs": { "type": "array", "description": "A code cell's rich outputs in order (Jupyter's display model).",
                                "items": { "type": "object", "required": ["kind", "data"], "properties": {
                                    "kind": { "type": "string", "enum": ["execute_result", "display_data"] },
                                    "data": { "type": "object", "additionalProperties": { "type": "string" },
                                        "description": "MIME type to content: text as is, images base64, application/json as JSON text." } } } },
                            "error": { "type": "object", "required": ["name", "value", "traceback"], "description": "The exception that ended a code cell.",
                                "properties": { "name": { "type": "string" }, "value": { "type": "string" },
                                    "traceback": { "type": "array", "items": { "type": "string" } } } },
                            "timeline": { "type": "object" } } },
                    "RunBody": { "type": "object", "required": ["spec", "command"], "additionalProperties": false,
                        "properties": {
                            "spec": { "type": "object", "description": "The library's SandboxSpec as JSON (at least `language`)." },
                            "tier": { "type": "string", "enum": ["wasm", "container", "gvisor", "microvm"] },
                            "command": { "$ref": "#/components/schemas/ExecBody" },
                            "build": { "type": "string", "description": "The server's build this client requires (TierList's `build`)." } } },
                    "RunReply": { "type": "object", "required": ["tier", "result", "network"], "properties": {
                        "tier": { "type": "string" },
                        "result": { "$ref": "#/components/schemas/ExecResult" },
                        "network": { "type": "array", "items": { "type": "object" } } } },
                    "TierList": { "type": "object", "required": ["tiers"], "properties": {
                        "build": { "type": "string", "description": "Which build the server is, when it says." },
                        "tiers": { "type": "array", "items": { "type": "object", "required": ["status"],
                            "properties": {
                                "status": { "type": "object", "required": ["tier", "available"], "properties": {
                                    "tier": { "type": "string" }, "available": { "type": "boolean" },
                                    "reason": { "type": "string" }, "fix": { "type": ["string", "null"] } } },
                                "capabilities": { "type": "object" } } } } } },
                    "Listing": { "type": "object", "required": ["entries"], "properties": {
                        "entries": { "type": "array", "items": { "type": "object" } } } }
        }),
    );
    merge(
        &mut schemas,
        json!({
                    "ProcessRef": { "type": "object", "required": ["id"], "properties": {
                        "id": { "type": "integer", "minimum": 0 } } },
                    "ProcessList": { "type": "object", "required": ["processes"], "properties": {
                        "processes": { "type": "array", "items": { "type": "object",
                            "required": ["id", "command", "started_at", "state"], "properties": {
                                "id": { "type": "integer" }, "command": { "type": "string" },
                                "started_at": { "type": "object" },
                                "state": { "type": "object" } } } } } },
                    "SignalBody": { "type": "object", "required": ["signal"], "additionalProperties": false, "properties": {
                        "signal": { "type": "string", "description": "HUP, INT, QUIT, KILL, USR1, USR2 or TERM (also `SIGINT`, `int`, `2`)." } } },
                    "ResizeBody": { "type": "object", "required": ["rows", "cols"], "additionalProperties": false, "properties": {
                        "rows": { "type": "integer", "minimum": 1, "maximum": 65535 },
                        "cols": { "type": "integer", "minimum": 1, "maximum": 65535 } } },
                    "WaitBody": { "type": "object", "additionalProperties": false, "properties": {
                        "timeout_ms": { "type": "integer", "minimum": 0 } } },
                    "PublishBody": { "type": "object", "required": ["sandbox_port"], "additionalProperties": false, "properties": {
                        "sandbox_port": { "type": "integer", "minimum": 1, "maximum": 65535 },
                        "host": { "type": "string", "description": "Default `127.0.0.1:0` (a port the OS picks)." } } },
                    "PublishedPort": { "type": "object", "required": ["sandbox_port", "host"], "properties": {
                        "sandbox_port": { "type": "integer" }, "host": { "type": "string" } } },
                    "PortList": { "type": "object", "required": ["ports"], "properties": {
                        "ports": { "type": "array", "items": { "$ref": "#/components/schemas/PublishedPort" } } } }
        }),
    );
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "agent-sandbox",
            "version": "1",
            "description": "Sandboxes for AI-agent code, as a service. Every request over TCP carries `Authorization: Bearer <token>` (a server may have several clients, each with its own token, seeing only its own sandboxes and snapshots); on a Unix socket the socket's permissions are the check. Errors are JSON: {\"error\": {\"kind\", \"message\"}}."
        },
        "security": [ { "bearer": [] } ],
        "paths": paths,
        "components": {
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer" } },
            "responses": { "Error": { "description": "What went wrong and what to do.",
                "content": { "application/json": { "schema": { "$ref": "#/components/schemas/Error" } } } } },
            "schemas": schemas
        }
    })
}

/// Adds `more`'s entries to the object `into`.
fn merge(into: &mut Value, more: Value) {
    if let (Some(o), Value::Object(m)) = (into.as_object_mut(), more) {
        o.extend(m);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_operation_is_documented_once() {
        let doc = document();
        let paths = doc["paths"].as_object().unwrap();
        let mut documented = Vec::new();
        for (p, item) in paths {
            for m in ["get", "post", "put", "delete", "patch"] {
                if item.get(m).is_some() {
                    documented.push((m.to_string(), p.clone()));
                }
            }
        }
        documented.sort();
        let mut listed: Vec<(String, String)> = OPERATIONS
            .iter()
            .map(|(m, p)| (m.to_string(), p.to_string()))
            .collect();
        listed.sort();
        assert_eq!(documented, listed);
    }
}
