use super::simd::multiversion;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

/// Rounds to nearest even (NaN stays a quiet NaN): the same bits as `half`'s `bf16::from_f32`
/// and as the packed GEMMs' `vcvtne2ps2bf16`, but compiled per instruction set so the loop
/// vectorizes (`half` converts bf16 slices one value at a time).
pub fn f32_to_bf16(out: &mut [bf16], inp: &[f32]) {
    assert_eq!(out.len(), inp.len());
    narrow_bf16(out, inp);
}

/// Exact: a bf16 is the upper half of the f32 with the same value.
pub fn bf16_to_f32(out: &mut [f32], inp: &[bf16]) {
    assert_eq!(out.len(), inp.len());
    widen_bf16(out, inp);
}

/// Elements per parallel task of a whole-tensor cast (memory-bound: a few tasks per core are
/// enough).
const PARALLEL_CHUNK: usize = 1 << 16;

/// [`f32_to_bf16`] of a whole tensor, split over the current thread pool.
pub fn f32_to_bf16_parallel(out: &mut [bf16], inp: &[f32]) {
    assert_eq!(out.len(), inp.len());
    out.par_chunks_mut(PARALLEL_CHUNK)
        .zip(inp.par_chunks(PARALLEL_CHUNK))
        .for_each(|(o, i)| narrow_bf16(o, i));
}

/// [`bf16_to_f32`] of a whole tensor, split over the current thread pool.
pub fn bf16_to_f32_parallel(out: &mut [f32], inp: &[bf16]) {
    assert_eq!(out.len(), inp.len());
    out.par_chunks_mut(PARALLEL_CHUNK)
        .zip(inp.par_chunks(PARALLEL_CHUNK))
        .for_each(|(o, i)| widen_bf16(o, i));
}

multiversion! {
    fn narrow_bf16(out: &mut [bf16], inp: &[f32]) {
        for (o, i) in out.iter_mut().zip(inp) {
            *o = bf16::from_bits((round_bf16(*i).to_bits() >> 16) as u16);
        }
    }
}

multiversion! {
    fn widen_bf16(out: &mut [f32], inp: &[bf16]) {
        for (o, i) in out.iter_mut().zip(inp) {
            *o = f32::from_bits((i.to_bits() as u32) << 16);
        }
    }
}
pub fn f32_to_f16(out: &mut [f16], inp: &[f32]) {
    out.convert_from_f32_slice(inp);
}
pub fn f16_to_f32(out: &mut [f32], inp: &[f16]) {
    inp.convert_to_f32_slice(out);
}

/// A 16-bit floating-point format values are rounded to (`--bf16`, `--fp16`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    BF16,
    F16,
}

/// `out[i] = round(inp[i])` to the nearest representable value of `half` (ties to even),
/// kept as f32: what a 16-bit operand holds, for kernels that compute in f32. Out-of-range
/// values become ±inf in f16, which is how an fp16 overflow shows itself to the loss scaler.
pub fn round_to_half(out: &mut [f32], inp: &[f32], half: Half) {
    assert_eq!(out.len(), inp.len());
    // Copy and round in cache-sized pieces: one pass over memory.
    for (o, i) in out.chunks_mut(1024).zip(inp.chunks(1024)) {
        o.copy_from_slice(i);
        round_to_half_inplace(o, half);
    }
}

/// Rounds in place (see [`round_to_half`]).
pub fn round_to_half_inplace(x: &mut [f32], half: Half) {
    match half {
        Half::BF16 => x.iter_mut().for_each(|v| *v = round_bf16(*v)),
        Half::F16 => {
            // Through a small stack buffer: the `half` crate converts slices with F16C.
            let mut tmp = [f16::ZERO; 1024];
            for c in x.chunks_mut(1024) {
                let t = &mut tmp[..c.len()];
                t.convert_from_f32_slice(c);
                t.convert_to_f32_slice(c);
            }
        }
    }
}

/// f32 -> bf16 -> f32 with round to nearest even, branch-free so the loops above vectorize.
#[inline(always)]
fn round_bf16(x: f32) -> f32 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
    // NaN stays NaN (quiet): rounding could otherwise carry it into infinity.
    let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    f32::from_bits(if nan {
        (b | 0x0040_0000) & 0xffff_0000
    } else {
        rounded
    })
}
