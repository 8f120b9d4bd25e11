//! Megatron's `--rotary-interleaved` rotates each head's feature pairs `(2i, 2i + 1)`; the
//! Hugging Face Llama family rotates `(i, i + d/2)` (rotate-half), with the same frequency for
//! pair `i`. The two are the same attention after one permutation of every query and key head's
//! features: scores are dot products, and a permutation applied to both sides leaves them
//! unchanged. The export applies it to the query and key rows of the fused QKV weight and bias
//! and to the query/key norms' weights; values and the output projection do not move.

use super::gguf::{rope_rows, Direction};
use super::Tensors;
use megatron_core::TransformerConfig;

/// `heads` heads of `hd` rows (each `cols` wide) from `row0` on, interleaved pairs to
/// rotate-half: the permutation llama.cpp's Llama files undo on import, the same one.
fn to_rotate_half(x: &mut [f32], row0: usize, heads: usize, hd: usize, cols: usize) {
    let rows = &mut x[row0 * cols..(row0 + heads * hd) * cols];
    let moved = rope_rows(rows, heads, hd, cols, Direction::FromGguf);
    rows.copy_from_slice(&moved);
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
    let per_group = heads / groups + 2;
    for l in 0..cfg.num_layers {
        let at = |name: &str| format!("decoder.layers.{l}.self_attention.{name}");
        for (name, cols) in [("linear_qkv.weight", h), ("linear_qkv.bias", 1)] {
            let Some((_, x)) = m.get_mut(&at(name)) else {
                continue;
            };
            // Per query group: its query heads, then its key head, side by side (the value
            // head after them stays).
            for g in 0..groups {
                to_rotate_half(x, g * per_group * hd, per_group - 1, hd, cols);
            }
        }
        for name in ["q_layernorm.weight", "k_layernorm.weight"] {
            if let Some((_, x)) = m.get_mut(&at(name)) {
                to_rotate_half(x, 0, 1, hd, 1);
            }
        }
    }
    cfg.rotary.interleaved = false;
    Ok(())
}
