//! Attention sinks (megatron-core's `--softmax-type off-by-one|learnable`, gpt-oss): each
//! head's softmax has one more logit `s_h` in its denominator, with no value behind it, so
//! `p_j = exp(x_j) / (exp(s_h) + sum_k exp(x_k))`.
//!
//! Applied to a finished attention output rather than inside the kernels, so the blockwise,
//! packed and ring kernels stay as they are: the sink's softmax is the plain one times
//! `c = sigmoid(lse - s_h)` (`lse` the plain row's log-sum-exp), and its log-sum-exp is
//! `logaddexp(lse, s_h)`. The kernels' backward, given that output and log-sum-exp, recomputes
//! the sink's probabilities and `D = rowsum(dO * O)` and so yields the sink's gradients for
//! Q, K and V unchanged; the sink's own gradient is `-sum_rows exp(s_h - lse') * D`.
//!
//! Layout as the attention kernels': `out` `[b, t, heads, head_dim]`, `lse` `[b, heads, t]`.

use rayon::prelude::*;

/// Shapes: `sink` holds one logit per head of `heads`.
#[derive(Clone, Copy, Debug)]
pub struct SinkDims {
    pub b: usize,
    pub t: usize,
    pub heads: usize,
    pub head_dim: usize,
}

/// Scales `out` and moves `lse` to the sink's softmax. A row that saw no key (infinite
/// `lse`, zero output) stays zero with the sink's logit as its log-sum-exp.
pub fn attention_sink_forward(out: &mut [f32], lse: &mut [f32], sink: &[f32], d: SinkDims) {
    let (t, hd) = (d.t, d.head_dim);
    assert_eq!(sink.len(), d.heads);
    assert_eq!(out.len(), d.b * t * d.heads * hd);
    assert_eq!(lse.len(), d.b * d.heads * t);
    out.par_chunks_mut(t * d.heads * hd)
        .zip(lse.par_chunks_mut(d.heads * t))
        .for_each(|(o, l)| {
            for h in 0..d.heads {
                let s = sink[h];
                for i in 0..t {
                    let x = l[h * t + i];
                    let row = &mut o[(i * d.heads + h) * hd..][..hd];
                    if x == f32::INFINITY {
                        row.fill(0.0);
                        l[h * t + i] = s;
                        continue;
                    }
                    // c = 1 / (1 + exp(s - lse)), lse' = max + ln(exp(lse - max) + exp(s - max)).
                    let c = 1.0 / (1.0 + (s - x).exp());
                    row.iter_mut().for_each(|v| *v *= c);
                    let m = x.max(s);
                    l[h * t + i] = m + ((x - m).exp() + (s - m).exp()).ln();
                }
            }
        });
}

/// Adds the sink logits' gradient to `dsink` from the sink output `out`, its log-sum-exp
/// `lse` (both as [`attention_sink_forward`] left them) and the output's gradient.
pub fn attention_sink_backward(
    dsink: &mut [f32],
    dout: &[f32],
    out: &[f32],
    lse: &[f32],
    sink: &[f32],
    d: SinkDims,
) {
    let (t, hd) = (d.t, d.head_dim);
    assert_eq!(sink.len(), d.heads);
    assert_eq!(dsink.len(), d.heads);
    assert_eq!(out.len(), d.b * t * d.heads * hd);
    assert_eq!(dout.len(), out.len());
    assert_eq!(lse.len(), d.b * d.heads * t);
    // Per head, summed in f64 over (sequence, row) in order: the same bits for every thread
    // count.
    let per_head: Vec<f64> = (0..d.heads)
        .into_par_iter()
        .map(|h| {
            let mut acc = 0.0f64;
            for bi in 0..d.b {
                for i in 0..t {
                    let at = ((bi * t + i) * d.heads + h) * hd;
                    let dot: f32 = out[at..at + hd]
                        .iter()
                        .zip(&dout[at..at + hd])
                        .map(|(o, g)| o * g)
                        .sum();
                    let p_sink = (sink[h] - lse[(bi * d.heads + h) * t + i]).exp();
                    acc -= (p_sink * dot) as f64;
                }
            }
            acc
        })
        .collect();
    for (g, v) in dsink.iter_mut().zip(per_head) {
        *g += v as f32;
    }
}
