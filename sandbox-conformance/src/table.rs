//! The cross-tier table of `docs/conformance.md`: one row per case, one column per tier.
//!
//! The table sits between [`BEGIN`] and [`END`] in the document; the text around it is kept
//! as written. Each tier's column is made from that tier's results ([`column()`]), or, for a
//! tier that did not run, from its capabilities alone ([`untested_column`]), so that the
//! "n/a" cells are shown for every tier.

use std::collections::BTreeMap;

use sandbox_core::{Capabilities, Tier};

use crate::{cases, known_failure, Outcome};

/// The line before the table.
pub const BEGIN: &str = "<!-- conformance-table:begin (generated: do not edit by hand) -->";
/// The line after the table.
pub const END: &str = "<!-- conformance-table:end -->";

/// The tiers of the table, in column order.
pub const TIERS: [Tier; 5] = [
    Tier::Wasm,
    Tier::Container,
    Tier::Gvisor,
    Tier::Microvm,
    Tier::Unisolated,
];

/// What is wrong with a document's table.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TableError {
    /// The markers are missing or out of order.
    #[error("no `{BEGIN}` ... `{END}` section in the document")]
    NoTable,
    /// A row does not have one cell per column.
    #[error("table row {line} has {found} cells, expected {expected}")]
    BadRow {
        /// The row's line within the table.
        line: usize,
        /// Cells found.
        found: usize,
        /// Cells expected.
        expected: usize,
    },
}

/// The table: for each case id, the cell of each tier.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Table {
    cells: BTreeMap<String, BTreeMap<Tier, String>>,
}

impl Table {
    /// The cell of `case` for `tier`, if the table has one.
    pub fn cell(&self, case: &str, tier: Tier) -> Option<&str> {
        self.cells.get(case)?.get(&tier).map(String::as_str)
    }

    /// The column of `tier`, in case order (missing cells are empty).
    pub fn column(&self, tier: Tier) -> Vec<(&'static str, String)> {
        cases()
            .iter()
            .map(|c| (c.id, self.cell(c.id, tier).unwrap_or("").to_string()))
            .collect()
    }

    /// Whether `tier` has a column with at least one non-empty cell.
    pub fn has_column(&self, tier: Tier) -> bool {
        self.cells
            .values()
            .any(|row| row.get(&tier).is_some_and(|c| !c.is_empty()))
    }

    /// Replaces the column of `tier`.
    pub fn set_column(&mut self, tier: Tier, column: &[(&'static str, String)]) {
        for (id, cell) in column {
            self.cells
                .entry((*id).to_string())
                .or_default()
                .insert(tier, cell.clone());
        }
    }

    /// The markdown table, rows in case order (rows of cases no longer in the table are
    /// dropped), then the list of known failures, between [`BEGIN`] and [`END`].
    pub fn render(&self) -> String {
        let mut s = String::new();
        s.push_str(BEGIN);
        s.push_str("\n| case | the contract |");
        for t in TIERS {
            s.push_str(&format!(" {t} |"));
        }
        s.push_str("\n|---|---|");
        for _ in TIERS {
            s.push_str("---|");
        }
        s.push('\n');
        for c in cases() {
            s.push_str(&format!("| `{}` | {} |", c.id, escape(c.description)));
            for t in TIERS {
                s.push_str(&format!(" {} |", escape(self.cell(c.id, t).unwrap_or(""))));
            }
            s.push('\n');
        }
        s.push_str(
            "\nKnown failures (`sandbox_conformance::KNOWN_FAILURES`), each with its fix:\n\n",
        );
        for k in crate::KNOWN_FAILURES {
            s.push_str(&format!("- {} `{}`: {}\n", k.tier, k.case, escape(k.why)));
        }
        s.push_str(END);
        s
    }

    /// Reads the table out of a document.
    pub fn parse(doc: &str) -> Result<Table, TableError> {
        let (start, end) = section(doc)?;
        let mut table = Table::default();
        let expected = 2 + TIERS.len();
        for (line, row) in doc[start..end].lines().enumerate() {
            let row = row.trim();
            if !row.starts_with('|') || row.starts_with("|---") || row.starts_with("| case |") {
                continue;
            }
            let cells: Vec<&str> = row
                .trim_matches('|')
                .split(" | ")
                .map(|c| c.trim().trim_matches('|').trim())
                .collect();
            if cells.len() != expected {
                return Err(TableError::BadRow {
                    line,
                    found: cells.len(),
                    expected,
                });
            }
            let id = cells[0].trim_matches('`').to_string();
            let row = table.cells.entry(id).or_default();
            for (t, cell) in TIERS.iter().zip(&cells[2..]) {
                row.insert(*t, cell.to_string());
            }
        }
        Ok(table)
    }

    /// `doc` with its table replaced by this one.
    pub fn replace_in(&self, doc: &str) -> Result<String, TableError> {
        let (start, end) = section(doc)?;
        let begin = doc[..start].rfind(BEGIN).ok_or(TableError::NoTable)?;
        Ok(format!(
            "{}{}{}",
            &doc[..begin],
            self.render(),
            &doc[end + END.len()..]
        ))
    }
}

/// The byte range between the end of the [`BEGIN`] line and the start of [`END`].
fn section(doc: &str) -> Result<(usize, usize), TableError> {
    let b = doc.find(BEGIN).ok_or(TableError::NoTable)? + BEGIN.len();
    let e = doc[b..].find(END).ok_or(TableError::NoTable)? + b;
    Ok((b, e))
}

fn escape(s: &str) -> String {
    s.replace('|', "/").replace('\n', " ")
}

/// The cell for one result: `pass`, `n/a: why`, `known fail: why` (a listed failure) or
/// `FAIL: why` (which the tests refuse).
pub fn cell(tier: Tier, case: &str, outcome: &Outcome) -> String {
    match outcome {
        Outcome::Pass => "pass".into(),
        Outcome::NotApplicable(why) => format!("n/a: {why}"),
        Outcome::Fail(why) => match known_failure(tier, case) {
            Some(k) => format!("**known fail**: {}", k.why),
            None => format!("FAIL: {why}"),
        },
    }
}

/// The column of a tier that ran: one cell per result.
pub fn column(tier: Tier, results: &[(&'static str, Outcome)]) -> Vec<(&'static str, String)> {
    results
        .iter()
        .map(|(id, o)| (*id, cell(tier, id, o)))
        .collect()
}

/// The column of a tier that could not run where the table was made: its "n/a" cells, from
/// its capabilities, and `untested (unavailable: ...)` elsewhere.
pub fn untested_column(caps: &Capabilities, why: &str) -> Vec<(&'static str, String)> {
    cases()
        .iter()
        .map(|c| {
            let cell = match c.needs.iter().find_map(|n| n.missing(caps)) {
                Some(na) => format!("n/a: {na}"),
                None => format!("untested: {why}"),
            };
            (c.id, cell)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rendered_table_reads_back() {
        let mut t = Table::default();
        let col: Vec<_> = cases()
            .iter()
            .enumerate()
            .map(|(i, c)| (c.id, format!("cell {i}")))
            .collect();
        t.set_column(Tier::Gvisor, &col);
        let doc = format!("intro\n\n{}\n\nafter\n", t.render());
        let back = Table::parse(&doc).unwrap();
        assert_eq!(back.column(Tier::Gvisor), col);
        assert!(back.has_column(Tier::Gvisor));
        assert!(!back.has_column(Tier::Wasm));
        let again = back.replace_in(&doc).unwrap();
        assert_eq!(again, doc);
        assert!(again.starts_with("intro\n\n") && again.ends_with("\n\nafter\n"));
    }

    #[test]
    fn a_document_without_markers_is_refused() {
        assert!(matches!(
            Table::parse("no table here"),
            Err(TableError::NoTable)
        ));
    }
}
