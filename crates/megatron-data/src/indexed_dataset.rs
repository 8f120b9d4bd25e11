//! Megatron's indexed dataset: `<prefix>.bin` (token ids back to back) and `<prefix>.idx`
//! (`MMIDIDX\0\0`, version 1, dtype code, sequence and document counts, then int32 lengths,
//! int64 byte pointers, int64 document indices; all little-endian and unaligned), byte for byte
//! as `megatron/core/datasets/indexed_dataset.py` writes and reads them.

use crate::DataError;
use memmap2::Mmap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

pub const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
pub const VERSION: u64 = 1;
const HEADER: usize = 34;

/// Token storage types and Megatron's codes for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenDType {
    U8 = 1,
    I8 = 2,
    I16 = 3,
    I32 = 4,
    I64 = 5,
    U16 = 8,
}

impl TokenDType {
    pub fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            1 => Self::U8,
            2 => Self::I8,
            3 => Self::I16,
            4 => Self::I32,
            5 => Self::I64,
            8 => Self::U16,
            _ => return None,
        })
    }
    pub fn size(self) -> usize {
        match self {
            Self::U8 | Self::I8 => 1,
            Self::I16 | Self::U16 => 2,
            Self::I32 => 4,
            Self::I64 => 8,
        }
    }
    /// `DType.optimal_dtype`: uint16 below 65500 ids, else int32.
    pub fn optimal(vocab_size: usize) -> Self {
        if vocab_size < 65500 {
            Self::U16
        } else {
            Self::I32
        }
    }
    fn max_id(self) -> u64 {
        match self {
            Self::U8 => u8::MAX as u64,
            Self::I8 => i8::MAX as u64,
            Self::I16 => i16::MAX as u64,
            Self::U16 => u16::MAX as u64,
            Self::I32 => i32::MAX as u64,
            Self::I64 => i64::MAX as u64,
        }
    }
}

pub fn bin_path(prefix: &str) -> PathBuf {
    PathBuf::from(format!("{prefix}.bin"))
}
pub fn idx_path(prefix: &str) -> PathBuf {
    PathBuf::from(format!("{prefix}.idx"))
}

fn tmp_of(p: &Path) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(format!(".tmp-{}", std::process::id()));
    PathBuf::from(s)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Streams sequences into `<prefix>.bin` and writes `<prefix>.idx` on [`finalize`]. Both files are
/// written under temporary names and renamed at the end, `.bin` first and `.idx` last, so an
/// interrupted run never leaves an index that looks complete.
///
/// [`finalize`]: IndexedDatasetBuilder::finalize
pub struct IndexedDatasetBuilder {
    prefix: String,
    dtype: TokenDType,
    bin: BufWriter<File>,
    bin_tmp: PathBuf,
    lengths: Vec<i32>,
    document_indices: Vec<i64>,
    bytes: u64,
}

impl IndexedDatasetBuilder {
    pub fn new(prefix: &str, dtype: TokenDType) -> Result<Self, DataError> {
        let bin_tmp = tmp_of(&bin_path(prefix));
        if let Some(dir) = bin_tmp.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io(dir))?;
        }
        let f = File::create(&bin_tmp).map_err(io(&bin_tmp))?;
        Ok(IndexedDatasetBuilder {
            prefix: prefix.to_string(),
            dtype,
            bin: BufWriter::with_capacity(1 << 20, f),
            bin_tmp,
            lengths: Vec::new(),
            document_indices: vec![0],
            bytes: 0,
        })
    }

    pub fn dtype(&self) -> TokenDType {
        self.dtype
    }

    /// Appends one sequence.
    pub fn add_item(&mut self, tokens: &[u32]) -> Result<(), DataError> {
        let max = self.dtype.max_id();
        let mut buf = Vec::with_capacity(tokens.len() * self.dtype.size());
        for &t in tokens {
            if t as u64 > max {
                return Err(DataError::TokenTooLarge {
                    token: t,
                    dtype: format!("{:?}", self.dtype),
                });
            }
            match self.dtype {
                TokenDType::U8 => buf.push(t as u8),
                TokenDType::I8 => buf.push(t as i8 as u8),
                TokenDType::I16 => buf.extend_from_slice(&(t as i16).to_le_bytes()),
                TokenDType::U16 => buf.extend_from_slice(&(t as u16).to_le_bytes()),
                TokenDType::I32 => buf.extend_from_slice(&(t as i32).to_le_bytes()),
                TokenDType::I64 => buf.extend_from_slice(&(t as i64).to_le_bytes()),
            }
        }
        self.bin.write_all(&buf).map_err(io(&self.bin_tmp))?;
        self.bytes += buf.len() as u64;
        self.lengths.push(tokens.len() as i32);
        Ok(())
    }

    /// Marks the end of a document (after its sequences).
    pub fn end_document(&mut self) {
        self.document_indices.push(self.lengths.len() as i64);
    }

    /// Appends a whole existing dataset (Megatron's `add_index`, used to merge datasets).
    pub fn add_index(&mut self, other: &IndexedDataset) -> Result<(), DataError> {
        if other.dtype() != self.dtype {
            return Err(DataError::Format {
                path: other.idx.display().to_string(),
                msg: format!(
                    "dtype {:?} differs from the merged dataset's {:?}",
                    other.dtype(),
                    self.dtype
                ),
            });
        }
        let offset = self.lengths.len() as i64;
        for i in 0..other.len() {
            self.lengths.push(other.length(i) as i32);
        }
        for &d in &other.document_indices()[1..] {
            self.document_indices.push(offset + d);
        }
        let bytes = &other.bin[..];
        self.bin.write_all(bytes).map_err(io(&self.bin_tmp))?;
        self.bytes += bytes.len() as u64;
        Ok(())
    }

    /// Writes `.idx`, then renames both files into place.
    pub fn finalize(mut self) -> Result<(), DataError> {
        self.bin.flush().map_err(io(&self.bin_tmp))?;
        self.bin.get_ref().sync_all().map_err(io(&self.bin_tmp))?;
        let idx = idx_path(&self.prefix);
        let idx_tmp = tmp_of(&idx);
        let mut w = BufWriter::new(File::create(&idx_tmp).map_err(io(&idx_tmp))?);
        let n = self.lengths.len();
        let mut head = Vec::with_capacity(HEADER);
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&VERSION.to_le_bytes());
        head.push(self.dtype as u8);
        head.extend_from_slice(&(n as u64).to_le_bytes());
        head.extend_from_slice(&(self.document_indices.len() as u64).to_le_bytes());
        w.write_all(&head).map_err(io(&idx_tmp))?;
        let mut body = Vec::with_capacity(n * 12 + self.document_indices.len() * 8);
        for l in &self.lengths {
            body.extend_from_slice(&l.to_le_bytes());
        }
        let mut ptr = 0i64;
        for l in &self.lengths {
            body.extend_from_slice(&ptr.to_le_bytes());
            ptr += *l as i64 * self.dtype.size() as i64;
        }
        for d in &self.document_indices {
            body.extend_from_slice(&d.to_le_bytes());
        }
        w.write_all(&body).map_err(io(&idx_tmp))?;
        w.flush().map_err(io(&idx_tmp))?;
        w.get_ref().sync_all().map_err(io(&idx_tmp))?;
        drop(w);
        let bin = bin_path(&self.prefix);
        std::fs::rename(&self.bin_tmp, &bin).map_err(io(&bin))?;
        std::fs::rename(&idx_tmp, &idx).map_err(io(&idx))?;
        Ok(())
    }
}

impl Drop for IndexedDatasetBuilder {
    fn drop(&mut self) {
        // An abandoned builder (error, panic) leaves nothing that looks like a dataset.
        let _ = std::fs::remove_file(&self.bin_tmp);
    }
}

/// A memory-mapped indexed dataset. The files must not change while mapped.
pub struct IndexedDataset {
    idx_map: Mmap,
    bin: Mmap,
    idx: PathBuf,
    dtype: TokenDType,
    n: usize,
    d: usize,
    document_indices: Vec<i64>,
}

fn rd_u64(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().expect("8 bytes"))
}

impl IndexedDataset {
    pub fn open(prefix: &str) -> Result<Self, DataError> {
        let idx = idx_path(prefix);
        let binp = bin_path(prefix);
        let bad = |msg: String| DataError::Format {
            path: idx.display().to_string(),
            msg,
        };
        let fi = File::open(&idx).map_err(io(&idx))?;
        let fb = File::open(&binp).map_err(io(&binp))?;
        // SAFETY: read-only maps; the dataset files must not be modified while in use.
        let idx_map = unsafe { Mmap::map(&fi) }.map_err(io(&idx))?;
        let bin = unsafe { Mmap::map(&fb) }.map_err(io(&binp))?;
        if idx_map.len() < HEADER || &idx_map[..9] != MAGIC {
            return Err(bad(
                "not a Megatron index (bad magic; expected MMIDIDX)".into()
            ));
        }
        let version = rd_u64(&idx_map, 9);
        if version != VERSION {
            return Err(bad(format!("version {version}, only version 1 is known")));
        }
        let dtype = TokenDType::from_code(idx_map[17])
            .ok_or_else(|| bad(format!("unknown dtype code {}", idx_map[17])))?;
        let n = rd_u64(&idx_map, 18) as usize;
        let d = rd_u64(&idx_map, 26) as usize;
        let need = HEADER + 12 * n + 8 * d;
        if idx_map.len() < need {
            return Err(bad(format!(
                "truncated: {} bytes, the header announces {need}",
                idx_map.len()
            )));
        }
        let ds = IndexedDataset {
            idx_map,
            bin,
            idx: idx.clone(),
            dtype,
            n,
            d,
            document_indices: Vec::new(),
        };
        let docs: Vec<i64> = (0..d).map(|i| ds.rd_i64(HEADER + 12 * n + 8 * i)).collect();
        if docs.first() != Some(&0)
            || docs.last().copied() != Some(n as i64)
            || docs.windows(2).any(|w| w[0] > w[1])
        {
            return Err(bad(format!(
                "document index must rise from 0 to the sequence count {n}"
            )));
        }
        let mut expect = 0u64;
        for i in 0..n {
            let (p, l) = (ds.pointer(i), ds.length(i));
            if p != expect {
                return Err(bad(format!(
                    "sequence {i} starts at byte {p}, expected {expect}"
                )));
            }
            expect += (l * dtype.size()) as u64;
        }
        if expect != ds.bin.len() as u64 {
            return Err(DataError::Format {
                path: binp.display().to_string(),
                msg: format!(
                    "{} bytes, the index describes {expect} (truncated or mismatched .bin/.idx)",
                    ds.bin.len()
                ),
            });
        }
        Ok(IndexedDataset {
            document_indices: docs,
            ..ds
        })
    }

    fn rd_i64(&self, off: usize) -> i64 {
        i64::from_le_bytes(self.idx_map[off..off + 8].try_into().expect("8 bytes"))
    }

    pub fn dtype(&self) -> TokenDType {
        self.dtype
    }
    /// Number of sequences.
    pub fn len(&self) -> usize {
        self.n
    }
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
    pub fn num_documents(&self) -> usize {
        self.d - 1
    }
    pub fn document_indices(&self) -> &[i64] {
        &self.document_indices
    }
    pub fn length(&self, i: usize) -> usize {
        let off = HEADER + 4 * i;
        i32::from_le_bytes(self.idx_map[off..off + 4].try_into().expect("4 bytes")) as usize
    }
    pub fn pointer(&self, i: usize) -> u64 {
        self.rd_i64(HEADER + 4 * self.n + 8 * i) as u64
    }
    pub fn lengths(&self) -> Vec<i32> {
        (0..self.n).map(|i| self.length(i) as i32).collect()
    }

    /// Tokens `offset..offset + len` of sequence `i` as a typed view into the memory map, without
    /// copying (`.bin` offsets are multiples of the token size and the map is page-aligned).
    pub fn slice(&self, i: usize, offset: usize, len: usize) -> TokenSlice<'_> {
        let sz = self.dtype.size();
        let start = self.pointer(i) as usize + offset * sz;
        let bytes = &self.bin[start..start + len * sz];
        // SAFETY: every bit pattern is a valid integer; `align_to` only yields the aligned middle.
        macro_rules! view {
            ($t:ty, $v:ident) => {{
                let (pre, mid, post) = unsafe { bytes.align_to::<$t>() };
                if pre.is_empty() && post.is_empty() {
                    return TokenSlice::$v(mid);
                }
            }};
        }
        if cfg!(target_endian = "little") {
            match self.dtype {
                TokenDType::U16 => view!(u16, U16),
                TokenDType::I32 => view!(i32, I32),
                TokenDType::I64 => view!(i64, I64),
                TokenDType::I16 => view!(i16, I16),
                TokenDType::U8 => return TokenSlice::U8(bytes),
                TokenDType::I8 => view!(i8, I8),
            }
        }
        TokenSlice::Bytes(self.dtype, bytes)
    }

    /// Tokens `offset..offset + len` of sequence `i`, appended to `out`.
    pub fn get(&self, i: usize, offset: usize, len: usize, out: &mut Vec<u32>) {
        match self.slice(i, offset, len) {
            TokenSlice::U16(v) => return out.extend(v.iter().map(|&x| x as u32)),
            TokenSlice::I32(v) => return out.extend(v.iter().map(|&x| x as u32)),
            TokenSlice::U8(v) => return out.extend(v.iter().map(|&x| x as u32)),
            _ => {}
        }
        let sz = self.dtype.size();
        let start = self.pointer(i) as usize + offset * sz;
        let bytes = &self.bin[start..start + len * sz];
        match self.dtype {
            TokenDType::U8 => out.extend(bytes.iter().map(|&b| b as u32)),
            TokenDType::I8 => out.extend(bytes.iter().map(|&b| b as i8 as u32)),
            TokenDType::U16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32),
            ),
            TokenDType::I16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| i16::from_le_bytes([c[0], c[1]]) as u32),
            ),
            TokenDType::I32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u32),
            ),
            TokenDType::I64 => out.extend(
                bytes
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8")) as u32),
            ),
        }
    }

    /// The whole of sequence `i`.
    pub fn item(&self, i: usize) -> Vec<u32> {
        let mut v = Vec::with_capacity(self.length(i));
        self.get(i, 0, self.length(i), &mut v);
        v
    }
}

/// A zero-copy view of tokens in their stored type; `Bytes` where the platform or alignment does
/// not allow a typed view (decode with [`IndexedDataset::get`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TokenSlice<'a> {
    U8(&'a [u8]),
    I8(&'a [i8]),
    I16(&'a [i16]),
    U16(&'a [u16]),
    I32(&'a [i32]),
    I64(&'a [i64]),
    Bytes(TokenDType, &'a [u8]),
}
