//! `--optimizer adaptive_muon` against megatron-core's `TensorParallelAdaptiveMuon` (AdaMuon,
//! run on NVIDIA's emerging-optimizers and torch by `bench/make_muon_fixture.py ...
//! adaptive_muon`): three steps on a fused QKV weight, a wide and a tall matrix, for each of four
//! settings (megatron's defaults with bf16 products, and f32 products with Nesterov, every scale
//! mode, with and without the QKV split).

mod common;

use megatron_core::optimizer::{MegatronOptimizer, Moment, MuonMoment2};
use megatron_tensor::cpu::AdaMuonParams;

#[test]
fn adaptive_muon_steps_match_megatron_core_tensor_parallel_adaptive_muon() {
    let opt = common::muon_fixture::check_against_fixture(
        "adaptive_muon_reference.json",
        MuonMoment2::AdaMuon(AdaMuonParams {
            beta2: 0.95,
            eps: 1e-8,
        }),
        // Measured 8.2e-6 of the largest update (Zen 3): dividing by the second moment's root
        // enlarges the f32 products' rounding where that root is small.
        3e-5,
    );
    // megatron-core's state and name: a momentum and a second moment per Muon element.
    assert_eq!(opt.name(), "adaptive_muon");
    assert_eq!(
        opt.moments_of(0),
        &[Moment::MomentumBuffer, Moment::Moment2Buffer]
    );
    assert_eq!(opt.state_elements(), 2 * opt.muon_elements());
}
