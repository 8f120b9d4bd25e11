//! Attention with its products on the packed bf16 block kernels (`--bf16` where the matmuls run
//! on AMX tiles or the AVX512_BF16 dot product) against the f32 kernel (itself checked against
//! a naive f64 reference and finite differences in `backend_cpu_attention.rs`): forward output,
//! log-sum-exp and backward within bf16 tolerance for causal, padded, document-masked,
//! grouped-query and dropout attention, head widths that are and are not a multiple of the tile
//! depth, and sequences crossing every tile edge; bit-identical for 1, 2 and 3 threads. Each
//! `--bf16-matmul-kernel` setting is run; where it finds no packed kernel on this CPU it must
//! run the f32 kernel bit for bit, which is what is then tested (and the test says so).

mod common;

use common::{max_abs_diff, randn};
use megatron_tensor::cpu::matmul::{
    attention_block_kernel, set_bf16_kernel, set_matmul_precision, Bf16Kernel, MatmulPrecision,
};
use megatron_tensor::cpu::matmul_packed::BlockKernel;
use megatron_tensor::cpu::{attention_backward, attention_forward, AttentionDims, AttentionMask};
use megatron_tensor::RngKey;

/// The packed kernel attention runs on under `--bf16` with `setting` here, said aloud.
fn kernel_under(setting: Bf16Kernel) -> Option<BlockKernel> {
    set((MatmulPrecision::BF16, setting));
    let kernel = attention_block_kernel();
    set(F32);
    match kernel {
        Some(k) => eprintln!("{setting:?} setting: attention products on {k:?}"),
        None => eprintln!(
            "{setting:?} setting: no packed bf16 kernel on this CPU, testing that attention stays the f32 kernel"
        ),
    }
    kernel
}

#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    t: usize,
    heads: usize,
    groups: usize,
    head_dim: usize,
    causal: bool,
    dropout: f32,
    padded: bool,
    documents: bool,
}

impl Case {
    fn dims(&self) -> AttentionDims {
        AttentionDims {
            b: self.b,
            t: self.t,
            heads: self.heads,
            groups: self.groups,
            head_dim: self.head_dim,
            causal: self.causal,
            dropout: self.dropout,
            rng_heads: (0, self.heads),
            rng_block: None,
        }
    }
}

fn cases() -> Vec<Case> {
    let base = Case {
        b: 2,
        t: 150,
        heads: 2,
        groups: 2,
        head_dim: 64,
        causal: true,
        dropout: 0.0,
        padded: false,
        documents: false,
    };
    vec![
        base,
        // A sequence ending inside a tile, a head wider than two tiles and not a multiple of 32.
        Case {
            t: 45,
            head_dim: 96,
            ..base
        },
        Case {
            t: 33,
            head_dim: 40,
            causal: false,
            padded: true,
            ..base
        },
        // Heads narrower than one tile's depth (tiny test models): zero-padded k.
        Case {
            t: 70,
            head_dim: 8,
            ..base
        },
        Case {
            head_dim: 32,
            documents: true,
            ..base
        },
        Case {
            heads: 4,
            groups: 2,
            dropout: 0.1,
            ..base
        },
        Case {
            t: 129,
            heads: 3,
            groups: 1,
            head_dim: 32,
            causal: false,
            ..base
        },
    ]
}

/// Precision and bf16 kernel of the calling thread.
fn set(how: (MatmulPrecision, Bf16Kernel)) {
    set_matmul_precision(how.0);
    set_bf16_kernel(how.1);
}

const F32: (MatmulPrecision, Bf16Kernel) = (MatmulPrecision::F32, Bf16Kernel::Amx);

struct Run {
    out: Vec<f32>,
    lse: Vec<f32>,
    dqkv: Vec<f32>,
}

fn run(c: Case, qkv: &[f32], dout: &[f32], how: (MatmulPrecision, Bf16Kernel)) -> Run {
    let d = c.dims();
    let lens: Vec<usize> = (0..c.b).map(|b| c.t - 7 * b).collect();
    let starts: Vec<u32> = (0..c.b * c.t)
        .map(|k| {
            let i = (k % c.t) as u32;
            [0u32, 30, 71]
                .into_iter()
                .filter(|&s| s <= i)
                .max()
                .unwrap()
        })
        .collect();
    let mask = AttentionMask {
        key_lens: c.padded.then_some(&lens[..]),
        doc_start: c.documents.then_some(&starts[..]),
    };
    let key = RngKey::new(11);
    set(how);
    let mut out = vec![0.0; c.b * c.t * c.heads * c.head_dim];
    let mut lse = vec![0.0; c.b * c.heads * c.t];
    attention_forward(&mut out, &mut lse, qkv, mask, d, key);
    let mut dqkv = vec![f32::NAN; qkv.len()];
    attention_backward(&mut dqkv, dout, &out, &lse, qkv, mask, d, key);
    set(F32);
    Run { out, lse, dqkv }
}

fn inputs(c: Case, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let qkv = randn(c.b * c.t * (c.heads + 2 * c.groups) * c.head_dim, seed, 1.0);
    let dout = randn(c.b * c.t * c.heads * c.head_dim, seed + 1, 1.0);
    (qkv, dout)
}

fn max_abs(x: &[f32]) -> f32 {
    x.iter()
        .filter(|v| v.is_finite())
        .fold(0.0, |m, v| m.max(v.abs()))
}

#[test]
fn packed_attention_matches_the_f32_kernel_within_bf16_tolerance() {
    for setting in [Bf16Kernel::Amx, Bf16Kernel::Dot] {
        let packed = kernel_under(setting).is_some();
        for (n, c) in cases().into_iter().enumerate() {
            compare_with_f32(c, 100 + n as u64, (MatmulPrecision::BF16, setting), packed);
        }
    }
}

fn compare_with_f32(c: Case, seed: u64, how: (MatmulPrecision, Bf16Kernel), packed: bool) {
    let (qkv, dout) = inputs(c, seed);
    let tiles = run(c, &qkv, &dout, how);
    let f32k = run(c, &qkv, &dout, F32);
    let (d_out, d_lse, d_grad) = (
        max_abs_diff(&tiles.out, &f32k.out),
        max_abs_diff(&tiles.lse, &f32k.lse),
        max_abs_diff(&tiles.dqkv, &f32k.dqkv),
    );
    eprintln!("{how:?} {c:?}: out {d_out:.2e} lse {d_lse:.2e} dqkv {d_grad:.2e}");
    assert!(
        tiles.dqkv.iter().all(|v| v.is_finite()),
        "{c:?}: dqkv not all written"
    );
    if packed {
        // bf16 keeps 8 significant bits (relative rounding 2^-9 per operand); outputs are
        // sums of O(t) rounded products, so the error is a few parts in a thousand of the
        // values' scale. The f32 kernel on the same data differs from f64 by ~1e-6.
        assert!(
            d_out <= 1.5e-2 * max_abs(&f32k.out),
            "{c:?}: output off by {d_out}"
        );
        assert!(d_lse <= 2e-2, "{c:?}: log-sum-exp off by {d_lse}");
        assert!(
            d_grad <= 3e-2 * max_abs(&f32k.dqkv),
            "{c:?}: dqkv off by {d_grad}"
        );
        // The packed kernel really ran: its rounded operands change the results.
        assert!(
            d_out > 0.0 && d_grad > 0.0,
            "{c:?}: bf16 attention equals f32 bit for bit"
        );
    } else {
        assert_eq!(
            d_out, 0.0,
            "{c:?}: fallback output differs from the f32 kernel"
        );
        assert_eq!(
            d_grad, 0.0,
            "{c:?}: fallback dqkv differs from the f32 kernel"
        );
    }
}

#[test]
fn bf16_attention_under_the_rounded_fma_setting_is_the_f32_kernel() {
    assert_eq!(kernel_under(Bf16Kernel::Fma), None);
    compare_with_f32(
        cases()[0],
        7,
        (MatmulPrecision::BF16, Bf16Kernel::Fma),
        false,
    );
}

#[test]
fn packed_attention_is_bit_identical_for_one_two_and_three_threads() {
    for setting in [Bf16Kernel::Amx, Bf16Kernel::Dot] {
        if kernel_under(setting).is_none() {
            continue;
        }
        let how = (MatmulPrecision::BF16, setting);
        for c in [cases()[0], cases()[5]] {
            let (qkv, dout) = inputs(c, 3);
            let in_pool = |threads| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| run(c, &qkv, &dout, how))
            };
            let one = in_pool(1);
            for threads in [2, 3] {
                let other = in_pool(threads);
                assert!(
                    one.out
                        .iter()
                        .zip(&other.out)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{setting:?} {c:?}: output differs at {threads} threads"
                );
                assert!(
                    one.dqkv
                        .iter()
                        .zip(&other.dqkv)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{setting:?} {c:?}: dqkv differs at {threads} threads"
                );
            }
        }
    }
}

/// A QKV kept in bf16 (`--bf16` keeps it so for backward) is read as stored: forward and
/// backward give the bits of its widened f32 copy, on the packed kernels (which pack it as it
/// is) and on the f32 kernel (which widens it), for 1, 2 and 3 threads.
#[test]
fn attention_reads_a_bf16_qkv_as_its_widened_copy_bit_for_bit() {
    use common::{assert_same_bits, in_pool, to_bf16, widen};
    let c = Case {
        b: 2,
        t: 70,
        heads: 4,
        groups: 2,
        head_dim: 40,
        causal: true,
        dropout: 0.1,
        padded: false,
        documents: true,
    };
    let d = c.dims();
    let (qkv, dout) = inputs(c, 31);
    let qkv16 = to_bf16(&qkv);
    let wide = widen(&qkv16);
    let starts: Vec<u32> = (0..c.b * c.t)
        .map(|k| if k % c.t >= 30 { 30 } else { 0 })
        .collect();
    let mask = AttentionMask {
        key_lens: None,
        doc_start: Some(&starts[..]),
    };
    let key = RngKey::new(5);
    let settings = [
        (MatmulPrecision::BF16, Bf16Kernel::Amx),
        (MatmulPrecision::BF16, Bf16Kernel::Dot),
        (MatmulPrecision::BF16, Bf16Kernel::Fma),
        F32,
    ];
    for how in settings {
        for threads in [1, 2, 3] {
            let one = |x: megatron_tensor::cpu::Operand<'_>| {
                in_pool(threads, || {
                    set(how);
                    let mut out = vec![0.0; c.b * c.t * c.heads * c.head_dim];
                    let mut lse = vec![0.0; c.b * c.heads * c.t];
                    attention_forward(&mut out, &mut lse, x, mask, d, key);
                    let mut dqkv = vec![f32::NAN; qkv.len()];
                    attention_backward(&mut dqkv, &dout, &out, &lse, x, mask, d, key);
                    set(F32);
                    (out, lse, dqkv)
                })
            };
            let (o32, l32, d32) = one(wide[..].into());
            let (o16, l16, d16) = one(qkv16[..].into());
            let what = format!("{how:?}, {threads} threads");
            assert_same_bits(&o16, &o32, &format!("output, {what}"));
            assert_same_bits(&l16, &l32, &format!("log-sum-exp, {what}"));
            assert_same_bits(&d16, &d32, &format!("dqkv, {what}"));
        }
    }
}
