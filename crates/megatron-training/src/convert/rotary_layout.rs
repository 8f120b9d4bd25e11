//! Megatron's `--rotary-interleaved` rotates each head's feature pairs `(2i, 2i + 1)`; the
//! Hugging Face Llama family rotates `(i, i + d/2)` (rotate-half), with the same frequency for
//! pair `i`. The two are the same attention after one permutation of every query and key head's
//! features: scores are dot products, and a permutation applied to both sides leaves them
//! unchanged. The export applies it to the query and key rows of the fused QKV weight and bias
//! and to the query/key norms' weights; values and the output projection do not move.

use super::Tensors;
use megatron_core::TransformerConfig;

/// The feature order that turns interleaved pairs into rotate-half pairs: new `i` is old `2i`,
/// new `i + d/2` is old `2i + 1`.
fn rotate_half_order(hd: usize) -> Vec<usize> {
    (0..hd / 2)
        .map(|i| 2 * i)
        .chain((0..hd / 2).map(|i| 2 * i + 1))
        .collect()
}

/// Rows `row0..row0 + order.len()` of a matrix of `cols` columns, reordered by `order`.
fn permute_rows(x: &mut [f32], row0: usize, cols: usize, order: &[usize]) {
    let block = &mut x[row0 * cols..(row0 + order.len()) * cols];
    let old = block.to_vec();
    for (new, &o) in order.iter().enumerate() {
        block[new * cols..(new + 1) * cols].copy_from_slice(&old[o * cols..(o + 1) * cols]);
    }
}

/// An interleaved-rotary checkpoint's tensors as the rotate-half model that computes the same
/// scores; `cfg` then says rotate-half. Nothing changes for a rotate-half checkpoint.
pub(crate) fn interleaved_to_rotate_half(
    cfg: &mut TransformerConfig,
    m: &mut Tensors,
) -> Result<(), String> {
    if !cfg.rotary.interleaved {
        return Ok(());
    }
    let (heads, groups, hd, h) = (
        cfg.num_attention_heads,
        cfg.query_groups(),
        cfg.head_dim(),
        cfg.hidden_size,
    );
    if hd % 2 != 0 {
        return Err(format!("--rotary-interleaved with an odd head size {hd}"));
    }
    let order = rotate_half_order(hd);
    let per_group = heads / groups + 2;
    for l in 0..cfg.num_layers {
        let at = |name: &str| format!("decoder.layers.{l}.self_attention.{name}");
        for (name, cols) in [("linear_qkv.weight", h), ("linear_qkv.bias", 1)] {
            let Some((_, x)) = m.get_mut(&at(name)) else {
                continue;
            };
            // Per query group: its query heads, then its key head (the value head stays).
            for g in 0..groups {
                for head in 0..per_group - 1 {
                    permute_rows(x, (g * per_group + head) * hd, cols, &order);
                }
            }
        }
        for name in ["q_layernorm.weight", "k_layernorm.weight"] {
            if let Some((_, x)) = m.get_mut(&at(name)) {
                permute_rows(x, 0, 1, &order);
            }
        }
    }
    cfg.rotary.interleaved = false;
    Ok(())
}
