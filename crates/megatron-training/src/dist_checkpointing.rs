//! Sharded checkpoints (Megatron's `dist_checkpointing`, format `megatron-rs/2`): every rank
//! writes its own safetensors file of the tensor pieces it owns, each piece once over the whole
//! world (TP-replicated tensors by TP rank 0; state replicated over DP split between the DP
//! ranks; the distributed optimizer's state as the shards it lives in), plus a fragment listing
//! them. Rank 0 then merges the fragments into the manifest (`metadata.json`, written last, with
//! a crc32c of every file) and only then renames the directory into place and updates the
//! tracker. A loading rank maps the files and reads exactly the rectangles its own shards cover
//! under its (possibly different) layout.
//!
//! Tensors are addressed as 2-D `[rows, cols]` (1-D tensors as one row; `params::view2d`); a
//! piece is a rectangle `offset`/`shape` of its global tensor.

use crate::{io_err, TrainError};
use megatron_core::params::{view2d, GlobalSegment};
use megatron_core::ParamMeta;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};

/// One rectangle of a global tensor stored in one file.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub file: String,
    pub key: String,
    /// `[row, col]` of the rectangle in the 2-D view of the global tensor.
    pub offset: [usize; 2],
    /// `[rows, cols]`.
    pub shape: [usize; 2],
}

/// A file of a checkpoint and what the manifest knows of it.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct FileEntry {
    pub file: String,
    pub bytes: u64,
    /// `None` in `megatron-rs/1` checkpoints, which recorded sizes only.
    #[serde(default)]
    pub crc32c: Option<u32>,
    /// The world rank that wrote it.
    #[serde(default)]
    pub rank: usize,
}

/// The layout a checkpoint was saved from (reported by `megatron checkpoint inspect`; loading
/// works under any layout).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct SavedLayout {
    pub world: usize,
    pub tensor_model_parallel: usize,
    pub pipeline_model_parallel: usize,
    pub virtual_pipeline: usize,
    pub data_parallel: usize,
    pub distributed_optimizer: bool,
}

/// What one rank wrote: its file and its pieces (tensor name, global shape, piece).
#[derive(Serialize, Deserialize)]
struct Fragment {
    file: FileEntry,
    pieces: Vec<(String, Vec<usize>, Piece)>,
}

pub(crate) fn shard_file(rank: usize) -> String {
    format!("shard_{rank:05}.safetensors")
}

fn fragment_file(rank: usize) -> String {
    format!("shard_{rank:05}.json")
}

fn ckpt_err(path: &Path, msg: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.display().to_string(),
        msg: msg.into(),
    }
}

/// A piece to write: tensor name, global shape, where it sits in the global tensor, and the
/// local tensor (`data` starts at local element `base`) whose rows it copies.
pub(crate) struct PieceSrc<'a> {
    pub tensor: String,
    pub shape: Vec<usize>,
    pub segment: GlobalSegment,
    /// Borrowed from the model and optimizer, or widened from a bf16 moment.
    pub data: std::borrow::Cow<'a, [f32]>,
    pub base: usize,
}

impl PieceSrc<'_> {
    fn rows(&self) -> impl Iterator<Item = &[f32]> {
        let s = self.segment;
        (0..s.rows).map(move |i| {
            let at = s.local_start + i * s.local_stride - self.base;
            &self.data[at..at + s.cols]
        })
    }
    fn key(&self) -> String {
        format!("{}@{},{}", self.tensor, self.segment.row, self.segment.col)
    }
}

/// A staged copy of a piece (`--async-save`: training goes on changing the original).
pub(crate) struct Blob {
    pub tensor: String,
    pub shape: Vec<usize>,
    pub segment: GlobalSegment,
    pub data: Vec<f32>,
}

impl Blob {
    /// A copy of `p`, into `reuse`'s allocation when given (staging buffers are kept from
    /// one save to the next: a fresh allocation's first touch costs more than the copy).
    pub fn copy_of(p: &PieceSrc, reuse: Option<Vec<f32>>) -> Blob {
        use rayon::prelude::*;
        let s = p.segment;
        let mut data = reuse.unwrap_or_default();
        if data.len() != s.rows * s.cols {
            data.clear();
            data.resize(s.rows * s.cols, 0.0);
        }
        // Rows copied on every core: the copy is the whole stall of an async save.
        if s.cols > 0 {
            data.par_chunks_mut(s.cols).enumerate().for_each(|(i, d)| {
                let at = s.local_start + i * s.local_stride - p.base;
                d.copy_from_slice(&p.data[at..at + s.cols]);
            });
        }
        Blob {
            tensor: p.tensor.clone(),
            shape: p.shape.clone(),
            segment: p.segment,
            data,
        }
    }

    pub fn as_src(&self) -> PieceSrc<'_> {
        PieceSrc {
            tensor: self.tensor.clone(),
            shape: self.shape.clone(),
            segment: GlobalSegment {
                local_start: 0,
                local_stride: self.segment.cols,
                ..self.segment
            },
            data: std::borrow::Cow::Borrowed(&self.data),
            base: 0,
        }
    }
}

/// The bytes of f32 values as stored (little-endian).
fn le_bytes(x: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: f32 has no padding and any bit pattern is a valid u8; on a little-endian
        // target its in-memory bytes are its little-endian encoding. The slice lives as long
        // as `x`.
        std::borrow::Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x))
        })
    }
    #[cfg(not(target_endian = "little"))]
    {
        std::borrow::Cow::Owned(x.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

/// Writes this rank's safetensors file straight from the pieces' rows (no copy of the shard:
/// memory beyond the pieces is a write buffer), with its crc32c computed on the way, then the
/// fragment listing the pieces; both synced.
pub(crate) fn write_rank_shard(
    dir: &Path,
    rank: usize,
    pieces: &[PieceSrc],
) -> Result<(), TrainError> {
    use std::io::Write;
    let file = shard_file(rank);
    let path = dir.join(&file);
    let mut header = serde_json::Map::new();
    let mut at = 0usize;
    for p in pieces {
        let n = p.segment.rows * p.segment.cols * 4;
        header.insert(
            p.key(),
            serde_json::json!({
                "dtype": "F32",
                "shape": [p.segment.rows, p.segment.cols],
                "data_offsets": [at, at + n],
            }),
        );
        at += n;
    }
    let mut json = serde_json::to_vec(&header).map_err(|e| ckpt_err(&path, e.to_string()))?;
    // The data starts 8-byte aligned, as safetensors' own writer pads its header.
    while (8 + json.len()) % 8 != 0 {
        json.push(b' ');
    }
    let f = std::fs::File::create(&path).map_err(io_err(&path))?;
    let mut w = std::io::BufWriter::with_capacity(4 << 20, f);
    let mut crc = 0u32;
    let mut put = |w: &mut std::io::BufWriter<std::fs::File>, b: &[u8]| -> Result<(), TrainError> {
        crc = crc32c::crc32c_append(crc, b);
        w.write_all(b).map_err(io_err(&path))
    };
    put(&mut w, &(json.len() as u64).to_le_bytes())?;
    put(&mut w, &json)?;
    for p in pieces {
        for row in p.rows() {
            put(&mut w, &le_bytes(row))?;
        }
    }
    let f = w.into_inner().map_err(|e| ckpt_err(&path, e.to_string()))?;
    f.sync_all().map_err(io_err(&path))?;
    let len = (8 + json.len() + at) as u64;
    let fragment = Fragment {
        file: FileEntry {
            file: file.clone(),
            bytes: len,
            crc32c: Some(crc),
            rank,
        },
        pieces: pieces
            .iter()
            .map(|p| {
                let s = p.segment;
                let piece = Piece {
                    file: file.clone(),
                    key: p.key(),
                    offset: [s.row, s.col],
                    shape: [s.rows, s.cols],
                };
                (p.tensor.clone(), p.shape.clone(), piece)
            })
            .collect(),
    };
    let fpath = dir.join(fragment_file(rank));
    let json = serde_json::to_vec(&fragment).map_err(|e| ckpt_err(&fpath, e.to_string()))?;
    crate::checkpointing::write_synced(&fpath, &json)
}

/// Size and crc32c of a file, read in 8 MiB blocks.
pub(crate) fn file_crc(path: &Path) -> Result<(u64, u32), TrainError> {
    let mut f = std::fs::File::open(path).map_err(io_err(path))?;
    let mut buf = vec![0u8; 8 << 20];
    let (mut crc, mut len) = (0u32, 0u64);
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            return Ok((len, crc));
        }
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        len += n as u64;
    }
}

/// Rank 0, once every rank has written: merges the fragments of `world` ranks into the tensor
/// list (each tensor's pieces must cover it exactly) and the file list, and removes the
/// fragments.
pub(crate) fn merge_fragments(
    dir: &Path,
    world: usize,
) -> Result<(Vec<crate::checkpointing::TensorEntry>, Vec<FileEntry>), TrainError> {
    let mut tensors: BTreeMap<String, (Vec<usize>, Vec<Piece>)> = BTreeMap::new();
    let mut files = Vec::with_capacity(world);
    for rank in 0..world {
        let fpath = dir.join(fragment_file(rank));
        let text = std::fs::read(&fpath).map_err(io_err(&fpath))?;
        let f: Fragment =
            serde_json::from_slice(&text).map_err(|e| ckpt_err(&fpath, e.to_string()))?;
        files.push(f.file);
        for (name, shape, piece) in f.pieces {
            tensors
                .entry(name)
                .or_insert_with(|| (shape, Vec::new()))
                .1
                .push(piece);
        }
    }
    let mut entries = Vec::with_capacity(tensors.len());
    for (name, (shape, pieces)) in tensors {
        let (r, c) = view2d(&shape);
        let area: usize = pieces.iter().map(|p| p.shape[0] * p.shape[1]).sum();
        if area != r * c {
            return Err(ckpt_err(
                dir,
                format!(
                    "tensor {name}: the ranks wrote {area} of its {} elements",
                    r * c
                ),
            ));
        }
        entries.push(crate::checkpointing::TensorEntry {
            name,
            shape,
            dtype: "F32".into(),
            file: String::new(),
            global_offset: Vec::new(),
            pieces,
        });
    }
    for rank in 0..world {
        let _ = std::fs::remove_file(dir.join(fragment_file(rank)));
    }
    Ok((entries, files))
}

/// An open checkpoint: its manifest and its files, mapped on first use.
pub struct CheckpointReader {
    pub dir: PathBuf,
    pub meta: crate::checkpointing::CheckpointMeta,
    entries: HashMap<String, usize>,
    maps: HashMap<String, MappedFile>,
}

struct MappedFile {
    map: memmap2::Mmap,
    /// Byte range of each key's data.
    keys: HashMap<String, std::ops::Range<usize>>,
}

impl CheckpointReader {
    /// Reads the manifest of `dir` (an `iter_NNNNNNN` directory).
    pub fn open(dir: &Path) -> Result<Self, TrainError> {
        let meta = crate::checkpointing::read_manifest(dir)?;
        let entries = meta
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(CheckpointReader {
            dir: dir.to_path_buf(),
            meta,
            entries,
            maps: HashMap::new(),
        })
    }

    /// Every file the manifest lists exists with its recorded size and checksum.
    pub fn verify(&self) -> Result<(), TrainError> {
        for f in &self.meta.files {
            let path = self.dir.join(&f.file);
            let len = std::fs::metadata(&path)
                .map_err(|e| ckpt_err(&path, format!("missing file: {e}")))?
                .len();
            if len != f.bytes {
                return Err(ckpt_err(
                    &path,
                    format!(
                        "truncated or altered: {len} bytes, the manifest records {}",
                        f.bytes
                    ),
                ));
            }
            if let Some(want) = f.crc32c {
                let (_, crc) = file_crc(&path)?;
                if crc != want {
                    return Err(ckpt_err(
                        &path,
                        format!(
                            "checksum mismatch: crc32c {crc:08x}, the manifest records {want:08x}"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    fn mapped(&mut self, file: &str) -> Result<&MappedFile, TrainError> {
        if !self.maps.contains_key(file) {
            let path = self.dir.join(file);
            let f = std::fs::File::open(&path)
                .map_err(|e| ckpt_err(&path, format!("cannot open: {e}")))?;
            // SAFETY: checkpoint files are written once, under a temporary directory name, and
            // never modified after the manifest names them; a concurrent writer would have to
            // delete and recreate them, which leaves this mapping intact.
            let map = unsafe { memmap2::Mmap::map(&f) }.map_err(io_err(&path))?;
            let st = SafeTensors::deserialize(&map)
                .map_err(|e| ckpt_err(&path, format!("not a valid safetensors file: {e}")))?;
            let base = map.as_ptr() as usize;
            let mut keys = HashMap::new();
            for (k, v) in st.tensors() {
                if v.dtype() != Dtype::F32 {
                    return Err(ckpt_err(
                        &path,
                        format!("tensor {k} is {:?}, not F32", v.dtype()),
                    ));
                }
                let start = v.data().as_ptr() as usize - base;
                keys.insert(k, start..start + v.data().len());
            }
            self.maps.insert(file.to_string(), MappedFile { map, keys });
        }
        Ok(&self.maps[file])
    }

    /// Whether the checkpoint has a tensor of this name.
    pub fn has(&self, tensor: &str) -> bool {
        self.entries.contains_key(tensor)
    }

    /// Global shape of a tensor.
    pub fn shape(&self, tensor: &str) -> Option<&[usize]> {
        self.entries
            .get(tensor)
            .map(|&i| self.meta.tensors[i].shape.as_slice())
    }

    /// Fills `out` (local elements `base..base + out.len()` of a shard) from the pieces that
    /// cover `segments` of `tensor`; every element must be covered.
    pub fn read_segments(
        &mut self,
        tensor: &str,
        segments: &[GlobalSegment],
        out: &mut [f32],
        base: usize,
    ) -> Result<(), TrainError> {
        let i = *self
            .entries
            .get(tensor)
            .ok_or_else(|| ckpt_err(&self.dir, format!("has no tensor {tensor}")))?;
        let (_, gc) = view2d(&self.meta.tensors[i].shape);
        let pieces = self.meta.tensors[i].pieces.clone();
        let mut covered = 0usize;
        for seg in segments {
            for p in &pieces {
                let r0 = seg.row.max(p.offset[0]);
                let r1 = (seg.row + seg.rows).min(p.offset[0] + p.shape[0]);
                let c0 = seg.col.max(p.offset[1]);
                let c1 = (seg.col + seg.cols).min(p.offset[1] + p.shape[1]);
                if r0 >= r1 || c0 >= c1 {
                    continue;
                }
                let dir = self.dir.clone();
                let f = self.mapped(&p.file)?;
                let range = f.keys.get(&p.key).cloned().ok_or_else(|| {
                    ckpt_err(&dir.join(&p.file), format!("has no piece {}", p.key))
                })?;
                let data = &f.map[range];
                if data.len() != p.shape[0] * p.shape[1] * 4 {
                    return Err(ckpt_err(
                        &dir.join(&p.file),
                        format!("piece {} has the wrong size", p.key),
                    ));
                }
                for r in r0..r1 {
                    let src = ((r - p.offset[0]) * p.shape[1] + (c0 - p.offset[1])) * 4;
                    let dst =
                        seg.local_start + (r - seg.row) * seg.local_stride + (c0 - seg.col) - base;
                    for (o, b) in out[dst..dst + (c1 - c0)]
                        .iter_mut()
                        .zip(data[src..src + (c1 - c0) * 4].chunks_exact(4))
                    {
                        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    }
                    covered += c1 - c0;
                }
            }
        }
        let want: usize = segments.iter().map(|s| s.rows * s.cols).sum();
        if covered != want {
            return Err(ckpt_err(
                &self.dir,
                format!(
                    "tensor {tensor}: the pieces cover {covered} of the {want} elements asked for"
                ),
            ));
        }
        let _ = gc;
        Ok(())
    }

    /// Local elements `local` of a shard described by `m` (this rank's TP shard of `tensor`).
    pub fn read_local(
        &mut self,
        tensor: &str,
        m: &ParamMeta,
        local: std::ops::Range<usize>,
        out: &mut [f32],
    ) -> Result<(), TrainError> {
        match self.shape(tensor) {
            Some(s) if s == m.shape.as_slice() => {}
            Some(s) => {
                return Err(ckpt_err(
                    &self.dir,
                    format!(
                        "tensor {tensor} has shape {s:?}, the model needs {:?}",
                        m.shape
                    ),
                ))
            }
            None => return Err(ckpt_err(&self.dir, format!("has no tensor {tensor}"))),
        }
        let base = local.start;
        let segs = m.global_segments(local, m.tp_rank);
        self.read_segments(tensor, &segs, out, base)
    }

    /// A whole tensor (tools, tests, generation).
    pub fn read_whole(&mut self, tensor: &str) -> Result<Vec<f32>, TrainError> {
        let shape = self
            .shape(tensor)
            .ok_or_else(|| ckpt_err(&self.dir, format!("has no tensor {tensor}")))?
            .to_vec();
        let (r, c) = view2d(&shape);
        let mut out = vec![0.0f32; r * c];
        let seg = GlobalSegment {
            row: 0,
            col: 0,
            rows: r,
            cols: c,
            local_start: 0,
            local_stride: c,
        };
        self.read_segments(tensor, &[seg], &mut out, 0)?;
        Ok(out)
    }
}
