//! `megatron preprocess`: Megatron's `tools/preprocess_data.py` — JSON lines (or plain text
//! files) to `<output-prefix>_<key>_document.{bin,idx}`, or with `--split-sentences` one
//! sequence per sentence (documents still delimited) in `<output-prefix>_<key>_sentence.*`.
//!
//! Streaming and parallel: the input is read in chunks of at most `CHUNK_BYTES` per worker,
//! each chunk's documents are tokenized in parallel on `workers` threads, and written in input
//! order before the next chunk is read. Memory therefore stays below about
//! `2 * workers * CHUNK_BYTES` of text plus its tokens, whatever the input size.

use crate::indexed_dataset::{IndexedDatasetBuilder, TokenDType};
use crate::tokenizer::Tokenizer;
use crate::DataError;
use rayon::prelude::*;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Text read per worker and chunk.
const CHUNK_BYTES: usize = 4 << 20;

#[derive(Clone, Debug)]
pub struct PreprocessConfig {
    /// JSON-lines files (`.json`, `.jsonl`), plain text files, or directories of either.
    pub input: Vec<String>,
    pub json_keys: Vec<String>,
    pub output_prefix: String,
    pub append_eod: bool,
    /// One sequence per sentence (BERT's and T5's datasets read sentences).
    pub split_sentences: bool,
    pub workers: usize,
    pub skip_bad_lines: bool,
    /// Print progress every this many documents (0: never).
    pub log_interval: usize,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct PreprocessStats {
    pub documents: u64,
    pub tokens: u64,
    pub bytes: u64,
    pub skipped_bad_lines: u64,
    pub empty_documents: u64,
    pub seconds: f64,
}

/// One unit of input: a JSON line (with its file and line number for errors) or a whole file.
struct Record {
    file: std::sync::Arc<str>,
    line: usize,
    text: Vec<u8>,
    json: bool,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Tokenized output of one record: per JSON key its sequences (one, or one per sentence), or
/// `Err` for a bad line.
type Tokenized = Result<Vec<Vec<Vec<u32>>>, DataError>;

fn tokenize(
    rec: &Record,
    keys: &[String],
    tok: &dyn Tokenizer,
    append_eod: bool,
    split_sentences: bool,
) -> Tokenized {
    let bad = |msg: String| DataError::Format {
        path: format!("{}:{}", rec.file, rec.line),
        msg,
    };
    let texts: Vec<String> = if rec.json {
        let v: serde_json::Value =
            serde_json::from_slice(&rec.text).map_err(|e| bad(format!("malformed JSON: {e}")))?;
        keys.iter()
            .map(|k| match v.get(k) {
                Some(serde_json::Value::String(s)) => Ok(s.clone()),
                Some(_) => Err(bad(format!("key '{k}' is not a string"))),
                None => Err(bad(format!("missing key '{k}' (--json-keys)"))),
            })
            .collect::<Result<_, _>>()?
    } else {
        vec![String::from_utf8(rec.text.clone())
            .map_err(|e| bad(format!("not UTF-8 (byte {})", e.utf8_error().valid_up_to())))?]
    };
    texts
        .iter()
        .map(|t| {
            // A token the tokenizer refuses (e.g. an id beyond NullTokenizer's vocabulary) is a
            // bad line: named by file and line, skippable with --skip-bad-lines.
            let parts = if split_sentences {
                crate::sentences::split_sentences(t)
            } else {
                vec![t.as_str()]
            };
            let mut seqs = Vec::with_capacity(parts.len());
            for p in parts {
                let ids = tok.encode(p).map_err(|e| bad(e.to_string()))?;
                if !ids.is_empty() || !split_sentences {
                    seqs.push(ids);
                }
            }
            // Megatron appends the end-of-document token to the document's last sequence.
            if let Some(last) = seqs.last_mut().filter(|s| append_eod && !s.is_empty()) {
                last.push(tok.eod());
            }
            Ok(seqs)
        })
        .collect()
}

/// Reads records until about `budget` bytes are collected (whole lines / files).
struct RecordReader {
    files: Vec<PathBuf>,
    next_file: usize,
    current: Option<(std::sync::Arc<str>, BufReader<std::fs::File>, usize)>,
}

impl RecordReader {
    fn next_chunk(&mut self, budget: usize, out: &mut Vec<Record>) -> Result<(), DataError> {
        let mut bytes = 0;
        while bytes < budget {
            if self.current.is_none() {
                let Some(p) = self.files.get(self.next_file).cloned() else {
                    return Ok(());
                };
                self.next_file += 1;
                let name: std::sync::Arc<str> = p.display().to_string().into();
                let mut f = std::fs::File::open(&p).map_err(io(&p))?;
                if !crate::inputs::is_json_lines(&p) {
                    let mut text = Vec::new();
                    f.read_to_end(&mut text).map_err(io(&p))?;
                    bytes += text.len();
                    out.push(Record {
                        file: name,
                        line: 1,
                        text,
                        json: false,
                    });
                    continue;
                }
                self.current = Some((name, BufReader::with_capacity(1 << 20, f), 0));
            }
            let (name, reader, line) = self.current.as_mut().expect("set above");
            let mut buf = Vec::new();
            let n = reader
                .read_until(b'\n', &mut buf)
                .map_err(|e| DataError::Io {
                    path: name.to_string(),
                    source: e,
                })?;
            if n == 0 {
                self.current = None;
                continue;
            }
            *line += 1;
            if buf.iter().all(|b| b.is_ascii_whitespace()) {
                continue;
            }
            bytes += n;
            out.push(Record {
                file: name.clone(),
                line: *line,
                text: buf,
                json: true,
            });
        }
        Ok(())
    }
}

/// Runs the whole preprocessing; the outputs appear only when everything succeeded.
pub fn preprocess(
    cfg: &PreprocessConfig,
    tok: &dyn Tokenizer,
) -> Result<PreprocessStats, DataError> {
    let files = crate::inputs::expand_inputs(&cfg.input, crate::inputs::TEXT_AND_JSON, "--input")?;
    let dtype = TokenDType::optimal(tok.vocab_size());
    let mut builders: Vec<IndexedDatasetBuilder> = cfg
        .json_keys
        .iter()
        .map(|k| {
            let level = if cfg.split_sentences {
                "sentence"
            } else {
                "document"
            };
            IndexedDatasetBuilder::new(&format!("{}_{k}_{level}", cfg.output_prefix), dtype)
        })
        .collect::<Result<_, _>>()?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(cfg.workers.max(1))
        .build()
        .map_err(|e| DataError::Format {
            path: "--workers".into(),
            msg: e.to_string(),
        })?;
    let mut reader = RecordReader {
        files,
        next_file: 0,
        current: None,
    };
    // One tokenizer per worker thread where the tokenizer asks for it, built on first use.
    type Slot = std::sync::Mutex<Option<Option<Box<dyn Tokenizer>>>>;
    let workers_tok: Vec<Slot> = (0..cfg.workers.max(1))
        .map(|_| std::sync::Mutex::new(None))
        .collect();
    let mut stats = PreprocessStats::default();
    let start = Instant::now();
    let mut last_log = 0u64;
    let mut records = Vec::new();
    loop {
        records.clear();
        reader.next_chunk(CHUNK_BYTES * cfg.workers.max(1), &mut records)?;
        if records.is_empty() {
            break;
        }
        let results: Vec<Tokenized> = pool.install(|| {
            records
                .par_iter()
                .map(|r| {
                    let slot = &workers_tok
                        [rayon::current_thread_index().unwrap_or(0) % workers_tok.len()];
                    let mut guard = slot.lock().expect("tokenizer slot");
                    let t = guard.get_or_insert_with(|| tok.for_worker());
                    tokenize(
                        r,
                        &cfg.json_keys,
                        t.as_deref().unwrap_or(tok),
                        cfg.append_eod,
                        cfg.split_sentences,
                    )
                })
                .collect()
        });
        for (rec, res) in records.iter().zip(results) {
            stats.bytes += rec.text.len() as u64;
            match res {
                Ok(per_key) => {
                    if per_key.iter().flatten().all(|ids| ids.is_empty()) {
                        stats.empty_documents += 1;
                        continue;
                    }
                    for (b, seqs) in builders.iter_mut().zip(&per_key) {
                        for ids in seqs {
                            b.add_item(ids).map_err(|e| DataError::Format {
                                path: format!("{}:{}", rec.file, rec.line),
                                msg: e.to_string(),
                            })?;
                            stats.tokens += ids.len() as u64;
                        }
                        b.end_document();
                    }
                    stats.documents += 1;
                }
                Err(e) if cfg.skip_bad_lines && matches!(e, DataError::Format { .. }) => {
                    stats.skipped_bad_lines += 1;
                    eprintln!("skipped: {e}");
                }
                Err(e) => return Err(e),
            }
        }
        if cfg.log_interval > 0 && stats.documents - last_log >= cfg.log_interval as u64 {
            last_log = stats.documents;
            let s = start.elapsed().as_secs_f64();
            eprintln!(
                "processed {} documents ({:.0} docs/s, {:.2} MB/s)",
                stats.documents,
                stats.documents as f64 / s,
                stats.bytes as f64 / s / 1e6
            );
        }
    }
    for b in builders {
        b.finalize()?;
    }
    stats.seconds = start.elapsed().as_secs_f64();
    Ok(stats)
}

/// Megatron's `tools/merge_datasets.py`: concatenates datasets into `output_prefix`.
pub fn merge_datasets(inputs: &[String], output_prefix: &str) -> Result<(), DataError> {
    let first =
        crate::indexed_dataset::IndexedDataset::open(inputs.first().ok_or(DataError::Format {
            path: "--input".into(),
            msg: "no dataset to merge".into(),
        })?)?;
    let mut b = IndexedDatasetBuilder::new(output_prefix, first.dtype())?;
    b.add_index(&first)?;
    for p in &inputs[1..] {
        b.add_index(&crate::indexed_dataset::IndexedDataset::open(p)?)?;
    }
    b.finalize()
}
