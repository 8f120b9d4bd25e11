//! Real tables from CSV files, for evaluation and for `megatron tabular`: a header row, then one
//! record per row. Cells that are empty, `NA`, `NaN`, `?`, `null` or `None` are missing. Every
//! error names the file, and the line and column where there is one, so a user can fix the file
//! rather than guess (ragged rows, text in a numeric column, an empty table).

use std::collections::BTreeSet;
use std::fmt;
use std::path::Path;

/// A CSV file as text: its header and its records, each as long as the header.
#[derive(Clone, Debug)]
pub struct CsvTable {
    pub path: String,
    pub header: Vec<String>,
    pub records: Vec<Vec<String>>,
    /// The file line of each record (1-based; the header is line 1).
    pub lines: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct CsvError {
    pub path: String,
    pub line: Option<u64>,
    pub msg: String,
}

impl fmt::Display for CsvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(l) => write!(f, "{}:{l}: {}", self.path, self.msg),
            None => write!(f, "{}: {}", self.path, self.msg),
        }
    }
}

impl std::error::Error for CsvError {}

/// Whether a cell's text marks a missing value.
pub fn is_missing(cell: &str) -> bool {
    matches!(
        cell,
        "" | "NA" | "N/A" | "NaN" | "nan" | "?" | "null" | "NULL" | "None"
    )
}

impl CsvTable {
    pub fn read(path: &Path) -> Result<CsvTable, CsvError> {
        let name = path.display().to_string();
        let err = |line: Option<u64>, msg: String| CsvError {
            path: name.clone(),
            line,
            msg,
        };
        let bytes = std::fs::read(path).map_err(|e| err(None, format!("cannot open: {e}")))?;
        // The csv crate does not count the blank lines it skips: lines come from byte offsets.
        let newlines: Vec<usize> = bytes
            .iter()
            .enumerate()
            .filter(|(_, &b)| b == b'\n')
            .map(|(i, _)| i)
            .collect();
        // A record's position is where the reader started on it, before any blank lines.
        let line_at = |byte: u64| {
            let mut b = byte as usize;
            while b < bytes.len() && matches!(bytes[b], b'\n' | b'\r') {
                b += 1;
            }
            1 + newlines.partition_point(|&n| n < b) as u64
        };
        let mut reader = csv::ReaderBuilder::new()
            .has_headers(true)
            .flexible(true)
            .trim(csv::Trim::All)
            .from_reader(bytes.as_slice());
        let header: Vec<String> = reader
            .headers()
            .map_err(|e| err(Some(1), e.to_string()))?
            .iter()
            .map(str::to_string)
            .collect();
        if header.iter().all(String::is_empty) {
            return Err(err(None, "empty table: no header row".into()));
        }
        let mut seen = BTreeSet::new();
        for h in &header {
            if !seen.insert(h.as_str()) {
                return Err(err(Some(1), format!("column name {h:?} appears twice")));
            }
        }
        let (mut records, mut lines) = (Vec::new(), Vec::new());
        for rec in reader.records() {
            let rec = rec.map_err(|e| {
                let line = e.position().map(|p| line_at(p.byte()));
                err(line, e.to_string())
            })?;
            let line = rec.position().map_or(0, |p| line_at(p.byte()));
            if rec.len() == 1 && rec.get(0) == Some("") {
                continue; // a blank line
            }
            if rec.len() != header.len() {
                return Err(err(
                    Some(line),
                    format!(
                        "ragged row: {} fields where the header has {} columns",
                        rec.len(),
                        header.len()
                    ),
                ));
            }
            records.push(rec.iter().map(str::to_string).collect());
            lines.push(line);
        }
        if records.is_empty() {
            return Err(err(None, "empty table: a header but no rows".into()));
        }
        Ok(CsvTable {
            path: name,
            header,
            records,
            lines,
        })
    }

    /// The index of column `name`, or an error listing the columns there are.
    pub fn column(&self, name: &str) -> Result<usize, CsvError> {
        self.header
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| CsvError {
                path: self.path.clone(),
                line: None,
                msg: format!(
                    "no column named {name:?} (columns: {})",
                    self.header.join(", ")
                ),
            })
    }

    /// Column `c` as numbers (NaN where missing), or an error naming the first cell that is
    /// not a number.
    pub fn numeric(&self, c: usize) -> Result<Vec<f32>, CsvError> {
        self.records
            .iter()
            .zip(&self.lines)
            .map(|(r, &line)| {
                let s = r[c].as_str();
                if is_missing(s) {
                    return Ok(f32::NAN);
                }
                match s.parse::<f32>() {
                    Ok(v) if v.is_finite() => Ok(v),
                    _ => Err(CsvError {
                        path: self.path.clone(),
                        line: Some(line),
                        msg: format!(
                            "column {:?}: {s:?} is not a number (list the column in --categorical if it holds categories)",
                            self.header[c]
                        ),
                    }),
                }
            })
            .collect()
    }

    /// The distinct non-missing texts of column `c`, sorted (numerically when they all parse
    /// as numbers).
    pub fn levels(&self, c: usize) -> Vec<String> {
        let set: BTreeSet<&str> = self
            .records
            .iter()
            .map(|r| r[c].as_str())
            .filter(|s| !is_missing(s))
            .collect();
        let mut v: Vec<String> = set.into_iter().map(str::to_string).collect();
        if v.iter().all(|s| s.parse::<f64>().is_ok()) {
            v.sort_by(|a, b| a.parse::<f64>().unwrap().total_cmp(&b.parse().unwrap()));
        }
        v
    }

    /// Column `c` as codes into `levels` (NaN where missing or not among them).
    pub fn codes(&self, c: usize, levels: &[String]) -> Vec<f32> {
        self.records
            .iter()
            .map(|r| {
                levels
                    .iter()
                    .position(|l| *l == r[c])
                    .map_or(f32::NAN, |i| i as f32)
            })
            .collect()
    }
}
