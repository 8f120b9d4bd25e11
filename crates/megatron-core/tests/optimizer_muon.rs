//! `--optimizer muon` against megatron-core's `TensorParallelMuon` (run on NVIDIA's
//! emerging-optimizers and torch by bench/make_muon_fixture.py): three steps on a fused QKV
//! weight, a wide and a tall matrix, for each of four settings (megatron's defaults with bf16
//! products, and f32 products with Nesterov, every scale mode, cycled and repeated coefficient
//! schedules, with and without the QKV split).

mod common;

use megatron_core::optimizer::MuonMoment2;

#[test]
fn muon_steps_match_megatron_core_tensor_parallel_muon() {
    common::muon_fixture::check_against_fixture("muon_reference.json", MuonMoment2::None, 1e-5);
}
