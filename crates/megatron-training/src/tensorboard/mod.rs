//! TensorBoard event files (`--tensorboard-dir`): a writer for the training loop's scalars
//! and a reader (tests, `megatron plot`) that checks every record's CRCs. No maintained crate
//! writes tfevents (tensorboard-rs is inactive and on protobuf 2), so framing is here and the
//! two messages are `prost` derives.

pub mod event;
pub mod record;
pub mod training_log;

use event::{Event, Summary, SummaryValue};
use prost::Message;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Appends scalar summaries to `events.out.tfevents.<unix time>.<host>` in a directory.
pub struct SummaryWriter {
    path: PathBuf,
    out: BufWriter<std::fs::File>,
}

impl SummaryWriter {
    /// Creates the directory and a new event file with its version header.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            now() as u64,
            std::process::id()
        ));
        let file = std::fs::OpenOptions::new()
            .create_new(true)
            .write(true)
            .open(&path)?;
        let mut w = SummaryWriter {
            path,
            out: BufWriter::new(file),
        };
        w.write_event(&Event {
            wall_time: now(),
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
        })?;
        w.flush()?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write_event(&mut self, e: &Event) -> std::io::Result<()> {
        record::write_record(&mut self.out, &e.encode_to_vec())
    }

    /// One scalar at `step`.
    pub fn add_scalar(&mut self, tag: &str, value: f64, step: u64) -> std::io::Result<()> {
        self.write_event(&Event {
            wall_time: now(),
            step: step as i64,
            file_version: None,
            summary: Some(Summary {
                value: vec![SummaryValue {
                    tag: tag.into(),
                    simple_value: Some(value as f32),
                }],
            }),
        })
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// A scalar read back: tag, step, value and wall time.
#[derive(Clone, Debug, PartialEq)]
pub struct Scalar {
    pub tag: String,
    pub step: i64,
    pub value: f32,
    pub wall_time: f64,
}

/// Every scalar of an event file, in file order, after checking that it starts with the
/// version header and that every record's CRCs hold.
pub fn read_scalars(path: &Path) -> std::io::Result<Vec<Scalar>> {
    let bad = |msg: String| std::io::Error::new(std::io::ErrorKind::InvalidData, msg);
    let mut r = std::io::BufReader::new(std::fs::File::open(path)?);
    let mut out = Vec::new();
    let mut index = 0usize;
    while let Some(payload) = record::read_record(&mut r)
        .map_err(|e| bad(format!("{}: record {index}: {e}", path.display())))?
    {
        let e = Event::decode(payload.as_slice())
            .map_err(|e| bad(format!("{}: record {index}: {e}", path.display())))?;
        if index == 0 && e.file_version.as_deref() != Some("brain.Event:2") {
            return Err(bad(format!(
                "{}: the first record is not the brain.Event:2 header",
                path.display()
            )));
        }
        for v in e.summary.iter().flat_map(|s| &s.value) {
            if let Some(value) = v.simple_value {
                out.push(Scalar {
                    tag: v.tag.clone(),
                    step: e.step,
                    value,
                    wall_time: e.wall_time,
                });
            }
        }
        index += 1;
    }
    Ok(out)
}
