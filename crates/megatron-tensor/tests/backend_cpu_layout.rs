use megatron_tensor::cpu::{gather_group_blocks, scatter_group_blocks, GroupBlocks};

#[test]
fn group_blocks_gather_query_heads_and_keys_and_scatter_back() {
    // 2 rows x 2 groups x (2 query heads + k + v) x width 3, values numbered by position.
    let (rows, groups, per, w) = (2, 2, 4, 3);
    let x: Vec<f32> = (0..rows * groups * per * w).map(|i| i as f32).collect();
    let q = GroupBlocks {
        groups,
        blocks_per_group: per,
        width: w,
        lo: 0,
        hi: 2,
    };
    let mut out = vec![0.0; rows * groups * 2 * w];
    gather_group_blocks(&mut out, &x, rows, q);
    let mut want = Vec::new();
    for r in 0..rows {
        for g in 0..groups {
            let base = (r * groups + g) * per * w;
            want.extend((base..base + 2 * w).map(|i| i as f32));
        }
    }
    assert_eq!(out, want);
    let k = GroupBlocks { lo: 2, hi: 3, ..q };
    let mut keys = vec![0.0; rows * groups * w];
    gather_group_blocks(&mut keys, &x, rows, k);
    assert_eq!(&keys[..3], &[6.0, 7.0, 8.0]);
    assert_eq!(&keys[3..6], &[18.0, 19.0, 20.0]);
    // Scatter negated keys back: only the key blocks change.
    let neg: Vec<f32> = keys.iter().map(|v| -v).collect();
    let mut y = x.clone();
    scatter_group_blocks(&mut y, &neg, rows, k);
    for (i, (a, b)) in y.iter().zip(&x).enumerate() {
        let block = (i / w) % per;
        if block == 2 {
            assert_eq!(*a, -b, "{i}");
        } else {
            assert_eq!(a, b, "{i}");
        }
    }
}
