//! The packed bf16 GEMM (`matmul_packed.rs`) on each block kernel this CPU runs (AMX tiles,
//! the AVX512_BF16 dot product) against a naive reference on the same bf16-rounded operands:
//! every transpose, accumulate, shapes crossing every tile (16), kernel block (32) and
//! packed-B column block edge, bit-identical results for 1, 2 and 3 threads, prepacked B, bf16
//! operands. A kernel the CPU or OS lacks is skipped with the reason printed; the fallbacks of
//! the `--bf16-matmul-kernel` settings are tested where a kernel is missing.

mod common;

use common::naive_matmul_bf16;
use megatron_tensor::cpu::amx::{amx_available, amx_unavailable_reason};
use megatron_tensor::cpu::matmul::{
    matmul, set_bf16_kernel, set_matmul_precision, Bf16Kernel, MatmulDims, MatmulPrecision,
};
use megatron_tensor::cpu::matmul_amx::{amx_peak_gflops, matmul_amx_with_threads};
use megatron_tensor::cpu::matmul_bf16::bf16_gemm_available;
use megatron_tensor::cpu::matmul_packed::{matmul_packed, BlockKernel};

/// The block kernels this machine runs, saying which are skipped and why.
fn kernels() -> Vec<BlockKernel> {
    let mut run = Vec::new();
    match amx_unavailable_reason() {
        None => run.push(BlockKernel::AmxTiles),
        Some(why) => eprintln!("AMX tile kernel skipped: {why}"),
    }
    if bf16_gemm_available() {
        run.push(BlockKernel::DotProduct);
    } else {
        eprintln!("dot-product kernel skipped: this CPU has no AVX512_BF16 (avx512_bf16 not in /proc/cpuinfo)");
    }
    eprintln!("testing {run:?}");
    run
}

fn operands(m: usize, n: usize, k: usize, seed: usize) -> (Vec<f32>, Vec<f32>) {
    let a = (0..m * k)
        .map(|i| (((i + seed) * 37 % 101) as f32 - 50.0) * 0.013)
        .collect();
    let b = (0..k * n)
        .map(|i| (((i + seed) * 53 % 97) as f32 - 48.0) * 0.017)
        .collect();
    (a, b)
}

fn dims(m: usize, n: usize, k: usize, ta: bool, tb: bool, acc: bool) -> MatmulDims {
    let mut d = MatmulDims::new(m, n, k);
    d.trans_a = ta;
    d.trans_b = tb;
    d.accumulate = acc;
    d
}

fn check_against_reference(
    kernel: BlockKernel,
    (m, n, k): (usize, usize, usize),
    d: MatmulDims,
    threads: usize,
) {
    let (a, b) = operands(m, n, k, m + n + k);
    let init: Vec<f32> = (0..m * n).map(|i| (i % 5) as f32 - 2.0).collect();
    let mut out = init.clone();
    matmul_packed(&mut out, &a, &b, d, threads, kernel);
    let want = naive_matmul_bf16(&a, &b, d);
    for i in 0..m * n {
        let w = want[i] + if d.accumulate { init[i] as f64 } else { 0.0 };
        // f32 accumulation of exact bf16 products.
        let tol = 1e-5 * (k as f64).sqrt() * (1.0 + w.abs());
        assert!(
            (out[i] as f64 - w).abs() <= tol,
            "{kernel:?} {d:?} threads {threads}: [{i}] {} vs {w}",
            out[i]
        );
    }
}

#[test]
fn packed_matmul_matches_a_reference_on_bf16_operands_for_every_transpose() {
    for kernel in kernels() {
        every_transpose(kernel);
    }
}

fn every_transpose(kernel: BlockKernel) {
    for (m, n, k) in [
        (1, 1, 1),
        (16, 16, 32),
        (17, 33, 31),
        (33, 31, 65),
        (70, 100, 200),
    ] {
        for ta in [false, true] {
            for tb in [false, true] {
                for acc in [false, true] {
                    check_against_reference(kernel, (m, n, k), dims(m, n, k, ta, tb, acc), 2);
                }
            }
        }
    }
}

#[test]
fn packed_matmul_handles_ragged_shapes_across_tile_and_block_edges() {
    for kernel in kernels() {
        for m in [1, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 65] {
            for (n, k) in [(1, 33), (17, 63), (32, 64), (47, 95)] {
                let d = dims(m, n, k, false, true, false);
                check_against_reference(kernel, (m, n, k), d, 1);
            }
        }
        // k = 2047: 1,024 k pairs, so a packed-B column block holds 256 columns and n = 300
        // crosses it.
        let (m, n, k) = (40, 300, 2047);
        check_against_reference(kernel, (m, n, k), dims(m, n, k, true, false, true), 2);
    }
}

#[test]
fn packed_matmul_is_bit_identical_for_one_two_and_three_threads() {
    let (m, n, k) = (200, 150, 300);
    for kernel in kernels() {
        for (ta, tb, acc) in [
            (false, false, false),
            (false, true, true),
            (true, false, false),
        ] {
            let d = dims(m, n, k, ta, tb, acc);
            let (a, b) = operands(m, n, k, 3);
            let run = |threads| {
                let mut out: Vec<f32> = (0..m * n).map(|i| (i % 3) as f32).collect();
                matmul_packed(&mut out, &a, &b, d, threads, kernel);
                out
            };
            let one = run(1);
            for threads in [2, 3] {
                let other = run(threads);
                assert!(
                    one.iter()
                        .zip(&other)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{kernel:?}: {threads} threads differ from one ({d:?})"
                );
            }
        }
    }
}

#[test]
fn dot_product_and_tile_kernels_agree_within_f32_summation_error() {
    // Both sum the same exact products over k in order; only their association differs (the
    // tiles add pairs of products inside the unit), so they agree to f32 rounding.
    let kernels = kernels();
    if kernels.len() < 2 {
        eprintln!("skipped: needs both AMX tiles and the dot-product instruction");
        return;
    }
    let (m, n, k) = (70, 90, 500);
    let (a, b) = operands(m, n, k, 5);
    let d = MatmulDims::new(m, n, k).tb();
    let run = |kernel| {
        let mut out = vec![0.0f32; m * n];
        matmul_packed(&mut out, &a, &b, d, 2, kernel);
        out
    };
    let (tiles, dot) = (run(BlockKernel::AmxTiles), run(BlockKernel::DotProduct));
    for (i, (x, y)) in tiles.iter().zip(&dot).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * (k as f32).sqrt() * (1.0 + x.abs()),
            "[{i}] {x} vs {y}"
        );
    }
}

#[test]
fn bf16_matmul_runs_the_kernel_the_thread_setting_chooses() {
    let (m, n, k) = (48, 40, 96);
    let (a, b) = operands(m, n, k, 11);
    let d = MatmulDims::new(m, n, k).tb();
    let via_matmul = |setting| {
        let mut out = vec![0.0f32; m * n];
        set_matmul_precision(MatmulPrecision::BF16);
        set_bf16_kernel(setting);
        matmul(&mut out, &a, &b, d);
        set_matmul_precision(MatmulPrecision::F32);
        set_bf16_kernel(Bf16Kernel::Dot);
        out
    };
    let direct = |kernel| {
        let mut out = vec![0.0f32; m * n];
        matmul_packed(&mut out, &a, &b, d, 1, kernel);
        out
    };
    // Amx falls back to the dot product, which falls back to rounded operands on the f32 GEMM.
    let mut rounded_f32 = vec![0.0f32; m * n];
    let round = |x: &[f32]| -> Vec<f32> {
        x.iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect()
    };
    megatron_tensor::cpu::matmul::matmul_with_threads(
        &mut rounded_f32,
        &round(&a),
        &round(&b),
        d,
        1,
    );
    let dot = if bf16_gemm_available() {
        direct(BlockKernel::DotProduct)
    } else {
        rounded_f32.clone()
    };
    let amx = if amx_available() {
        direct(BlockKernel::AmxTiles)
    } else {
        dot.clone()
    };
    assert_eq!(via_matmul(Bf16Kernel::Amx), amx);
    assert_eq!(via_matmul(Bf16Kernel::Dot), dot);
    assert_eq!(via_matmul(Bf16Kernel::Fma), rounded_f32);
    let mut via_amx_entry = vec![0.0f32; m * n];
    matmul_amx_with_threads(&mut via_amx_entry, &a, &b, d, 1);
    assert_eq!(via_amx_entry, amx);
}

#[test]
fn amx_peak_is_reported_only_where_amx_runs() {
    kernels();
    let peak = amx_peak_gflops(1);
    assert_eq!(peak.is_some(), amx_available());
    if let Some(p) = peak {
        // One core's tile unit: ~1,024 flop/cycle; anything under 100 GFLOP/s means the
        // instructions are not running on the unit.
        assert!(p > 100.0, "AMX peak {p} GFLOP/s");
    }
}

#[test]
fn a_prepacked_b_gives_the_bits_of_packing_per_call() {
    use megatron_tensor::cpu::matmul_packed::{matmul_packed_prepacked, PackedB};
    let kernels = kernels();
    if kernels.is_empty() {
        eprintln!("skipped: prepacking needs AVX512_BF16");
        assert!(PackedB::new(&[0.0; 4], MatmulDims::new(0, 2, 2), 1).is_none());
        return;
    }
    // k = 2047 makes 256-column B blocks, so n = 300 reads the packed panels across a block edge.
    let (m, n, k) = (50, 300, 2047);
    for kernel in kernels {
        for tb in [false, true] {
            let d = dims(m, n, k, false, tb, true);
            let (a, b) = operands(m, n, k, 9);
            let packed = PackedB::new(&b, d, 2).expect("the packers run here");
            let mut once = vec![0.5f32; m * n];
            let mut per_call = once.clone();
            matmul_packed_prepacked(&mut once, &a, &packed, d, 2, kernel);
            matmul_packed(&mut per_call, &a, &b, d, 2, kernel);
            assert!(
                once.iter()
                    .zip(&per_call)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{kernel:?} trans_b {tb}"
            );
        }
    }
}

#[test]
fn products_of_few_rows_take_the_rounded_f32_gemm_under_the_packed_settings() {
    use megatron_tensor::cpu::matmul::PACKED_MIN_ROWS;
    // A decoded token: packing the weight for one row would cost more than the product.
    let (n, k) = (70, 90);
    for m in [1, PACKED_MIN_ROWS - 1] {
        let (a, b) = operands(m, n, k, 4);
        let d = MatmulDims::new(m, n, k).tb();
        let run = |kernel| {
            let mut out = vec![0.0f32; m * n];
            set_matmul_precision(MatmulPrecision::BF16);
            set_bf16_kernel(kernel);
            matmul(&mut out, &a, &b, d);
            set_matmul_precision(MatmulPrecision::F32);
            set_bf16_kernel(Bf16Kernel::Dot);
            out
        };
        assert_eq!(run(Bf16Kernel::Amx), run(Bf16Kernel::Fma), "m {m}");
        assert_eq!(run(Bf16Kernel::Dot), run(Bf16Kernel::Fma), "m {m}");
    }
}

/// Operands kept in bf16 (a `--bf16` weight's copy, an activation stored in bf16) are packed as
/// they are by the packed kernels and widened elsewhere; either way the product must be the bits of the same
/// matmul on their f32 values, for every transpose, accumulate and mixed storage, across tile
/// and block edges, for 1 and 3 threads.
#[test]
fn bf16_operands_give_the_bits_of_their_f32_values() {
    kernels();
    for setting in [Bf16Kernel::Amx, Bf16Kernel::Dot, Bf16Kernel::Fma] {
        bf16_operands_under(setting);
    }
}

fn bf16_operands_under(setting: Bf16Kernel) {
    use half::bf16;
    use megatron_tensor::cpu::matmul::{matmul_operands, Operand};
    use megatron_tensor::threads::set_gemm_threads;
    set_matmul_precision(MatmulPrecision::BF16);
    set_bf16_kernel(setting);
    for (m, n, k) in [(33, 17, 45), (64, 70, 129), (40, 33, 31)] {
        for (ta, tb, acc) in [
            (false, false, false),
            (true, false, false),
            (false, true, true),
            (true, true, false),
        ] {
            let d = dims(m, n, k, ta, tb, acc);
            let (a, b) = operands(m, n, k, m + n);
            let a16: Vec<bf16> = a.iter().map(|&v| bf16::from_f32(v)).collect();
            let b16: Vec<bf16> = b.iter().map(|&v| bf16::from_f32(v)).collect();
            let aw: Vec<f32> = a16.iter().map(|v| v.to_f32()).collect();
            let bw: Vec<f32> = b16.iter().map(|v| v.to_f32()).collect();
            let start: Vec<f32> = (0..m * n).map(|i| (i % 7) as f32 * 0.25).collect();
            for threads in [1, 3] {
                let mut want = start.clone();
                set_gemm_threads(threads);
                matmul(&mut want, &aw, &bw, d);
                let cases = [
                    (Operand::BF16(&a16), Operand::BF16(&b16)),
                    (Operand::F32(&aw), Operand::BF16(&b16)),
                    (Operand::BF16(&a16), Operand::F32(&bw)),
                ];
                for (i, (x, y)) in cases.into_iter().enumerate() {
                    let mut got = start.clone();
                    matmul_operands(&mut got, x, y, d);
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(g, w)| g.to_bits() == w.to_bits());
                    assert!(
                        same,
                        "{setting:?} {m}x{n}x{k} ta={ta} tb={tb} acc={acc} case {i} threads {threads}"
                    );
                }
            }
        }
    }
    set_matmul_precision(MatmulPrecision::F32);
    set_bf16_kernel(Bf16Kernel::Dot);
    set_gemm_threads(megatron_tensor::threads::available_cores());
}

/// The linear layer's kernels (`matmul_forward` with its bias, `matmul_backward`) take a
/// `--bf16` weight as stored: the same bits as on its widened values, on the packed kernels
/// (64 tokens) and below their row minimum (8 tokens, the rounded-operand f32 GEMM).
#[test]
fn linear_layer_kernels_give_the_same_bits_for_a_bf16_weight_and_its_widened_values() {
    use half::bf16;
    use megatron_tensor::cpu::matmul::{matmul_backward, matmul_forward, Operand};
    kernels();
    for setting in [Bf16Kernel::Amx, Bf16Kernel::Dot, Bf16Kernel::Fma] {
        set_matmul_precision(MatmulPrecision::BF16);
        set_bf16_kernel(setting);
        for (n, i, o) in [(64, 40, 70), (8, 33, 17)] {
            let (x, w) = operands(n, o, i, n + o);
            let w16: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wide: Vec<f32> = w16.iter().map(|v| v.to_f32()).collect();
            let bias: Vec<f32> = (0..o).map(|j| j as f32 * 0.125).collect();
            let dy: Vec<f32> = (0..n * o)
                .map(|j| ((j % 11) as f32 - 5.0) * 0.0625)
                .collect();
            let mut y = [vec![0.0f32; n * o], vec![0.0f32; n * o]];
            let mut dx = [vec![0.0f32; n * i], vec![0.0f32; n * i]];
            let mut dw = [vec![0.5f32; o * i], vec![0.5f32; o * i]];
            let mut db = [vec![0.0f32; o], vec![0.0f32; o]];
            for (s, weight) in [Operand::BF16(&w16), Operand::F32(&wide)]
                .into_iter()
                .enumerate()
            {
                matmul_forward(&mut y[s], &x, weight, Some(&bias), n, i, o);
                let (dx, dw, db) = (&mut dx[s], &mut dw[s], &mut db[s]);
                matmul_backward(Some(dx), dw, Some(db), &dy, &x, weight, n, i, o);
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for (what, [a, b]) in [("y", &y), ("dx", &dx), ("dw", &dw), ("db", &db)] {
                assert!(bits(a) == bits(b), "{setting:?} {n}x{i}x{o}: {what}");
            }
        }
    }
    set_matmul_precision(MatmulPrecision::F32);
    set_bf16_kernel(Bf16Kernel::Dot);
}
