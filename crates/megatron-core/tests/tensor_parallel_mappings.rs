//! Each region operator on closed-form inputs (Megatron style: the input is the rank id).

use megatron_comm::run_ranks;
use megatron_core::tensor_parallel::mappings::*;
use megatron_core::tensor_parallel::Tp;
use megatron_tensor::Tensor;

fn filled(shape: &[usize], v: f32) -> Tensor {
    Tensor::from_vec(shape, vec![v; shape.iter().product()]).unwrap()
}

fn indexed(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::from_vec(shape, (0..n).map(|i| i as f32).collect()).unwrap()
}

#[test]
fn region_operators_tp2_and_tp4_have_closed_form_results() {
    for p in [2usize, 4] {
        let out = run_ranks(p, move |rank, c| {
            let mut tp = Tp::new(c, false);
            let r = rank as f32;
            let tri = (p * (p - 1) / 2) as f32;
            // copy_to: identity forward, all-reduce backward.
            let x = copy_to_tensor_model_parallel_region_forward(filled(&[2, 3], r));
            assert_eq!(x.data(), &[r; 6]);
            let dx =
                copy_to_tensor_model_parallel_region_backward(&mut tp, filled(&[2, 3], r)).unwrap();
            assert_eq!(dx.data(), &[tri; 6]);
            // reduce_from: all-reduce forward, identity backward.
            let y = reduce_from_tensor_model_parallel_region_forward(&mut tp, filled(&[2, 3], r))
                .unwrap();
            assert_eq!(y.data(), &[tri; 6]);
            let dy = reduce_from_tensor_model_parallel_region_backward(filled(&[2, 3], r));
            assert_eq!(dy.data(), &[r; 6]);
            // scatter_to (last dim): keep own columns; backward all-gathers columns.
            let x = indexed(&[2, 2 * p]);
            let s = scatter_to_tensor_model_parallel_region_forward(&tp, x);
            let w = 2 * p;
            let want: Vec<f32> = (0..2)
                .flat_map(|row| (0..2).map(move |k| (row * w + 2 * rank + k) as f32))
                .collect();
            assert_eq!(s.data(), &want[..]);
            let g = scatter_to_tensor_model_parallel_region_backward(&mut tp, filled(&[2, 2], r))
                .unwrap();
            let want: Vec<f32> = (0..2)
                .flat_map(|_| (0..p).flat_map(|q| [q as f32, q as f32]))
                .collect();
            assert_eq!(g.shape(), &[2, 2 * p]);
            assert_eq!(g.data(), &want[..]);
            // gather_from (last dim): all-gather columns; backward keeps own columns.
            let g = gather_from_tensor_model_parallel_region_forward(&mut tp, filled(&[2, 2], r))
                .unwrap();
            assert_eq!(g.data(), &want[..]);
            let s = gather_from_tensor_model_parallel_region_backward(&tp, g);
            assert_eq!(s.data(), &[r; 4]);
            // gather_from_sequence_parallel: all-gather rows; backward reduce-scatters rows.
            let g =
                gather_from_sequence_parallel_region_forward(&mut tp, &filled(&[2, 3], r)).unwrap();
            let want: Vec<f32> = (0..p).flat_map(|q| [q as f32; 6]).collect();
            assert_eq!(g.data(), &want[..]);
            let d = gather_from_sequence_parallel_region_backward(&mut tp, &filled(&[2 * p, 3], r))
                .unwrap();
            assert_eq!((d.shape(), d.data()), (&[2usize, 3][..], &[tri; 6][..]));
            // reduce_scatter_to_sequence_parallel: reduce-scatter rows; backward all-gathers.
            let x = indexed(&[2 * p, 3]);
            let y = reduce_scatter_to_sequence_parallel_region_forward(&mut tp, &x).unwrap();
            let want: Vec<f32> = (0..6).map(|i| (p * (rank * 6 + i)) as f32).collect();
            assert_eq!(y.data(), &want[..]);
            let d =
                reduce_scatter_to_sequence_parallel_region_backward(&mut tp, &filled(&[2, 3], r))
                    .unwrap();
            let want: Vec<f32> = (0..p).flat_map(|q| [q as f32; 6]).collect();
            assert_eq!(d.data(), &want[..]);
            // scatter_to_sequence_parallel: keep own rows; backward all-gathers.
            let s = scatter_to_sequence_parallel_region_forward(&tp, &indexed(&[2 * p, 3]));
            let want: Vec<f32> = (rank * 6..rank * 6 + 6).map(|i| i as f32).collect();
            assert_eq!(s.data(), &want[..]);
            let d =
                scatter_to_sequence_parallel_region_backward(&mut tp, &filled(&[2, 3], r)).unwrap();
            assert_eq!(d.shape(), &[2 * p, 3]);
        });
        for r in out {
            r.unwrap();
        }
    }
}

#[test]
fn region_operators_move_nothing_on_one_rank() {
    let out = run_ranks(1, |_, c| {
        let mut tp = Tp::new(c, true);
        assert!(!tp.sequence_parallel, "sequence parallelism needs TP > 1");
        let x = indexed(&[2, 3]);
        let y = reduce_from_tensor_model_parallel_region_forward(&mut tp, x.clone()).unwrap();
        let g = gather_from_tensor_model_parallel_region_forward(&mut tp, x.clone()).unwrap();
        assert_eq!((y.data(), g.data()), (x.data(), x.data()));
        tp.comm.stats().calls.values().sum::<u64>()
    });
    assert_eq!(out[0], Ok(0));
}

/// Under `--bf16` a norm's output reaches the column-parallel GEMM as bf16: sequence
/// parallelism all-gathers it as bf16, every value's bits intact (odd row widths included).
#[test]
fn sequence_parallel_gather_of_bf16_rows_keeps_every_bit() {
    let out = run_ranks(3, |rank, c| {
        let mut tp = Tp::new(c, true);
        let rows = |q: usize| {
            Tensor::from_vec(
                &[2, 3],
                (0..6).map(|i| (q * 6 + i) as f32 * 0.37 + 1e-3).collect(),
            )
            .unwrap()
            .to_dtype(megatron_tensor::DType::BF16)
        };
        let g = gather_from_sequence_parallel_region_forward(&mut tp, &rows(rank)).unwrap();
        assert_eq!(g.dtype(), megatron_tensor::DType::BF16);
        assert_eq!(g.shape(), &[6, 3]);
        let want: Vec<f32> = (0..3)
            .flat_map(|q| {
                rows(q)
                    .to_dtype(megatron_tensor::DType::F32)
                    .data()
                    .to_vec()
            })
            .collect();
        let got = g.to_dtype(megatron_tensor::DType::F32);
        assert!(got
            .data()
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    });
    for r in out {
        r.unwrap();
    }
}
