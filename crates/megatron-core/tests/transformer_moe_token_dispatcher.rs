//! The token dispatchers move bf16 rows (under `--bf16`) as bit pairs: the experts receive the
//! same rows, rounded, as an f32 dispatch rounds, bit for bit, at half the bytes on the wire.

use half::bf16;
use megatron_comm::run_ranks;
use megatron_core::tensor_parallel::{serial_group, Tp};
use megatron_core::transformer::config::TokenDispatcherType;
use megatron_core::transformer::moe::router::assign;
use megatron_core::transformer::moe::token_dispatcher::DispatchPlan;
use megatron_tensor::{DType, Tensor};

/// 6 tokens of hidden 10 per rank, top 2 of 4 experts, routing depending on the rank.
fn routed(rank: usize) -> (Tensor, Vec<u32>, Vec<f32>) {
    let (n, h, k, e) = (6, 10, 2, 4);
    let x: Vec<f32> = (0..n * h)
        .map(|i| ((i * 37 + rank * 11) % 101) as f32 * 0.0137 - 0.6)
        .collect();
    let idx: Vec<u32> = (0..n * k)
        .map(|i| ((i * 3 + rank + i / k) % e) as u32)
        .collect();
    let probs = vec![0.5; n * k];
    (Tensor::from_vec(&[n, h], x).unwrap(), idx, probs)
}

#[test]
fn bf16_rows_are_dispatched_as_the_rounded_f32_rows_at_half_the_bytes() {
    for kind in [
        TokenDispatcherType::AllToAll,
        TokenDispatcherType::AllGather,
    ] {
        let out = run_ranks(2, move |rank, c| {
            let (x, idx, probs) = routed(rank);
            let (a, _) = assign(&idx, probs, 6, 2, 4, None);
            let mut etp = serial_group();
            let mut tp_comm = serial_group();
            let mut tp = Tp::new(&mut tp_comm, false).with_expert_parallel(c, &mut etp);
            let plan = DispatchPlan::new(&a, 4, 10, kind, &mut tp).unwrap();
            let before = tp.ep().unwrap().stats();
            let f32_rows = plan.dispatch(&x, &mut tp).unwrap();
            let mid = tp.ep().unwrap().stats();
            let bf16_rows = plan.dispatch(&x.to_dtype(DType::BF16), &mut tp).unwrap();
            let after = tp.ep().unwrap().stats();
            let bytes = |s: &megatron_comm::CommStats| s.bytes.values().sum::<u64>();
            let (b32, b16) = (bytes(&mid) - bytes(&before), bytes(&after) - bytes(&mid));
            assert_eq!(bf16_rows.dtype(), DType::BF16);
            assert_eq!(bf16_rows.shape(), f32_rows.shape());
            let want: Vec<u16> = f32_rows
                .data()
                .iter()
                .map(|&v| bf16::from_f32(v).to_bits())
                .collect();
            let got: Vec<u16> = bf16_rows
                .to_dtype(DType::F32)
                .data()
                .iter()
                .map(|&v| bf16::from_f32(v).to_bits())
                .collect();
            assert_eq!(got, want, "{kind:?} rank {rank}");
            assert!(
                b32 > 0 && 2 * b16 == b32,
                "{kind:?}: {b32} bytes in f32, {b16} in bf16"
            );
        });
        for r in out {
            r.unwrap();
        }
    }
}
