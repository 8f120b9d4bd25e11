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
