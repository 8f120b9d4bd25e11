//! What the `gemm` crate allocates while it multiplies (the portable GEMM path, taken where the
//! AVX-512 kernel cannot run), and what the memory prediction's probe says it will.

use megatron_tensor::alloc::{self, RankAllocator};
use megatron_tensor::cpu::matmul::{
    gemm_crate, gemm_crate_workspace, GemmWorkspace, GEMM_CRATE_MAX_ROWS,
};
use megatron_tensor::cpu::MatmulDims;
use std::alloc::System;

#[global_allocator]
static ALLOCATOR: RankAllocator<System> = RankAllocator(System);

/// Runs `d` once on a fresh thread counted as `rank` and returns what it allocated beyond its
/// operands: bytes still held afterwards and bytes alive only during the call.
fn measured(rank: usize, d: MatmulDims) -> GemmWorkspace {
    std::thread::spawn(move || {
        alloc::set_rank(rank);
        let a = vec![0.5f32; d.m * d.k];
        let b = vec![0.25f32; d.k * d.n];
        let mut out = vec![0.0f32; d.m * d.n];
        alloc::start_epoch();
        gemm_crate(&mut out, &a, &b, d, 1);
        let (now, peak) = (alloc::current().reserved, alloc::peak().reserved);
        assert_eq!(out[0], 0.125 * d.k as f32);
        GemmWorkspace {
            kept: now.max(0) as usize,
            in_flight: (peak - now).max(0) as usize,
            ..Default::default()
        }
    })
    .join()
    .unwrap()
}

/// A weight gradient's shape: many output rows (a large vocabulary's), a few hundred columns.
fn tall(rows: usize) -> MatmulDims {
    MatmulDims::new(rows, 256, 512).ta()
}

/// Uncapped, the crate sized its packed panel by the L3 cache once the output had more rows
/// than one slab, so a tall product packed up to 8x more than a slab's worth here.
#[test]
fn gemm_crate_packs_no_more_for_a_tall_product_than_for_one_slab() {
    let slab = measured(60, tall(GEMM_CRATE_MAX_ROWS));
    let whole = measured(61, tall(8 * GEMM_CRATE_MAX_ROWS));
    assert!(slab.in_flight > 0, "the crate packs a slab: {slab:?}");
    assert_eq!(whole, slab, "8 slabs of {GEMM_CRATE_MAX_ROWS} rows");
}

/// The probe multiplies clamped shapes only; what it reports is what the full product takes.
#[test]
fn gemm_crate_workspace_probe_matches_a_product_larger_than_it_multiplies() {
    let shapes = [
        tall(16 * GEMM_CRATE_MAX_ROWS + 100),
        MatmulDims::new(3000, 2500, 600),
    ];
    for (i, d) in shapes.into_iter().enumerate() {
        // One shape per probe: a thread's kept slab is counted on its first product only.
        assert_eq!(
            gemm_crate_workspace(&[d]),
            vec![measured(70 + i, d)],
            "{d:?}"
        );
    }
}
