mod common;
use common::*;
use megatron_tensor::cpu::{embedding_backward, embedding_forward};

#[test]
fn embedding_forward_adds_token_and_position_rows() {
    let (b, t, c, v) = (2, 3, 4, 5);
    let wte = randn(v * c, 1, 1.0);
    let wpe = randn(t * c, 2, 1.0);
    let tokens = [4u32, 0, 2, 2, 1, 3];
    let mut out = vec![0.0; b * t * c];
    embedding_forward(&mut out, &tokens, None, &wte, &wpe, t);
    for i in 0..b * t {
        for j in 0..c {
            let want = wte[tokens[i] as usize * c + j] + wpe[(i % t) * c + j];
            assert!((out[i * c + j] - want).abs() < 1e-7);
        }
    }
}

#[test]
fn embedding_backward_matches_finite_difference() {
    let (b, t, c, v) = (2, 3, 4, 5);
    let mut wte = randn(v * c, 3, 1.0);
    let mut wpe = randn(t * c, 4, 1.0);
    let tokens = [4u32, 0, 2, 2, 1, 2];
    let r = randn(b * t * c, 5, 1.0);
    let (mut dwte, mut dwpe) = (vec![0.0; v * c], vec![0.0; t * c]);
    embedding_backward(&mut dwte, &mut dwpe, &r, &tokens, None, t);
    let f = |wte: &[f32], wpe: &[f32]| {
        let mut o = vec![0.0; b * t * c];
        embedding_forward(&mut o, &tokens, None, wte, wpe, t);
        dot(&o, &r)
    };
    let wpec = wpe.clone();
    check_grad(
        &mut wte,
        &dwte,
        |w| f(w, &wpec),
        1e-2,
        1e-3,
        1e-3,
        20,
        "dwte",
    );
    let wtec = wte.clone();
    check_grad(
        &mut wpe,
        &dwpe,
        |w| f(&wtec, w),
        1e-2,
        1e-3,
        1e-3,
        12,
        "dwpe",
    );
}

#[test]
fn embedding_with_explicit_positions_matches_finite_difference() {
    let (b, t, c, v) = (1, 6, 3, 5);
    let tokens = [1u32, 2, 3, 4, 0, 1];
    let positions = [0u32, 1, 2, 0, 1, 2];
    let wte = randn(v * c, 6, 1.0);
    let mut wpe = randn(t * c, 7, 1.0);
    let mut out = vec![0.0; b * t * c];
    embedding_forward(&mut out, &tokens, Some(&positions), &wte, &wpe, t);
    for i in 0..t {
        for j in 0..c {
            let want = wte[tokens[i] as usize * c + j] + wpe[positions[i] as usize * c + j];
            assert!((out[i * c + j] - want).abs() < 1e-7);
        }
    }
    let r = randn(b * t * c, 8, 1.0);
    let (mut dwte, mut dwpe) = (vec![0.0; v * c], vec![0.0; t * c]);
    embedding_backward(&mut dwte, &mut dwpe, &r, &tokens, Some(&positions), t);
    assert!(
        dwpe[3 * c..].iter().all(|g| *g == 0.0),
        "positions 3.. are never used"
    );
    check_grad(
        &mut wpe,
        &dwpe,
        |w| {
            let mut o = vec![0.0; b * t * c];
            embedding_forward(&mut o, &tokens, Some(&positions), &wte, w, t);
            dot(&o, &r)
        },
        1e-2,
        1e-3,
        1e-3,
        18,
        "dwpe",
    );
}

#[test]
fn vocab_range_lookups_sum_to_the_fused_embedding_and_its_gradient() {
    use megatron_tensor::cpu::{embedding_lookup_backward, embedding_lookup_forward};
    let (v, c, t) = (12usize, 5usize, 4usize);
    let tokens: Vec<u32> = vec![0, 11, 5, 5, 7, 2, 11, 3];
    let wte: Vec<f32> = (0..v * c).map(|i| (i as f32 * 0.37).sin()).collect();
    let wpe: Vec<f32> = (0..t * c).map(|i| (i as f32 * 0.11).cos()).collect();
    let n = tokens.len();
    let mut want = vec![0.0; n * c];
    embedding_forward(&mut want, &tokens, None, &wte, &wpe, t);
    let dout: Vec<f32> = (0..n * c).map(|i| (i % 7) as f32 - 3.0).collect();
    let (mut want_dwte, mut want_dwpe) = (vec![0.0; v * c], vec![0.0; t * c]);
    embedding_backward(&mut want_dwte, &mut want_dwpe, &dout, &tokens, None, t);
    // Three vocabulary shards (ids outside a shard give zeros) plus the position rows.
    let shard = v / 3;
    let mut got = vec![0.0; n * c];
    let mut dwte = vec![0.0; v * c];
    for s in 0..3 {
        let rows = &wte[s * shard * c..(s + 1) * shard * c];
        let mut part = vec![7.0; n * c];
        embedding_lookup_forward(&mut part, &tokens, rows, s * shard, false);
        got.iter_mut().zip(&part).for_each(|(a, b)| *a += b);
        embedding_lookup_backward(
            &mut dwte[s * shard * c..(s + 1) * shard * c],
            &dout,
            &tokens,
            s * shard,
        );
    }
    let positions: Vec<u32> = (0..n).map(|i| (i % t) as u32).collect();
    embedding_lookup_forward(&mut got, &positions, &wpe, 0, true);
    let mut dwpe = vec![0.0; t * c];
    embedding_lookup_backward(&mut dwpe, &dout, &positions, 0);
    for (a, b) in got.iter().zip(&want) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
    assert_eq!(dwte, want_dwte);
    assert_eq!(dwpe, want_dwpe);
}

#[test]
fn a_bf16_table_looks_up_the_widened_rows_exactly() {
    // A `--bf16` model's embedding is looked up in its 16-bit copy: each row widened as looked
    // up, the same bits as a lookup in the whole table widened first.
    use half::bf16;
    use megatron_tensor::cpu::embedding_lookup_forward;
    let (v, c) = (10usize, 6usize);
    let table: Vec<bf16> = (0..v * c)
        .map(|i| bf16::from_f32((i as f32 * 0.61).sin()))
        .collect();
    let wide: Vec<f32> = table.iter().map(|x| x.to_f32()).collect();
    let ids: Vec<u32> = vec![9, 0, 4, 4, 13, 7];
    for accumulate in [false, true] {
        let start: Vec<f32> = (0..ids.len() * c).map(|i| i as f32 * 0.5).collect();
        let (mut got, mut want) = (start.clone(), start.clone());
        embedding_lookup_forward(&mut got, &ids, &table[2 * c..], 2, accumulate);
        embedding_lookup_forward(&mut want, &ids, &wide[2 * c..], 2, accumulate);
        let same = got
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "accumulate {accumulate}: {got:?} vs {want:?}");
        // Ids below the shard (0) and past it (13) are not this rank's: zeros, or untouched.
        let row0 = &got[c..2 * c];
        if accumulate {
            assert_eq!(row0, &start[c..2 * c]);
        } else {
            assert!(row0.iter().all(|&x| x == 0.0));
        }
    }
}
