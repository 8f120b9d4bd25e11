//! `torch.save` archives read without PyTorch: a zip (entries stored, not compressed) holding
//! `<name>/data.pkl`, the pickled object, and `<name>/data/<key>`, one file per storage that a
//! tensor in it views. A tensor is pickled as `torch._utils._rebuild_tensor_v2(storage,
//! storage_offset, size, stride, ...)`, the storage as the persistent id `('storage',
//! torch.<Type>Storage, key, location, numel)`.

use super::pickle::{unpickle, PyValue};
use super::pickle_writer::{pickle, Pickle};
use std::cell::RefCell;
use std::io::Read;

/// A tensor read from an archive: its shape and values, widened to f32, row-major.
#[derive(Clone, Debug)]
pub struct TorchTensor {
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

/// An opened archive: its pickled object; storages are read when a tensor asks for them (a
/// training checkpoint's optimizer state need never be read).
pub struct TorchArchive<'a> {
    pub object: PyValue,
    zip: RefCell<zip::ZipArchive<std::io::Cursor<&'a [u8]>>>,
    data: String,
}

impl<'a> TorchArchive<'a> {
    /// Reads the archive in `bytes` (a `.pt` file, or one item of a DCP `.distcp` file).
    pub fn read(bytes: &'a [u8]) -> Result<TorchArchive<'a>, String> {
        let mut zip = zip::ZipArchive::new(std::io::Cursor::new(bytes))
            .map_err(|e| format!("not a torch.save archive (zip): {e}"))?;
        let names: Vec<String> = zip
            .file_names()
            .map(|n| n.map(|n| n.into_owned()))
            .collect::<Result<_, _>>()
            .map_err(|e| format!("a torch.save archive entry name: {e}"))?;
        let pkl = names
            .iter()
            .find(|n| n.ends_with("/data.pkl") || *n == "data.pkl")
            .ok_or("a torch.save archive without data.pkl")?
            .clone();
        let prefix = pkl.trim_end_matches("data.pkl").to_string();
        let mut read = |name: &str| -> Result<Vec<u8>, String> {
            let mut f = zip
                .by_name(name)
                .map_err(|e| format!("archive entry {name}: {e}"))?;
            let mut v = Vec::with_capacity(f.size() as usize);
            f.read_to_end(&mut v)
                .map_err(|e| format!("archive entry {name}: {e}"))?;
            Ok(v)
        };
        let order = format!("{prefix}byteorder");
        if names.contains(&order) && read(&order)? != b"little" {
            return Err("a big-endian torch.save archive".into());
        }
        let object = unpickle(&read(&pkl)?)?;
        Ok(TorchArchive {
            object,
            zip: RefCell::new(zip),
            data: format!("{prefix}data/"),
        })
    }

    /// The bytes of storage `key`.
    fn storage(&self, key: &str) -> Result<Vec<u8>, String> {
        let name = format!("{}{key}", self.data);
        let mut zip = self.zip.borrow_mut();
        let mut f = zip
            .by_name(&name)
            .map_err(|_| format!("storage {key} is not in the archive"))?;
        let mut v = Vec::with_capacity(f.size() as usize);
        f.read_to_end(&mut v)
            .map_err(|e| format!("archive entry {name}: {e}"))?;
        Ok(v)
    }

    /// The tensor `v` rebuilds (`_rebuild_tensor_v2`, or a `Parameter` around one).
    pub fn tensor(&self, v: &PyValue) -> Result<TorchTensor, String> {
        self.rebuild(&v.class_name().unwrap_or_default(), v.args())
    }

    /// The tensor the pickled call `class(*args)` rebuilds.
    fn rebuild(&self, class: &str, args: &[PyValue]) -> Result<TorchTensor, String> {
        match class {
            "torch._utils._rebuild_parameter" | "torch._utils._rebuild_parameter_with_state" => {
                self.tensor(args.first().ok_or("a parameter without its tensor")?)
            }
            // A tensor subclass (a Parameter kept as a plain attribute, such as the fp32 main
            // copies of Megatron's mixed-precision optimizer): `(func, type, func's args,
            // state)`.
            "torch._tensor._rebuild_from_type_v2" => match args {
                [func, _, PyValue::Tuple(inner), ..] => {
                    self.rebuild(&func.class_name().unwrap_or_default(), inner)
                }
                _ => Err("a _rebuild_from_type_v2 without its function and arguments".into()),
            },
            "torch._utils._rebuild_tensor_v2" | "torch._utils._rebuild_tensor" => {
                let [storage, offset, size, stride, ..] = args else {
                    return Err(format!("{class} with {} arguments", args.len()));
                };
                let PyValue::Persistent(pid) = storage else {
                    return Err("a tensor whose storage is not a persistent id".into());
                };
                let pid = pid.as_seq().ok_or("a storage id that is not a tuple")?;
                let (Some(kind), Some(key)) = (
                    pid.get(1).and_then(|k| k.class_name()),
                    pid.get(2).and_then(|k| k.as_str()),
                ) else {
                    return Err("a storage id without its type and key".into());
                };
                let bytes = self.storage(key)?;
                let shape = size
                    .as_usizes()
                    .ok_or("a tensor size that is not integers")?;
                let stride = stride
                    .as_usizes()
                    .ok_or("a tensor stride that is not integers")?;
                let offset = offset.as_int().unwrap_or(0) as usize;
                let storage = widen(&kind, &bytes)?;
                Ok(TorchTensor {
                    values: gather(&storage, offset, &shape, &stride)?,
                    shape,
                })
            }
            other => Err(format!("not a tensor: {other}")),
        }
    }
}

/// The shape of the tensor `v` rebuilds, read from its pickled call without its storage.
pub fn tensor_shape(v: &PyValue) -> Option<Vec<usize>> {
    match v.class_name()?.as_str() {
        "torch._utils._rebuild_parameter" | "torch._utils._rebuild_parameter_with_state" => {
            tensor_shape(v.args().first()?)
        }
        "torch._utils._rebuild_tensor_v2" | "torch._utils._rebuild_tensor" => {
            v.args().get(2)?.as_usizes()
        }
        "torch._tensor._rebuild_from_type_v2" => v.args().get(2)?.as_seq()?.get(2)?.as_usizes(),
        _ => None,
    }
}

/// A storage's elements as f32 (the float types a checkpoint holds weights in).
fn widen(kind: &str, b: &[u8]) -> Result<Vec<f32>, String> {
    Ok(match kind {
        "torch.FloatStorage" => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        "torch.BFloat16Storage" => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        "torch.HalfStorage" => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        "torch.DoubleStorage" => b
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
            .collect(),
        other => {
            return Err(format!(
                "a {other} tensor (expected float32, bfloat16, float16)"
            ))
        }
    })
}

/// The elements a strided view selects, row-major.
fn gather(
    storage: &[f32],
    offset: usize,
    shape: &[usize],
    stride: &[usize],
) -> Result<Vec<f32>, String> {
    if shape.len() != stride.len() {
        return Err("a tensor whose size and stride differ in rank".into());
    }
    let n: usize = shape.iter().product();
    if n == 0 {
        return Ok(Vec::new());
    }
    let last = offset
        + shape
            .iter()
            .zip(stride)
            .map(|(&s, &st)| (s - 1) * st)
            .sum::<usize>();
    if last >= storage.len() {
        return Err(format!(
            "a tensor view reaches element {last} of a storage of {}",
            storage.len()
        ));
    }
    let mut row_major = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        row_major[d] = row_major[d + 1] * shape[d + 1];
    }
    let contiguous = shape
        .iter()
        .zip(stride.iter().zip(&row_major))
        .all(|(&s, (a, b))| s == 1 || a == b);
    if contiguous {
        return Ok(storage[offset..offset + n].to_vec());
    }
    let mut out = Vec::with_capacity(n);
    let mut idx = vec![0usize; shape.len()];
    for _ in 0..n {
        let at = offset + idx.iter().zip(stride).map(|(i, s)| i * s).sum::<usize>();
        out.push(storage[at]);
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(out)
}

/// The pickled call that rebuilds an f32 tensor of `shape` from storage `key` (contiguous),
/// as `torch.save` writes it.
pub fn f32_tensor_pickle(key: &str, shape: &[usize]) -> Pickle {
    let mut stride = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        stride[d] = stride[d + 1] * shape[d + 1];
    }
    let ints = |v: &[usize]| Pickle::Tuple(v.iter().map(|&x| Pickle::Int(x as i64)).collect());
    Pickle::Reduce(
        Box::new(Pickle::Global("torch._utils", "_rebuild_tensor_v2")),
        vec![
            Pickle::Persistent(Box::new(Pickle::Tuple(vec![
                Pickle::str("storage"),
                Pickle::Global("torch", "FloatStorage"),
                Pickle::str(key),
                Pickle::str("cpu"),
                Pickle::Int(shape.iter().product::<usize>() as i64),
            ]))),
            Pickle::Int(0),
            ints(shape),
            ints(&stride),
            Pickle::Bool(false),
            Pickle::Reduce(
                Box::new(Pickle::Global("collections", "OrderedDict")),
                vec![],
            ),
        ],
    )
}

/// A `torch.save` archive of `object` with its storages (`data/<key>`), laid out as PyTorch
/// lays it out: entries stored uncompressed under `archive/`, storages 64-byte aligned.
pub fn save_archive(object: &Pickle, storages: &[(&str, &[u8])]) -> Result<Vec<u8>, String> {
    use std::io::Write;
    use zip::write::SimpleFileOptions;
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let opts = |len: usize| {
        SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored)
            .large_file(len as u64 >= u64::from(u32::MAX))
    };
    let mut put = |name: String, bytes: &[u8], align: u16| -> Result<(), String> {
        zip.start_file(name.clone(), opts(bytes.len()).with_alignment(align))
            .and_then(|_| zip.write_all(bytes).map_err(zip::result::ZipError::Io))
            .map_err(|e| format!("writing {name}: {e}"))
    };
    put("archive/data.pkl".into(), &pickle(object), 1)?;
    put("archive/.format_version".into(), b"1", 1)?;
    put("archive/.storage_alignment".into(), b"64", 1)?;
    put("archive/byteorder".into(), b"little", 1)?;
    for (key, bytes) in storages {
        put(format!("archive/data/{key}"), bytes, 64)?;
    }
    put("archive/version".into(), b"3\n", 1)?;
    Ok(zip
        .finish()
        .map_err(|e| format!("finishing a torch.save archive: {e}"))?
        .into_inner())
}
