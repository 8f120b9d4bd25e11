//! Token + learned position embedding (Megatron's `LanguageModelEmbedding`).

use rayon::prelude::*;

/// `out[b, t, :] = wte[tokens[b, t], :] + wpe[pos, :]`, `tokens` is `[b, t]` flattened; `pos` is
/// `positions[b, t]` when given (Megatron's `--reset-position-ids`), else `t`.
pub fn embedding_forward(
    out: &mut [f32],
    tokens: &[u32],
    positions: Option<&[u32]>,
    wte: &[f32],
    wpe: &[f32],
    t: usize,
) {
    let c = out.len() / tokens.len().max(1);
    assert!(wpe.len() >= t * c);
    out.par_chunks_mut(c).enumerate().for_each(|(i, o)| {
        let tok = tokens[i] as usize;
        let pos = positions.map_or(i % t, |p| p[i] as usize);
        let e = &wte[tok * c..(tok + 1) * c];
        let p = &wpe[pos * c..(pos + 1) * c];
        for j in 0..c {
            o[j] = e[j] + p[j];
        }
    });
}

/// Accumulates `dwte[tokens[i]] += dout[i]` and `dwpe[i % t] += dout[i]`. Serial over tokens so
/// repeated tokens sum in a fixed order.
pub fn embedding_backward(
    dwte: &mut [f32],
    dwpe: &mut [f32],
    dout: &[f32],
    tokens: &[u32],
    positions: Option<&[u32]>,
    t: usize,
) {
    let c = dout.len() / tokens.len().max(1);
    for (i, g) in dout.chunks_exact(c).enumerate() {
        let tok = tokens[i] as usize;
        let pos = positions.map_or(i % t, |p| p[i] as usize);
        for (a, b) in dwte[tok * c..(tok + 1) * c].iter_mut().zip(g) {
            *a += b;
        }
        for (a, b) in dwpe[pos * c..(pos + 1) * c].iter_mut().zip(g) {
            *a += b;
        }
    }
}

/// One rank's part of a vocabulary-parallel lookup (Megatron's `VocabParallelEmbedding`): rows
/// `[vocab_start, vocab_start + table_rows)` of the global table live in `table`. Row `i` of `out`
/// gets (or, with `accumulate`, adds) `table[ids[i] - vocab_start]`, or zeros when the id is
/// owned by another rank; summing over ranks gives the full lookup. The table as stored (f32,
/// or a `--bf16` model's 16-bit copy): only the rows looked up are widened.
pub fn embedding_lookup_forward<T: Copy + Sync>(
    out: &mut [f32],
    ids: &[u32],
    table: &[T],
    vocab_start: usize,
    accumulate: bool,
) where
    f32: From<T>,
{
    let c = out.len() / ids.len().max(1);
    let rows = table.len() / c.max(1);
    out.par_chunks_mut(c).enumerate().for_each(|(i, o)| {
        let id = ids[i] as usize;
        if id >= vocab_start && id < vocab_start + rows {
            let e = &table[(id - vocab_start) * c..(id - vocab_start + 1) * c];
            if accumulate {
                o.iter_mut().zip(e).for_each(|(a, b)| *a += f32::from(*b));
            } else {
                o.iter_mut().zip(e).for_each(|(a, b)| *a = f32::from(*b));
            }
        } else if !accumulate {
            o.fill(0.0);
        }
    });
}

/// `dtable[ids[i] - vocab_start] += dout[i]` for the ids this rank owns. Serial over rows so
/// repeated ids sum in a fixed order.
pub fn embedding_lookup_backward(
    dtable: &mut [f32],
    dout: &[f32],
    ids: &[u32],
    vocab_start: usize,
) {
    let c = dout.len() / ids.len().max(1);
    let rows = dtable.len() / c.max(1);
    for (i, g) in dout.chunks_exact(c).enumerate() {
        let id = ids[i] as usize;
        if id >= vocab_start && id < vocab_start + rows {
            let r = id - vocab_start;
            dtable[r * c..(r + 1) * c]
                .iter_mut()
                .zip(g)
                .for_each(|(a, b)| *a += b);
        }
    }
}
