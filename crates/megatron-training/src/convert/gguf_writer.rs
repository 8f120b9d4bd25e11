//! Writing llama.cpp's GGUF container (version 3): typed metadata, tensor infos, 32-byte
//! aligned data, and the tensor encodings llama.cpp's own converter produces (F32, F16, BF16,
//! Q8_0, each bit for bit as gguf-py's `quants.py` rounds). Written by hand for the reason the
//! reader is: no maintained Rust crate writes ggml's quantized blocks.

use crate::TrainError;
use std::io::Write;
use std::path::Path;

/// A metadata value, with the GGUF type it is written as.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    StrArray(Vec<String>),
    I32Array(Vec<i32>),
    F32Array(Vec<f32>),
}

/// How a tensor's values are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q8_0,
}

impl GgmlType {
    /// ggml's type id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q8_0 => 8,
            GgmlType::Bf16 => 30,
        }
    }
}

/// Elements per Q8_0 block: a row whose length is not a multiple cannot be Q8_0.
pub const Q8_0_BLOCK: usize = 32;

/// `values` (row-major, rows of `cols`) in ggml's encoding of `ty`.
pub fn encode(ty: GgmlType, values: &[f32], cols: usize) -> Vec<u8> {
    match ty {
        GgmlType::F32 => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
        GgmlType::F16 => values
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect(),
        GgmlType::Bf16 => values
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect(),
        GgmlType::Q8_0 => {
            assert!(
                cols.is_multiple_of(Q8_0_BLOCK),
                "Q8_0 rows must be whole blocks"
            );
            let mut out = Vec::with_capacity(values.len() / Q8_0_BLOCK * 34);
            for blk in values.chunks_exact(Q8_0_BLOCK) {
                // ggml's reference quantizer (`quantize_row_q8_0_ref`): the scale maps the
                // largest magnitude to 127, values round half away from zero.
                let amax = blk.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                let d = amax / 127.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                out.extend(half::f16::from_f32(d).to_le_bytes());
                out.extend(blk.iter().map(|&x| (x * id).round() as i8 as u8));
            }
            out
        }
    }
}

struct TensorOut {
    name: String,
    /// Row-major shape (the file stores it reversed, fastest dimension first).
    shape: Vec<usize>,
    ty: GgmlType,
    data: Vec<u8>,
}

/// A GGUF file being assembled in memory, then written in one go.
#[derive(Default)]
pub struct GgufWriter {
    meta: Vec<(String, MetaValue)>,
    tensors: Vec<TensorOut>,
}

const ALIGN: usize = 32;

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

impl GgufWriter {
    pub fn meta(&mut self, key: impl Into<String>, v: MetaValue) {
        self.meta.push((key.into(), v));
    }

    /// Adds a tensor already in `ty`'s encoding.
    pub fn tensor(
        &mut self,
        name: impl Into<String>,
        shape: Vec<usize>,
        ty: GgmlType,
        data: Vec<u8>,
    ) {
        self.tensors.push(TensorOut {
            name: name.into(),
            shape,
            ty,
            data,
        });
    }

    /// Everything before the tensor data: header, metadata, tensor infos, padding.
    fn header(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(b"GGUF");
        b.extend(3u32.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend((self.meta.len() as u64).to_le_bytes());
        for (k, v) in &self.meta {
            put_str(&mut b, k);
            let array = |b: &mut Vec<u8>, ty: u32, n: usize| {
                b.extend(9u32.to_le_bytes());
                b.extend(ty.to_le_bytes());
                b.extend((n as u64).to_le_bytes());
            };
            match v {
                MetaValue::U32(x) => {
                    b.extend(4u32.to_le_bytes());
                    b.extend(x.to_le_bytes());
                }
                MetaValue::F32(x) => {
                    b.extend(6u32.to_le_bytes());
                    b.extend(x.to_le_bytes());
                }
                MetaValue::Bool(x) => {
                    b.extend(7u32.to_le_bytes());
                    b.push(*x as u8);
                }
                MetaValue::Str(s) => {
                    b.extend(8u32.to_le_bytes());
                    put_str(&mut b, s);
                }
                MetaValue::StrArray(a) => {
                    array(&mut b, 8, a.len());
                    a.iter().for_each(|s| put_str(&mut b, s));
                }
                MetaValue::I32Array(a) => {
                    array(&mut b, 5, a.len());
                    a.iter().for_each(|x| b.extend(x.to_le_bytes()));
                }
                MetaValue::F32Array(a) => {
                    array(&mut b, 6, a.len());
                    a.iter().for_each(|x| b.extend(x.to_le_bytes()));
                }
            }
        }
        let mut offset = 0usize;
        for t in &self.tensors {
            put_str(&mut b, &t.name);
            b.extend((t.shape.len() as u32).to_le_bytes());
            for d in t.shape.iter().rev() {
                b.extend((*d as u64).to_le_bytes());
            }
            b.extend(t.ty.id().to_le_bytes());
            b.extend((offset as u64).to_le_bytes());
            offset = (offset + t.data.len()).div_ceil(ALIGN) * ALIGN;
        }
        b.resize(b.len().div_ceil(ALIGN) * ALIGN, 0);
        b
    }

    /// Writes the file under a temporary name, syncs it and renames it, so an interrupted
    /// export never leaves a truncated `.gguf` that looks complete.
    pub fn write(&self, path: &Path) -> Result<(), TrainError> {
        let tmp = path.with_extension("gguf.partial");
        let io = crate::io_err(path);
        // Named by the output the user gave, not the temporary name.
        let f = std::fs::File::create(&tmp).map_err(crate::io_err(path))?;
        let mut f = std::io::BufWriter::new(f);
        let mut put = |b: &[u8]| f.write_all(b).map_err(crate::io_err(&tmp));
        put(&self.header())?;
        for t in &self.tensors {
            put(&t.data)?;
            put(&[0; ALIGN][..t.data.len().next_multiple_of(ALIGN) - t.data.len()])?;
        }
        let f = f
            .into_inner()
            .map_err(|e| crate::io_err(&tmp)(e.into_error()))?;
        f.sync_all().map_err(crate::io_err(&tmp))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(io)
    }
}
