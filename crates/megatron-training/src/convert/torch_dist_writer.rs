//! A `torch.distributed.checkpoint` directory as megatron-core writes one for Megatron-LM
//! (`--ckpt-format torch_dist`), from one process: every item in `__0_0.distcp` (each a
//! `torch.save` archive of one tensor chunk or one object), `.metadata` (the pickled
//! `Metadata`: each key's global size and chunks, and where each item lies) and
//! `metadata.json` naming the backend. Written under a temporary name and renamed into place,
//! so an interrupted export never looks complete.

use super::pickle_writer::{pickle, Pickle};
use super::torch_save::{f32_tensor_pickle, save_archive};
use std::io::Write;
use std::path::Path;

/// Storages of the tensors inside an object: `f32_tensor_pickle`'s keys and their bytes.
pub type Storages = Vec<(String, Vec<u8>)>;

/// One item of the checkpoint.
pub enum Item<'a> {
    /// A chunk of an f32 tensor of global `size`, at `offset`, of extent `chunk`.
    Tensor {
        key: String,
        size: Vec<usize>,
        offset: Vec<usize>,
        chunk: Vec<usize>,
        values: &'a [f32],
    },
    /// An object (megatron-core's `ShardedObject`s: the common state, `_extra_state`s), with
    /// the storages of the tensors inside it (`f32_tensor_pickle`'s keys and their bytes).
    Object {
        key: String,
        object: Pickle,
        storages: Storages,
    },
}

const DCP: &str = "torch.distributed.checkpoint.metadata";

fn tensor_properties() -> Pickle {
    // The five-field state every torch since 2.0 reads (newer ones add strides, optional).
    Pickle::New(
        DCP,
        "TensorProperties",
        Box::new(Pickle::Tuple(vec![
            Pickle::Global("torch", "float32"),
            Pickle::Reduce(
                Box::new(Pickle::Global("torch.serialization", "_get_layout")),
                vec![Pickle::str("torch.strided")],
            ),
            Pickle::Bool(false),
            Pickle::Reduce(
                Box::new(Pickle::Global(DCP, "_MEM_FORMAT_ENCODING")),
                vec![Pickle::Int(0)],
            ),
            Pickle::Bool(false),
        ])),
    )
}

/// Writes `items` as the checkpoint directory `dir` (which must not exist).
pub fn write_torch_dist(dir: &Path, items: &[Item]) -> Result<(), String> {
    let name = dir
        .file_name()
        .ok_or_else(|| format!("{}: not a directory name", dir.display()))?;
    let tmp = dir.with_file_name(format!("{}.partial", name.to_string_lossy()));
    let io = |p: &Path| {
        let p = p.display().to_string();
        move |e: std::io::Error| format!("{p}: {e}")
    };
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let data = tmp.join("__0_0.distcp");
    let mut file = std::io::BufWriter::new(std::fs::File::create(&data).map_err(io(&data))?);
    let mut at = 0usize;
    let mut sizes: Vec<(String, Pickle)> = Vec::new();
    let mut chunks: std::collections::BTreeMap<String, Vec<Pickle>> = Default::default();
    let mut storage = Vec::new();
    for item in items {
        let (key, offset, bytes) = match item {
            Item::Tensor {
                key,
                size,
                offset,
                chunk,
                values,
            } => {
                let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                let bytes = save_archive(&f32_tensor_pickle("0", chunk), &[("0", &raw)])?;
                if !chunks.contains_key(key) {
                    sizes.push((key.clone(), Pickle::size(size)));
                }
                chunks.entry(key.clone()).or_default().push(Pickle::New(
                    DCP,
                    "ChunkStorageMetadata",
                    Box::new(Pickle::dict([
                        ("offsets", Pickle::size(offset)),
                        ("sizes", Pickle::size(chunk)),
                    ])),
                ));
                (key, Some(offset), bytes)
            }
            Item::Object {
                key,
                object,
                storages,
            } => {
                sizes.push((key.clone(), Pickle::None));
                let storages: Vec<(&str, &[u8])> = storages
                    .iter()
                    .map(|(k, b)| (k.as_str(), b.as_slice()))
                    .collect();
                (key, None, save_archive(object, &storages)?)
            }
        };
        file.write_all(&bytes).map_err(io(&data))?;
        let mut index = vec![("fqn", Pickle::str(key.as_str()))];
        if let Some(o) = offset {
            index.push(("offset", Pickle::size(o)));
        }
        index.push(("index", Pickle::None));
        storage.push((
            Pickle::New(DCP, "MetadataIndex", Box::new(Pickle::dict(index))),
            Pickle::New(
                "torch.distributed.checkpoint.filesystem",
                "_StorageInfo",
                Box::new(Pickle::dict([
                    ("relative_path", Pickle::str("__0_0.distcp")),
                    ("offset", Pickle::Int(at as i64)),
                    ("length", Pickle::Int(bytes.len() as i64)),
                ])),
            ),
        ));
        at += bytes.len();
    }
    file.into_inner()
        .map_err(|e| format!("{}: {e}", data.display()))?
        .sync_all()
        .map_err(io(&data))?;
    let state_dict_metadata = sizes
        .into_iter()
        .map(|(key, size)| {
            let meta = match size {
                Pickle::None => Pickle::New(DCP, "BytesStorageMetadata", Box::new(Pickle::None)),
                size => Pickle::New(
                    DCP,
                    "TensorStorageMetadata",
                    Box::new(Pickle::dict([
                        ("properties", tensor_properties()),
                        ("size", size),
                        (
                            "chunks",
                            Pickle::List(chunks.remove(&key).unwrap_or_default()),
                        ),
                    ])),
                ),
            };
            (Pickle::Str(key), meta)
        })
        .collect();
    let metadata = Pickle::New(
        DCP,
        "Metadata",
        Box::new(Pickle::dict([
            ("state_dict_metadata", Pickle::Dict(state_dict_metadata)),
            ("planner_data", Pickle::None),
            ("storage_data", Pickle::Dict(storage)),
            ("storage_meta", Pickle::None),
            ("version", Pickle::str("1.0.0")),
        ])),
    );
    let md = tmp.join(".metadata");
    std::fs::write(&md, pickle(&metadata)).map_err(io(&md))?;
    let js = tmp.join("metadata.json");
    std::fs::write(
        &js,
        r#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1}"#,
    )
    .map_err(io(&js))?;
    if dir.exists() {
        return Err(format!("{}: already exists", dir.display()));
    }
    std::fs::rename(&tmp, dir).map_err(io(dir))
}
