use megatron_core::params::{view2d, Init, Params, Sharding};

/// Every local element of every TP rank, through `global_segments` of assorted sub-ranges,
/// lands where `global_index_on` says.
#[test]
fn global_segments_cover_local_ranges_where_global_index_says() {
    let cases: &[(&[usize], Sharding)] = &[
        (&[12, 8], Sharding::Split(0)),
        (&[12, 8], Sharding::Split(1)),
        (&[16, 6], Sharding::SplitChunks(2)),
        (&[16], Sharding::SplitChunks(2)),
        (&[12], Sharding::Split(0)),
        (&[12, 8], Sharding::Replicated),
        (&[7], Sharding::ReplicatedSequenceParallel),
    ];
    for &(shape, sharding) in cases {
        for tp in [1usize, 2, 4] {
            if sharding == Sharding::Split(1) && shape[1] % tp != 0 {
                continue;
            }
            for rank in 0..tp {
                let mut p = Params::for_tp_rank(rank, tp);
                let id = p.add_sharded(
                    &mut Vec::new(),
                    "t".into(),
                    shape,
                    true,
                    Init::Const(0.0),
                    sharding,
                );
                let m = p.metas[id.0].clone();
                let (_, gc) = view2d(&m.shape);
                let n = m.numel;
                for (a, b) in [
                    (0, n),
                    (1, n - 1),
                    (3, n / 2 + 1),
                    (n / 3, n),
                    (0, 1),
                    (n - 1, n),
                ] {
                    if a >= b {
                        continue;
                    }
                    let mut seen = vec![false; b - a];
                    for s in m.global_segments(a..b, rank) {
                        for i in 0..s.rows {
                            for j in 0..s.cols {
                                let local = s.local_start + i * s.local_stride + j;
                                assert!((a..b).contains(&local), "{shape:?} {sharding:?} tp {tp}");
                                assert!(!seen[local - a], "element {local} twice");
                                seen[local - a] = true;
                                assert_eq!(
                                    (s.row + i) * gc + s.col + j,
                                    m.global_index_on(local, rank),
                                    "{shape:?} {sharding:?} tp {tp} rank {rank} local {local}"
                                );
                            }
                        }
                    }
                    assert!(
                        seen.iter().all(|x| *x),
                        "{shape:?} {sharding:?} tp {tp}: {a}..{b} not covered"
                    );
                }
            }
        }
    }
}

/// A matmul operand of a `--bf16` model is the 16-bit copy itself (no widened copy per call),
/// holding exactly what `get` widens; under fp16 or fp32 it is the values `get` gives.
#[test]
fn operand_is_the_bf16_copy_as_stored_and_the_values_otherwise() {
    use megatron_core::params::ParamOperand;
    use megatron_tensor::cpu::cast::Half;
    for half in [None, Some(Half::BF16), Some(Half::F16)] {
        let mut p = Params::for_tp_rank(0, 1);
        let mut inits = Vec::new();
        let a = p.add_sharded(
            &mut inits,
            "a".into(),
            &[3, 4],
            true,
            Init::Const(0.0),
            Sharding::Replicated,
        );
        let b = p.add_sharded(
            &mut inits,
            "b".into(),
            &[5],
            false,
            Init::Const(0.0),
            Sharding::Replicated,
        );
        p.data = (0..p.numel())
            .map(|i| (i as f32 * 0.37).sin() * 3.0)
            .collect();
        p.set_half(half);
        for id in [a, b] {
            let want = p.get(id).to_vec();
            match (p.operand(id), half) {
                (ParamOperand::BF16(v), Some(Half::BF16)) => {
                    let widened: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
                    assert_eq!(widened, want);
                }
                (ParamOperand::Values(v), None | Some(Half::F16)) => assert_eq!(&v[..], &want[..]),
                (_, h) => panic!("{h:?}: the wrong form"),
            }
        }
    }
}
