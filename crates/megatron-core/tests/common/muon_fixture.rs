//! megatron-core's Muon and adaptive Muon on a few matrices (fixtures written by
//! bench/make_muon_fixture.py, with `muon` or `adaptive_muon`), replayed here.
#![allow(dead_code)]

use megatron_comm::ThreadCommunicator;
use megatron_core::distributed::GradBuffer;
use megatron_core::optimizer::{
    MegatronOptimizer, MuonConfig, MuonMoment2, MuonMomentum, MuonOptimizer, MuonScaleMode,
    MuonTpMode, NsCoefficients, ParamGather, StepLr, UpdateRule,
};
use megatron_core::params::{Grads, Params};
use megatron_tensor::cpu::NsPrecision;
use serde_json::Value;

const NAMES: [&str; 3] = [
    "decoder.layers.0.self_attention.linear_qkv.weight",
    "decoder.layers.0.mlp.linear_fc1.weight",
    "decoder.layers.0.mlp.linear_fc2.weight",
];

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

fn config(case: &Value, split: [usize; 3], moment2: MuonMoment2) -> MuonConfig {
    let s = |k: &str| case[k].as_str().expect(k).to_string();
    let f = |k: &str| case[k].as_f64().expect(k) as f32;
    MuonConfig {
        momentum: f("momentum"),
        momentum_kind: if case["nesterov"].as_bool().unwrap() {
            MuonMomentum::Nesterov
        } else {
            MuonMomentum::Plain
        },
        coefficients: NsCoefficients::from_name(&s("coefficient_type")).unwrap(),
        num_ns_steps: case["num_ns_steps"].as_u64().unwrap() as usize,
        precision: match s("fp32_matmul_prec").as_str() {
            "medium" => NsPrecision::Bf16,
            _ => NsPrecision::F32,
        },
        scale_mode: match s("scale_mode").as_str() {
            "spectral" => MuonScaleMode::Spectral,
            "unit_rms_norm" => MuonScaleMode::UnitRmsNorm,
            _ => MuonScaleMode::ShapeScaling,
        },
        extra_scale_factor: f("extra_scale_factor"),
        tp_mode: MuonTpMode::Duplicated,
        qkv_split: case["split_qkv"].as_bool().unwrap().then_some(split),
        scalar: UpdateRule::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
        moment2,
    }
}

/// Steps megatron-rs's Muon with `moment2` through every case of the fixture `file` (in
/// tests/fixtures) and requires each parameter within tolerance of megatron-core's after each
/// step (within `f32_tol` of the largest update with f32 products); returns the optimizer of the
/// last case.
pub fn check_against_fixture(file: &str, moment2: MuonMoment2, f32_tol: f32) -> MuonOptimizer {
    let path = format!("{}/tests/fixtures/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let fixture: Value = serde_json::from_str(&text).unwrap();
    let split: Vec<usize> = fixture["qkv_split_shapes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let split = [split[0], split[1], split[2]];
    let mut dp = ThreadCommunicator::world(1).pop().unwrap();
    let mut last = None;
    for case in fixture["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let cfg = config(case, split, moment2);
        let mut params = Params::default();
        for (n, shape) in NAMES.iter().zip(case["shapes"].as_array().unwrap()) {
            let shape: Vec<usize> = shape
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            params.register(n.to_string(), &shape, true);
        }
        let mut p = Vec::new();
        for start in case["start"].as_array().unwrap() {
            p.extend(floats(start));
        }
        params.data = p;
        let buffer = GradBuffer::new(&params, usize::MAX, 1, 0, false);
        let mut opt = MuonOptimizer::new(&params, cfg, buffer, None, None);
        let lr = StepLr::uniform(case["lr"].as_f64().unwrap() as f32);
        let wd = case["weight_decay"].as_f64().unwrap() as f32;
        // Measured: within 3e-6 of the update in both precisions; bf16 products may round the
        // other way where another CPU's GEMM sums in another order, which moves an element by a
        // bf16 rounding of the update.
        let tol = match cfg.precision {
            NsPrecision::Bf16 => 1e-2,
            NsPrecision::F32 => f32_tol,
        };
        for (k, step) in case["steps"].as_array().unwrap().iter().enumerate() {
            let mut grads = Grads::zeros_like(&params);
            let mut g = Vec::new();
            for x in step["grads"].as_array().unwrap() {
                g.extend(floats(x));
            }
            grads.data.copy_from_slice(&g);
            let before = params.data.clone();
            opt.step(&mut params, &grads, lr, wd, &mut dp, ParamGather::Now)
                .unwrap();
            let mut want = Vec::new();
            for x in step["params"].as_array().unwrap() {
                want.extend(floats(x));
            }
            for (i, m) in params.metas.iter().enumerate() {
                let r = m.offset..m.offset + m.numel;
                let update = want[r.clone()]
                    .iter()
                    .zip(&before[r.clone()])
                    .map(|(w, b)| (w - b).abs())
                    .fold(0.0f32, f32::max);
                let err = params.data[r.clone()]
                    .iter()
                    .zip(&want[r])
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                println!(
                    "{name} step {k} {}: max |err| {err:.3e} of update {update:.3e}",
                    NAMES[i]
                );
                assert!(
                    err <= tol * update,
                    "{name}, step {k}, {}: max difference {err} against megatron-core's, \
                     update {update}",
                    NAMES[i]
                );
            }
        }
        assert_eq!(opt.step_count(), 3);
        last = Some(opt);
    }
    last.expect("the fixture has cases")
}
