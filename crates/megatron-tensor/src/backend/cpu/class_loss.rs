//! Softmax cross-entropy over the first `valid[i]` of each row's logits: a tabular
//! classification target has 2-10 classes and a regression target one bin per border interval,
//! so one head of fixed width serves every table and the unused logits take no probability.
//! Rows are few (a table's query rows) and narrow (at most a few dozen logits).

/// `losses[i] = logsumexp(l_i[..k_i]) - l_i[t_i]` with `k_i = valid[i]`; with `dlogits`, writes
/// `(softmax - onehot) * dloss[i]` on the first `k_i` logits and 0 on the rest.
pub fn masked_cross_entropy(
    losses: &mut [f32],
    mut dlogits: Option<&mut [f32]>,
    logits: &[f32],
    targets: &[u32],
    valid: &[u32],
    dloss: &[f32],
    width: usize,
) {
    let n = losses.len();
    assert_eq!(logits.len(), n * width);
    assert_eq!(targets.len(), n);
    assert_eq!(valid.len(), n);
    for i in 0..n {
        let k = (valid[i] as usize).clamp(1, width);
        let row = &logits[i * width..i * width + k];
        let t = (targets[i] as usize).min(k - 1);
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = row.iter().map(|&v| ((v - max) as f64).exp()).sum();
        let lse = max as f64 + sum.ln();
        losses[i] = (lse - row[t] as f64) as f32;
        if let Some(d) = dlogits.as_deref_mut() {
            let drow = &mut d[i * width..(i + 1) * width];
            drow.fill(0.0);
            for (j, (g, &v)) in drow.iter_mut().zip(row).enumerate() {
                let p = ((v as f64 - lse).exp()) as f32;
                *g = (p - f32::from(u8::from(j == t))) * dloss[i];
            }
        }
    }
}
