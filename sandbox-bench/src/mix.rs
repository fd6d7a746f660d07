//! The turn mix: what an agent sends, as concrete code, and the seeded schedule of a session.
//!
//! A session's first turn is always [`TurnKind::Deps`] (the timeline's "dependencies" phase:
//! importing the heaviest data module the target has). The later turns are drawn from
//! [`MIX`] with a seeded generator, so every target sees the same sequence of kinds for the
//! same session index and seed; a target that cannot run a kind skips it (counted, with the
//! reason in the report).

use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, Exp};
use serde::{Deserialize, Serialize};

/// One kind of turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum TurnKind {
    /// First turn only: import the heaviest data module present (pandas, else numpy, else a
    /// set of standard-library modules).
    Deps,
    /// `print(sum(range(10**6)))`.
    PyCompute,
    /// Python writes a 2,000-row CSV to the workspace and aggregates it with pandas (numpy,
    /// or the `csv` module where neither is installed).
    PyData,
    /// A 64 KiB file written to the workspace and read back (the file API on our tiers).
    FileRw,
    /// A JavaScript transform: 5,000 records built, filtered, mapped, reduced, serialised.
    JsTransform,
    /// Shell work: `mkdir`, `ls`, `grep -r`, `sed -i`, and `git init` + `git commit` where
    /// git exists.
    Shell,
    /// A small C file written, compiled with `cc` and run.
    CCompile,
}

/// The drawn part of the mix: each kind and its weight (percent) for turns after the first.
pub const MIX: [(TurnKind, u32); 6] = [
    (TurnKind::PyCompute, 25),
    (TurnKind::PyData, 20),
    (TurnKind::FileRw, 15),
    (TurnKind::JsTransform, 15),
    (TurnKind::Shell, 15),
    (TurnKind::CCompile, 10),
];

impl TurnKind {
    /// Every kind, in report order.
    pub const ALL: [TurnKind; 7] = [
        TurnKind::Deps,
        TurnKind::PyCompute,
        TurnKind::PyData,
        TurnKind::FileRw,
        TurnKind::JsTransform,
        TurnKind::Shell,
        TurnKind::CCompile,
    ];

    /// The kind's name in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            TurnKind::Deps => "deps",
            TurnKind::PyCompute => "py_compute",
            TurnKind::PyData => "py_data",
            TurnKind::FileRw => "file_rw",
            TurnKind::JsTransform => "js_transform",
            TurnKind::Shell => "shell",
            TurnKind::CCompile => "c_compile",
        }
    }

    /// One line saying what the turn does.
    pub fn describe(self) -> &'static str {
        match self {
            TurnKind::Deps => "first turn: import pandas (else numpy, else sqlite3/decimal/email/json/csv/xml)",
            TurnKind::PyCompute => "Python `print(sum(range(10**6)))`",
            TurnKind::PyData => "Python writes a 2,000-row CSV to the workspace, loads it (pandas / numpy / csv) and sums a column by group",
            TurnKind::FileRw => "a 64 KiB file written to the workspace and read back, compared byte for byte",
            TurnKind::JsTransform => "JavaScript: 5,000 records built, filtered, mapped, reduced, JSON-serialised",
            TurnKind::Shell => "sh: mkdir, ls -la, grep -r, sed -i, and git init + add + commit where git exists",
            TurnKind::CCompile => "a 6-line C file written, compiled with `cc -O1` and run",
        }
    }
}

/// The Python data library a target has, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum DataLib {
    /// pandas (with numpy).
    Pandas,
    /// numpy alone.
    Numpy,
    /// Only the standard library (`csv`).
    Csv,
}

impl DataLib {
    /// The library's name.
    pub fn name(self) -> &'static str {
        match self {
            DataLib::Pandas => "pandas",
            DataLib::Numpy => "numpy",
            DataLib::Csv => "csv (stdlib)",
        }
    }

    /// Picks the best library from the modules a probe found (`pandas`, `numpy`).
    pub fn from_found(found: &str) -> DataLib {
        let has = |m: &str| found.split_whitespace().any(|w| w == m);
        if has("pandas") {
            DataLib::Pandas
        } else if has("numpy") {
            DataLib::Numpy
        } else {
            DataLib::Csv
        }
    }
}

/// Python code printing `libs` and the data modules found (input of [`DataLib::from_found`]).
pub const PROBE_LIBS: &str = "import importlib.util as u\nprint('libs', *[m for m in ('pandas', 'numpy') if u.find_spec(m)])";

/// What a target's userland offers the mix, found by its plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Userland {
    /// The Python data library.
    pub data_lib: DataLib,
    /// Whether `git` is on the `PATH` (the shell turn commits when it is).
    pub git: bool,
}

/// One concrete step a target runs for a turn.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Op {
    /// Python source, run in the session's interpreter (or `python3 -c`).
    Python(String),
    /// JavaScript source (QuickJS, or `node -e`).
    Js(String),
    /// A POSIX shell script (`sh -c`).
    Shell(String),
    /// Write `data` to the workspace-relative `path`, read it back, compare.
    FileRoundTrip {
        /// Workspace-relative path.
        path: String,
        /// The bytes.
        data: Vec<u8>,
    },
}

/// A turn ready to run: its kind, the step, and the text its output must contain.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Turn {
    /// The kind.
    pub kind: TurnKind,
    /// The step.
    pub op: Op,
    /// A substring the turn's standard output must contain to count as a success.
    pub expect: String,
}

/// Rows of the CSV the data turn writes.
const CSV_ROWS: u64 = 2000;
/// Records of the JS transform.
const JS_RECORDS: u64 = 5000;

/// The data turn's expected total: the sum of `(i * 3) % 101` over the rows.
fn csv_total() -> u64 {
    (0..CSV_ROWS).map(|i| (i * 3) % 101).sum()
}

/// The JS turn's expected `(count, sum)`.
fn js_expected() -> (u64, u64) {
    let kept: Vec<u64> = (0..JS_RECORDS)
        .map(|i| (i * 7) % 13)
        .filter(|v| *v > 6)
        .collect();
    (kept.len() as u64, kept.iter().map(|v| v * 2).sum())
}

/// The bytes of the file turn `index` writes.
pub fn file_bytes(index: u32) -> Vec<u8> {
    (0..64 * 1024u32)
        .map(|j| ((j.wrapping_mul(31).wrapping_add(index)) % 251) as u8)
        .collect()
}

/// Builds turn `index` (0-based within its session) of `kind` for a target with `userland`.
pub fn turn(kind: TurnKind, index: u32, userland: Userland) -> Turn {
    let (op, expect) = match kind {
        TurnKind::Deps => {
            let code = match userland.data_lib {
                DataLib::Pandas => "import numpy, pandas\nprint('deps-ok', pandas.__version__)",
                DataLib::Numpy => "import numpy\nprint('deps-ok', numpy.__version__)",
                DataLib::Csv => "import sqlite3, decimal, email.parser, json, csv, xml.etree.ElementTree\nprint('deps-ok stdlib')",
            };
            (Op::Python(code.into()), "deps-ok".to_string())
        }
        TurnKind::PyCompute => (
            Op::Python("print(sum(range(10**6)))".into()),
            "499999500000".to_string(),
        ),
        TurnKind::PyData => {
            let write = format!(
                "with open('data.csv', 'w') as f:\n    f.write('id,cat,val\\n')\n    for i in range({CSV_ROWS}):\n        f.write(f'{{i}},{{i % 7}},{{(i * 3) % 101}}\\n')\n"
            );
            let load = match userland.data_lib {
                DataLib::Pandas => "import pandas as pd\ndf = pd.read_csv('data.csv')\ng = df.groupby('cat')['val'].sum()\nprint('data-ok', int(g.sum()))",
                DataLib::Numpy => "import numpy as np\na = np.loadtxt('data.csv', delimiter=',', skiprows=1, dtype=np.int64)\ng = np.bincount(a[:, 1], weights=a[:, 2])\nprint('data-ok', int(g.sum()))",
                DataLib::Csv => "import csv, collections\nc = collections.Counter()\nwith open('data.csv') as f:\n    for r in csv.DictReader(f):\n        c[r['cat']] += int(r['val'])\nprint('data-ok', sum(c.values()))",
            };
            (
                Op::Python(format!("{write}{load}")),
                format!("data-ok {}", csv_total()),
            )
        }
        TurnKind::FileRw => (
            Op::FileRoundTrip {
                path: format!("files/turn-{index}.bin"),
                data: file_bytes(index),
            },
            "file-ok".to_string(),
        ),
        TurnKind::JsTransform => {
            let (n, s) = js_expected();
            // A block of its own: the session's JS state persists, so a second run of the
            // same `const`s at top level would be a redeclaration.
            let code = format!(
                "{{\n\
                 const rows = Array.from({{length: {JS_RECORDS}}}, (_, i) => ({{id: i, v: (i * 7) % 13}}));\n\
                 const out = rows.filter(r => r.v > 6).map(r => ({{id: r.id, v: r.v, w: r.v * 2}}));\n\
                 const s = out.reduce((a, r) => a + r.w, 0);\n\
                 console.log('js-ok ' + JSON.stringify({{n: out.length, s: s}}));\n\
                 }}"
            );
            (Op::Js(code), format!("js-ok {{\"n\":{n},\"s\":{s}}}"))
        }
        TurnKind::Shell => {
            let git = if userland.git {
                "git init -q . 2>/dev/null\ngit add -A\ngit -c user.email=bench@example.invalid -c user.name=bench commit -qm \"turn $T\"\ntest \"$(git rev-list --count HEAD)\" -ge 1\n"
            } else {
                ""
            };
            let script = format!(
                "set -e\nT={index}\nmkdir -p proj/src\ncd proj\necho \"turn $T\" >> log.txt\nprintf 'alpha %s\\nbeta\\n' \"$T\" > src/notes.txt\nls -la . src > /dev/null\ngrep -rq beta .\nsed -i 's/alpha/gamma/' src/notes.txt\ngrep -q \"gamma $T\" src/notes.txt\n{git}echo shell-ok"
            );
            (Op::Shell(script), "shell-ok".to_string())
        }
        TurnKind::CCompile => {
            let script = format!(
                "set -e\nmkdir -p csrc\ncd csrc\ncat > t{index}.c <<'EOF'\n#include <stdio.h>\nint main(void) {{\n    long s = 0;\n    for (int i = 0; i < 1000; i++) s += i;\n    printf(\"c-ok %ld\\n\", s);\n    return 0;\n}}\nEOF\ncc -O1 -o t{index} t{index}.c\n./t{index}\nrm -f t{index} t{index}.c"
            );
            (Op::Shell(script), "c-ok 499500".to_string())
        }
    };
    Turn { kind, op, expect }
}

/// A session's schedule: its kinds in order and the think time before each (milliseconds;
/// the first entry is the session's start offset).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Schedule {
    /// The kinds, the first always [`TurnKind::Deps`].
    pub kinds: Vec<TurnKind>,
    /// Think time before each turn, ms (exponentially distributed, mean `think_ms`; the
    /// first is a uniform start offset in `[0, think_ms)`).
    pub think_ms: Vec<f64>,
}

/// Draws session `session`'s schedule of `turns` turns (at least the deps turn).
pub fn schedule(seed: u64, session: usize, turns: u32, think_ms: f64) -> Schedule {
    let mut rng =
        ChaCha8Rng::seed_from_u64(seed ^ (session as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let total: u32 = MIX.iter().map(|(_, w)| w).sum();
    let mut kinds = vec![TurnKind::Deps];
    let mut think = Vec::new();
    let exp = (think_ms > 0.0)
        .then(|| Exp::new(1.0 / think_ms).ok())
        .flatten();
    think.push(if think_ms > 0.0 {
        rng.random_range(0.0..think_ms)
    } else {
        0.0
    });
    for _ in 1..turns.max(1) {
        let mut pick = rng.random_range(0..total);
        let mut kind = MIX[0].0;
        for (k, w) in MIX {
            if pick < w {
                kind = k;
                break;
            }
            pick -= w;
        }
        kinds.push(kind);
        think.push(exp.map_or(0.0, |e| e.sample(&mut rng)));
    }
    Schedule {
        kinds,
        think_ms: think,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_are_seeded_and_start_with_deps() {
        let a = schedule(7, 3, 20, 100.0);
        let b = schedule(7, 3, 20, 100.0);
        assert_eq!(a.kinds, b.kinds);
        assert_eq!(a.think_ms, b.think_ms);
        assert_eq!(a.kinds[0], TurnKind::Deps);
        assert_eq!(a.kinds.len(), 20);
        assert_ne!(schedule(7, 4, 20, 100.0).kinds, a.kinds);
        assert!(schedule(1, 0, 5, 0.0).think_ms.iter().all(|t| *t == 0.0));
    }

    #[test]
    fn expected_values() {
        assert_eq!(js_expected().0, 5000 * 6 / 13 + 1);
        assert!(csv_total() > 0);
        assert_eq!(DataLib::from_found("libs pandas numpy"), DataLib::Pandas);
        assert_eq!(DataLib::from_found("libs numpy"), DataLib::Numpy);
        assert_eq!(DataLib::from_found("libs"), DataLib::Csv);
    }
}
