//! Activations between pipeline stages: the bf16 residual stream crosses as bf16 bit pairs
//! (half the bytes of f32), every value's bits intact; gradients and odd counts as f32.

use megatron_comm::{run_ranks, Communicator};
use megatron_core::pipeline_parallel::p2p;
use megatron_tensor::{DType, Tensor};

fn values(shape: &[usize], seed: usize) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::from_vec(
        shape,
        (0..n)
            .map(|i| ((i * 37 + seed * 11) % 101) as f32 * 0.0731 - 3.1 + 1e-4 * i as f32)
            .collect(),
    )
    .unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .data()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// (shape, what the sender holds, how it travels): what the receiver must get is `x` rounded
/// to the travelling dtype, in that dtype.
fn cases() -> Vec<([usize; 2], DType, DType)> {
    vec![
        ([3, 4], DType::BF16, DType::BF16),
        // An f32 activation sent as bf16 is rounded once on the way, as the receiving
        // stage's layers would round it.
        ([3, 4], DType::F32, DType::BF16),
        // An odd count travels as f32 words; the values stay the bf16 ones.
        ([3, 3], DType::BF16, DType::BF16),
        ([2, 5], DType::F32, DType::F32),
    ]
}

#[test]
fn bf16_activations_cross_stages_as_bf16_bits_at_half_the_bytes() {
    let out = run_ranks(2, |rank, c| {
        let mut bytes = Vec::new();
        for (k, (shape, held, travels)) in cases().into_iter().enumerate() {
            let x = values(&shape, k).to_dtype(held);
            let before = c.stats().bytes.get("send").copied().unwrap_or(0);
            if rank == 0 {
                p2p::send(c, &x, travels, 1, k as u64).unwrap();
                bytes.push(c.stats().bytes["send"] - before);
            } else {
                let y = p2p::recv(c, &shape, travels, 0, k as u64).unwrap();
                let n = shape[0] * shape[1];
                let want_dtype = match (travels, n % 2) {
                    (DType::BF16, 0) => DType::BF16,
                    _ => DType::F32,
                };
                assert_eq!(y.dtype(), want_dtype, "case {k}");
                assert_eq!(y.shape(), &shape, "case {k}");
                assert_eq!(bits(&y), bits(&x.to_dtype(travels)), "case {k}");
            }
        }
        bytes
    });
    let sent = out[0].as_ref().unwrap();
    // 12 values: 24 bytes as bf16 (twice), 36 bytes for 9 values as f32 words, 40 for 10 f32.
    assert_eq!(sent, &[24, 24, 36, 40]);
    out[1].as_ref().unwrap();
}
