//! Megatron-LM's `--ckpt-format torch_dist` checkpoints, read without PyTorch: a
//! `torch.distributed.checkpoint` directory (`iter_NNNNNNN/`: `.metadata`, `__R_I.distcp` files,
//! `metadata.json` naming the backend). `.metadata` is a pickled `Metadata`: for every key its
//! global size and chunks (`state_dict_metadata`), and where each chunk is stored
//! (`storage_data`: a `MetadataIndex(fqn, offset)` to a `_StorageInfo(relative_path, offset,
//! length)`). Each stored item is a `torch.save` archive of one chunk, or of one object (the
//! `BytesIO` items: megatron-core's common state, `_extra_state`s). Any layout's checkpoint reads
//! the same: chunks are placed by their global offsets.

use super::pickle::{unpickle, PyValue};
use super::torch_save::{TorchArchive, TorchTensor};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// One stored chunk of a tensor (or one object, without an offset).
#[derive(Clone, Debug)]
struct Stored {
    offset: Option<Vec<usize>>,
    /// The chunk's extent, from `state_dict_metadata` (to skip chunks a region misses unread).
    extent: Option<Vec<usize>>,
    file: String,
    at: usize,
    len: usize,
}

/// An opened torch_dist checkpoint.
pub struct TorchDistCheckpoint {
    pub dir: PathBuf,
    /// Global sizes of the tensors, by key.
    pub sizes: BTreeMap<String, Vec<usize>>,
    stored: HashMap<String, Vec<Stored>>,
    files: HashMap<String, memmap2::Mmap>,
}

impl TorchDistCheckpoint {
    /// Opens `dir`: a save directory (the iteration its `latest_checkpointed_iteration.txt`
    /// names, `release` included) or one `iter_NNNNNNN` directory.
    pub fn open(dir: &Path) -> Result<TorchDistCheckpoint, String> {
        let dir = resolve(dir)?;
        let md = dir.join(".metadata");
        let bytes = std::fs::read(&md).map_err(|e| format!("{}: {e}", md.display()))?;
        let meta = unpickle(&bytes).map_err(|e| format!("{}: {e}", md.display()))?;
        if meta.class_name().as_deref() != Some("torch.distributed.checkpoint.metadata.Metadata") {
            return Err(format!(
                "{}: not a torch.distributed.checkpoint Metadata",
                md.display()
            ));
        }
        let bad = |what: &str| format!("{}: {what}", md.display());
        let mut sizes = BTreeMap::new();
        let mut extents: HashMap<(String, Vec<usize>), Vec<usize>> = HashMap::new();
        if let Some(PyValue::Dict(entries)) = meta.attr("state_dict_metadata") {
            for (k, v) in entries {
                let (Some(key), Some(size)) = (k.as_str(), v.attr("size")) else {
                    continue; // bytes items have no size
                };
                let size = size
                    .as_usizes()
                    .ok_or_else(|| bad(&format!("key {key} has a size that is not integers")))?;
                sizes.insert(key.to_string(), size);
                for c in v.attr("chunks").and_then(|c| c.as_seq()).unwrap_or(&[]) {
                    if let (Some(o), Some(s)) = (
                        c.attr("offsets").and_then(|o| o.as_usizes()),
                        c.attr("sizes").and_then(|s| s.as_usizes()),
                    ) {
                        extents.insert((key.to_string(), o), s);
                    }
                }
            }
        } else {
            return Err(bad("no state_dict_metadata"));
        }
        let Some(PyValue::Dict(storage)) = meta.attr("storage_data") else {
            return Err(bad("no storage_data"));
        };
        let mut stored: HashMap<String, Vec<Stored>> = HashMap::new();
        for (index, info) in storage {
            let fqn = index
                .attr("fqn")
                .and_then(|f| f.as_str())
                .ok_or_else(|| bad("a storage entry without its key"))?;
            let offset =
                match index.attr("offset") {
                    None | Some(PyValue::None) => None,
                    Some(o) => Some(o.as_usizes().ok_or_else(|| {
                        bad(&format!("key {fqn}: an offset that is not integers"))
                    })?),
                };
            let field = |name: &str| {
                info.attr(name)
                    .ok_or_else(|| bad(&format!("key {fqn}: storage without {name}")))
            };
            if let Some(t) = info.attr("transform_descriptors") {
                if !matches!(t, PyValue::None) && t.as_seq().is_some_and(|s| !s.is_empty()) {
                    return Err(bad(&format!(
                        "key {fqn} is stored transformed (compressed?), which is not read here"
                    )));
                }
            }
            let file = field("relative_path")?
                .as_str()
                .ok_or_else(|| bad("a relative_path that is not a string"))?
                .to_string();
            let num = |name: &str| -> Result<usize, String> {
                field(name)?
                    .as_int()
                    .and_then(|i| usize::try_from(i).ok())
                    .ok_or_else(|| bad(&format!("key {fqn}: {name} is not an integer")))
            };
            let extent = offset
                .as_ref()
                .and_then(|o| extents.get(&(fqn.to_string(), o.clone())).cloned());
            stored.entry(fqn.to_string()).or_default().push(Stored {
                offset,
                extent,
                file,
                at: num("offset")?,
                len: num("length")?,
            });
        }
        let mut files = HashMap::new();
        for s in stored.values().flatten() {
            if files.contains_key(&s.file) {
                continue;
            }
            let path = dir.join(&s.file);
            let f = std::fs::File::open(&path)
                .map_err(|e| format!("{}: cannot open: {e}", path.display()))?;
            // SAFETY: the file is only read, and a checkpoint being converted is not written.
            let map = unsafe { memmap2::Mmap::map(&f) }
                .map_err(|e| format!("{}: {e}", path.display()))?;
            files.insert(s.file.clone(), map);
        }
        Ok(TorchDistCheckpoint {
            dir,
            sizes,
            stored,
            files,
        })
    }

    fn item(&self, key: &str, s: &Stored) -> Result<TorchArchive<'_>, String> {
        let map = &self.files[&s.file];
        let bytes = map.get(s.at..s.at + s.len).ok_or_else(|| {
            format!(
                "{}: key {key} is stored past the end of {}",
                self.dir.display(),
                s.file
            )
        })?;
        TorchArchive::read(bytes).map_err(|e| format!("{}: key {key}: {e}", self.dir.display()))
    }

    /// The object stored under `key` (a bytes item: `torch.save` of any object).
    pub fn object(&self, key: &str) -> Result<PyValue, String> {
        Ok(self.archive(key)?.object)
    }

    /// The `torch.save` archive stored under `key`, for the tensors inside its object.
    pub fn archive(&self, key: &str) -> Result<TorchArchive<'_>, String> {
        let s = self
            .stored
            .get(key)
            .and_then(|v| v.first())
            .ok_or_else(|| format!("{}: no item {key}", self.dir.display()))?;
        self.item(key, s)
    }

    /// The stored chunks of tensor `key`: each one's global offset and extent, by offset.
    /// (The distributed optimizer's bucket form stores one chunk per parameter or padding.)
    pub fn chunks(&self, key: &str) -> Vec<(Vec<usize>, Vec<usize>)> {
        let mut c: Vec<_> = self
            .stored
            .get(key)
            .into_iter()
            .flatten()
            .filter_map(|s| Some((s.offset.clone()?, s.extent.clone()?)))
            .collect();
        c.sort();
        c
    }

    /// Keys of the stored items (tensors and objects).
    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.stored.keys()
    }

    /// The region of tensor `key` starting at `start` of extent `size` (row-major f32),
    /// assembled from the chunks that overlap it; every element must be covered.
    pub fn region(&self, key: &str, start: &[usize], size: &[usize]) -> Result<Vec<f32>, String> {
        let global = self
            .sizes
            .get(key)
            .ok_or_else(|| format!("{}: no tensor {key}", self.dir.display()))?;
        if start.len() != global.len()
            || size.len() != global.len()
            || start
                .iter()
                .zip(size)
                .zip(global)
                .any(|((a, b), g)| a + b > *g)
        {
            return Err(format!(
                "{}: tensor {key} of size {global:?} has no region {start:?} + {size:?}",
                self.dir.display()
            ));
        }
        let n: usize = size.iter().product();
        let mut out = vec![0.0f32; n];
        let mut covered = 0usize;
        for s in self.stored.get(key).into_iter().flatten() {
            let off = s.offset.clone().unwrap_or_else(|| vec![0; global.len()]);
            if let Some(e) = &s.extent {
                let misses = (0..global.len().min(e.len()).min(off.len()))
                    .any(|d| off[d] >= start[d] + size[d] || off[d] + e[d] <= start[d]);
                if misses {
                    continue;
                }
            }
            let ar = self.item(key, s)?;
            let chunk: TorchTensor = ar
                .tensor(&ar.object)
                .map_err(|e| format!("{}: key {key}: {e}", self.dir.display()))?;
            if chunk.shape.len() != global.len() {
                return Err(format!(
                    "{}: key {key}: a chunk of rank {} in a tensor of rank {}",
                    self.dir.display(),
                    chunk.shape.len(),
                    global.len()
                ));
            }
            covered += copy_overlap(&mut out, start, size, &chunk, &off);
        }
        if covered != n {
            return Err(format!(
                "{}: tensor {key}: its chunks cover {covered} of the {n} elements of {start:?} + {size:?} (a missing .distcp file, or overlapping chunks)",
                self.dir.display()
            ));
        }
        Ok(out)
    }
}

/// Copies where `chunk` (at global offset `off`) overlaps the region (`start`, `size`) into
/// `out`; returns how many elements it copied.
fn copy_overlap(
    out: &mut [f32],
    start: &[usize],
    size: &[usize],
    chunk: &TorchTensor,
    off: &[usize],
) -> usize {
    let r = start.len();
    let mut lo = vec![0usize; r];
    let mut hi = vec![0usize; r];
    for d in 0..r {
        lo[d] = start[d].max(off[d]);
        hi[d] = (start[d] + size[d]).min(off[d] + chunk.shape[d]);
        if lo[d] >= hi[d] {
            return 0;
        }
    }
    let strides = |shape: &[usize]| {
        let mut s = vec![1usize; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            s[d] = s[d + 1] * shape[d + 1];
        }
        s
    };
    let (so, sc) = (strides(size), strides(&chunk.shape));
    let row = hi[r - 1] - lo[r - 1];
    let rows: usize = (0..r - 1).map(|d| hi[d] - lo[d]).product();
    let mut idx = lo[..r - 1].to_vec();
    for _ in 0..rows {
        let (mut o, mut c) = (0usize, 0usize);
        for d in 0..r - 1 {
            o += (idx[d] - start[d]) * so[d];
            c += (idx[d] - off[d]) * sc[d];
        }
        o += lo[r - 1] - start[r - 1];
        c += lo[r - 1] - off[r - 1];
        out[o..o + row].copy_from_slice(&chunk.values[c..c + row]);
        for d in (0..r - 1).rev() {
            idx[d] += 1;
            if idx[d] < hi[d] {
                break;
            }
            idx[d] = lo[d];
        }
    }
    rows * row
}

/// The iteration directory the tracker of save directory `dir` names, as Megatron's
/// `get_checkpoint_name` names it (`iter_NNNNNNN`, or `release`), and that name; `neither`
/// says what `dir` is not where it has no tracker.
pub(crate) fn tracked_iteration(
    dir: &Path,
    neither: impl FnOnce() -> String,
) -> Result<(PathBuf, String), String> {
    let tracker = dir.join("latest_checkpointed_iteration.txt");
    let text = std::fs::read_to_string(&tracker).map_err(|_| neither())?;
    let it = text.trim();
    let sub = if it == "release" {
        "release".to_string()
    } else {
        let n: u64 = it.parse().map_err(|_| {
            format!(
                "{}: '{it}' is neither an iteration nor release",
                tracker.display()
            )
        })?;
        format!("iter_{n:07}")
    };
    Ok((dir.join(&sub), sub))
}

/// The iteration directory of `dir`: itself, or the one its tracker names.
fn resolve(dir: &Path) -> Result<PathBuf, String> {
    if dir.join(".metadata").exists() {
        return Ok(dir.to_path_buf());
    }
    let (d, sub) = tracked_iteration(dir, || {
        format!(
            "{}: neither a torch_dist checkpoint (no .metadata) nor a save directory (no latest_checkpointed_iteration.txt)",
            dir.display()
        )
    })?;
    if d.join(".metadata").exists() {
        Ok(d)
    } else if d.join("mp_rank_00").exists() || d.join("mp_rank_00_000").exists() {
        Err(format!(
            "{}: a --ckpt-format torch checkpoint (mp_rank_* files): convert it with --from torch",
            d.display()
        ))
    } else {
        Err(format!(
            "{}: the tracker names {sub}, which holds no .metadata (an unfinished save?)",
            d.display()
        ))
    }
}
