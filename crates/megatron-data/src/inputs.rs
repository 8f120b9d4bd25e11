//! Input files named on the command line: files as given, and directories expanded to the files
//! inside them with one of the accepted extensions, in sorted order (so runs are reproducible).

use crate::DataError;
use std::path::{Path, PathBuf};

pub const TEXT_AND_JSON: &[&str] = &["txt", "json", "jsonl"];

pub fn expand_inputs(
    inputs: &[String],
    exts: &[&str],
    flag: &str,
) -> Result<Vec<PathBuf>, DataError> {
    let mut out = Vec::new();
    for i in inputs {
        let p = Path::new(i);
        let io = |e: std::io::Error| DataError::Io {
            path: format!("{flag} {i}"),
            source: e,
        };
        if p.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(p)
                .map_err(io)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| {
                    f.is_file()
                        && f.extension()
                            .and_then(|e| e.to_str())
                            .is_some_and(|e| exts.contains(&e))
                })
                .collect();
            if files.is_empty() {
                return Err(DataError::Format {
                    path: format!("{flag} {i}"),
                    msg: format!("directory holds no .{} files", exts.join("/.")),
                });
            }
            files.sort();
            out.extend(files);
        } else if p.is_file() {
            out.push(p.to_path_buf());
        } else {
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no such file or directory",
            )));
        }
    }
    Ok(out)
}

/// JSON lines are recognized by extension; everything else is plain text.
pub fn is_json_lines(p: &Path) -> bool {
    matches!(
        p.extension().and_then(|e| e.to_str()),
        Some("json" | "jsonl")
    )
}
