//! Minimal `.npy` (format 1.0) for 1-D and 2-D little-endian arrays: the index caches (`<i8`)
//! are written in numpy's format so they can be inspected (and loaded) with numpy, and
//! `megatron embed` writes its vectors (`<f4`) for numpy.

use crate::DataError;
use std::io::Write;
use std::path::Path;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Writes `data` (`<i8`, row-major) with `shape`, via a temporary file renamed into place.
pub fn write_i64(path: &Path, shape: &[usize], data: &[i64]) -> Result<(), DataError> {
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_raw(path, "<i8", shape, data.len(), &bytes)
}

/// Writes `data` (`<f4`, row-major) with `shape` (embeddings for numpy), atomically.
pub fn write_f32(path: &Path, shape: &[usize], data: &[f32]) -> Result<(), DataError> {
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_raw(path, "<f4", shape, data.len(), &bytes)
}

fn write_raw(
    path: &Path,
    descr: &str,
    shape: &[usize],
    len: usize,
    data: &[u8],
) -> Result<(), DataError> {
    assert_eq!(shape.iter().product::<usize>(), len);
    let shape_s = match shape {
        [n] => format!("({n},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_s}, }}");
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - total % 64) % 64));
    header.push('\n');
    let mut bytes = Vec::with_capacity(10 + header.len() + data.len());
    bytes.extend_from_slice(b"\x93NUMPY\x01\x00");
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    // One temporary name per write: rank threads of one process write the same cache entry
    // at once, and a name shared between them would be renamed away under another's rename.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("npy.tmp-{}-{n}", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(&bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// Reads an array written by [`write_i64`] (or by numpy with dtype `<i8`).
pub fn read_i64(path: &Path) -> Result<(Vec<usize>, Vec<i64>), DataError> {
    let bytes = std::fs::read(path).map_err(io(path))?;
    let bad = |m: &str| DataError::Format {
        path: path.display().to_string(),
        msg: m.to_string(),
    };
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad("not a .npy file"));
    }
    let hl = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(
        bytes
            .get(10..10 + hl)
            .ok_or_else(|| bad("truncated header"))?,
    )
    .map_err(|_| bad("header not UTF-8"))?;
    if !header.contains("'descr': '<i8'") || header.contains("'fortran_order': True") {
        return Err(bad("expected a C-order <i8 array"));
    }
    let inner = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .ok_or_else(|| bad("no shape"))?;
    let shape: Vec<usize> = inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| bad("bad shape")))
        .collect::<Result<_, _>>()?;
    let n: usize = shape.iter().product();
    let body = &bytes[10 + hl..];
    if body.len() != n * 8 {
        return Err(bad("truncated data"));
    }
    Ok((
        shape,
        body.chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8")))
            .collect(),
    ))
}
