//! Collectives on element types other than f32, on top of any `Communicator`: bf16 and f16 are
//! reduced in f32; integers move as exact bit patterns (one f32 word per 32 bits) and are reduced
//! exactly, after an all-gather, in 64-bit integer arithmetic.

use crate::communicator::{CommError, Communicator, ReduceOp};
use half::{bf16, f16};

/// Bit-exact packing of integer data into f32 words (no arithmetic ever touches them).
fn words_from_i64(x: &[i64]) -> Vec<f32> {
    x.iter()
        .flat_map(|v| {
            [
                f32::from_bits(*v as u64 as u32),
                f32::from_bits((*v as u64 >> 32) as u32),
            ]
        })
        .collect()
}
fn i64_from_words(w: &[f32]) -> Vec<i64> {
    w.chunks_exact(2)
        .map(|c| ((c[1].to_bits() as u64) << 32 | c[0].to_bits() as u64) as i64)
        .collect()
}

fn reduce_i64(acc: &mut [i64], x: &[i64], op: ReduceOp) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a = match op {
            ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(*b),
            ReduceOp::Max => (*a).max(*b),
            ReduceOp::Min => (*a).min(*b),
        };
    }
}

pub trait TypedCollectives: Communicator {
    fn all_reduce_bf16(&mut self, buf: &mut [bf16], op: ReduceOp) -> Result<(), CommError> {
        let mut f: Vec<f32> = buf.iter().map(|v| v.to_f32()).collect();
        self.all_reduce(&mut f, op)?;
        buf.iter_mut()
            .zip(&f)
            .for_each(|(o, v)| *o = bf16::from_f32(*v));
        Ok(())
    }

    fn all_reduce_f16(&mut self, buf: &mut [f16], op: ReduceOp) -> Result<(), CommError> {
        let mut f: Vec<f32> = buf.iter().map(|v| v.to_f32()).collect();
        self.all_reduce(&mut f, op)?;
        buf.iter_mut()
            .zip(&f)
            .for_each(|(o, v)| *o = f16::from_f32(*v));
        Ok(())
    }

    /// Exact integer all-reduce (`Avg` rounds toward zero).
    fn all_reduce_i64(&mut self, buf: &mut [i64], op: ReduceOp) -> Result<(), CommError> {
        let p = self.size();
        let mut all = vec![0.0f32; 2 * buf.len() * p];
        self.all_gather(&words_from_i64(buf), &mut all)?;
        let per = 2 * buf.len();
        let mut acc = i64_from_words(&all[..per]);
        for r in 1..p {
            reduce_i64(&mut acc, &i64_from_words(&all[r * per..(r + 1) * per]), op);
        }
        if op == ReduceOp::Avg {
            acc.iter_mut().for_each(|v| *v /= p as i64);
        }
        buf.copy_from_slice(&acc);
        Ok(())
    }

    fn all_reduce_i32(&mut self, buf: &mut [i32], op: ReduceOp) -> Result<(), CommError> {
        let mut wide: Vec<i64> = buf.iter().map(|&v| v as i64).collect();
        self.all_reduce_i64(&mut wide, op)?;
        buf.iter_mut().zip(&wide).for_each(|(o, v)| *o = *v as i32);
        Ok(())
    }

    fn all_gather_i64(&mut self, input: &[i64], out: &mut [i64]) -> Result<(), CommError> {
        let mut w = vec![0.0f32; 2 * out.len()];
        self.all_gather(&words_from_i64(input), &mut w)?;
        out.copy_from_slice(&i64_from_words(&w));
        Ok(())
    }

    /// bf16 moved as exact bit patterns, two to an f32 word (an odd length pads its last
    /// word): half the bytes of widening to f32 first, which is how Megatron all-gathers its
    /// 16-bit activations under sequence parallelism.
    fn all_gather_bf16(&mut self, input: &[bf16], out: &mut [bf16]) -> Result<(), CommError> {
        let words = input.len().div_ceil(2);
        let packed: Vec<f32> = input
            .chunks(2)
            .map(|c| {
                let hi = c.get(1).map_or(0, |v| v.to_bits()) as u32;
                f32::from_bits(c[0].to_bits() as u32 | hi << 16)
            })
            .collect();
        let mut all = vec![0.0f32; words * self.size()];
        self.all_gather(&packed, &mut all)?;
        for (o, w) in out
            .chunks_mut(input.len().max(1))
            .zip(all.chunks(words.max(1)))
        {
            for (pair, word) in o.chunks_mut(2).zip(w) {
                let bits = word.to_bits();
                pair[0] = bf16::from_bits(bits as u16);
                if let Some(v) = pair.get_mut(1) {
                    *v = bf16::from_bits((bits >> 16) as u16);
                }
            }
        }
        Ok(())
    }

    fn broadcast_i64(&mut self, buf: &mut [i64], root: usize) -> Result<(), CommError> {
        let mut w = words_from_i64(buf);
        self.broadcast(&mut w, root)?;
        buf.copy_from_slice(&i64_from_words(&w));
        Ok(())
    }

    /// Bytes (e.g. serialized metadata), padded to whole words in transit.
    fn broadcast_u8(&mut self, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        let mut w: Vec<f32> = buf
            .chunks(4)
            .map(|c| {
                let mut b = [0u8; 4];
                b[..c.len()].copy_from_slice(c);
                f32::from_bits(u32::from_le_bytes(b))
            })
            .collect();
        self.broadcast(&mut w, root)?;
        for (c, v) in buf.chunks_mut(4).zip(&w) {
            let b = v.to_bits().to_le_bytes();
            let n = c.len();
            c.copy_from_slice(&b[..n]);
        }
        Ok(())
    }
}

impl<C: Communicator + ?Sized> TypedCollectives for C {}
