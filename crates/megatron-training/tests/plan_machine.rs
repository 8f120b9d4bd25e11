//! `megatron plan --cluster this-machine`: the machine measured and the cost model calibrated
//! on the model's own short runs, then the best layouts of each parallel shape run here. What
//! this asserts is what does not depend on the machine's load: the calibrated figures are
//! sane, and every measured layout's peak memory per rank is within 5 % of the plan's
//! prediction (the step times are printed; they are benchmarked in BENCHMARKS.md, not tested).

mod common;

use megatron_tensor::alloc::RankAllocator;
use megatron_training::plan::layout::Pins;
use megatron_training::plan::machine::this_machine;
use megatron_training::plan::measure::run_layout;
use megatron_training::plan::plan;

#[global_allocator]
static ALLOCATOR: RankAllocator<std::alloc::System> = RankAllocator(std::alloc::System);

/// The allocator counts bytes per rank slot for the whole process: runs measured at the same
/// time would count each other's, so the tests of this file run one at a time.
static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn measuring() -> std::sync::MutexGuard<'static, ()> {
    MEASURING.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn this_machine_calibrates_and_predicts_each_measured_layouts_peak_memory_within_5_percent() {
    let _one_at_a_time = measuring();
    let a = common::args(&[
        "--nproc-per-node",
        "2",
        "--num-threads",
        "2",
        "--num-layers",
        "4",
        "--hidden-size",
        "128",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "256",
        "--max-position-embeddings",
        "256",
        "--vocab-size",
        "1000",
        "--global-batch-size",
        "8",
    ]);
    let cluster = this_machine(&a).expect("this machine measures");
    println!("{cluster:?}");
    assert_eq!(cluster.devices(), 2);
    assert!(cluster.gemm_efficiency > 0.0 && cluster.gemm_efficiency <= 1.0);
    assert!(cluster.peak_flops > 0.0 && cluster.memory_bandwidth > 0.0);
    for wait in [cluster.ring_exchange_latency, cluster.tp_collective_latency] {
        assert!(wait.is_finite() && wait >= 0.0, "{cluster:?}");
    }
    let p = plan(&a, &cluster, &Pins::default()).expect("plans");
    assert!(p.fits.len() > 10, "{}", p.report(5));
    // The best layout of each of three parallel shapes (as --measure picks them).
    let mut shapes = Vec::new();
    for x in &p.fits {
        let l = &x.layout;
        let shape = (l.tp, l.pp, l.cp);
        if shapes.contains(&shape) {
            continue;
        }
        shapes.push(shape);
        let m = run_layout(&l.config.args, 3).expect("the layout runs");
        let ratio = m.peak_bytes / x.prediction.memory.total();
        println!(
            "{}: step {:.3} s predicted, {:.3} s measured; peak {:.1} MiB predicted, ratio {ratio:.3}",
            l.flags(),
            x.prediction.time.total(),
            m.step_seconds,
            x.prediction.memory.total() / (1 << 20) as f64
        );
        assert!(m.step_seconds > 0.0);
        assert!((0.95..=1.05).contains(&ratio), "{}: {ratio}", l.flags());
        if shapes.len() == 3 {
            break;
        }
    }
    assert_eq!(shapes.len(), 3);
}

/// Two devices of this engine for predicting memory alone: the speeds do not enter it.
fn memory_only_cluster() -> megatron_training::plan::cluster::Cluster {
    use megatron_training::plan::cluster::{AttentionKernel, Cluster, Engine};
    Cluster {
        gpus_per_node: 2,
        num_nodes: 1,
        memory_per_gpu: 8e9,
        reserved_memory: 0.0,
        peak_flops: 1e11,
        intra_node_bandwidth: 1e10,
        inter_node_bandwidth: 1e10,
        memory_bandwidth: 1e10,
        gemm_efficiency: 1.0,
        memory_efficiency: 1.0,
        attention: AttentionKernel::Flash,
        activation_bytes: 4.0,
        engine: Engine::ThisEngine,
        ring_exchange_latency: 0.0,
        tp_collective_latency: 0.0,
        optimizer_bytes_per_parameter: 36.0,
    }
}

/// The model of the memory checks below (2 rank threads, 4 layers, hidden 128, sequence 128,
/// global batch 8, 3 iterations), before the feature a check adds.
const MEASURED_MODEL: &[&str] = &[
    "--nproc-per-node",
    "2",
    "--num-threads",
    "2",
    "--num-layers",
    "4",
    "--hidden-size",
    "128",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "128",
    "--max-position-embeddings",
    "128",
    "--vocab-size",
    "1000",
    "--global-batch-size",
    "8",
    "--train-iters",
    "3",
];

/// [`MEASURED_MODEL`] with `extra`: this engine's peak as the plan predicts it, within 5 % of
/// a measured run's.
fn assert_peak_predicted(what: &str, extra: &[&str]) {
    let a = common::args(&[MEASURED_MODEL, extra].concat());
    let cfg = a.validate(1001).expect("valid flags");
    let predicted = megatron_training::plan::cost::predict(&cfg, &memory_only_cluster())
        .expect("predicts")
        .memory
        .total();
    let m = run_layout(&a, 3).expect("the layout runs");
    let ratio = m.peak_bytes / predicted;
    println!(
        "{what} {extra:?}: peak {:.1} MiB predicted, ratio {ratio:.3}",
        predicted / (1 << 20) as f64
    );
    assert!((0.95..=1.05).contains(&ratio), "{what} {extra:?}: {ratio}");
}

/// Muon's memory as the plan predicts it for this engine (one momentum per Muon element, the
/// scalar rule's moments for the rest; the layer-wise optimizer's 1/DP of them and its
/// staging buffer) against a measured run at DP 2, replicated and layer-wise.
#[test]
fn muons_peak_memory_is_predicted_within_5_percent_replicated_and_layer_wise() {
    let _one_at_a_time = measuring();
    let muon = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high"];
    for extra in [&[][..], &["--use-distributed-optimizer"][..]] {
        assert_peak_predicted("muon", &[&muon[..], extra].concat());
    }
}

/// Multi-latent attention with a multi-token-prediction depth as the plan predicts this
/// engine's peak (the down projections and latent norms whole on every TP rank, the depth on
/// the stage with the output layer) against measured runs at TP 2 + SP and at DP 2.
#[test]
fn mla_and_mtp_peak_memory_is_predicted_within_5_percent() {
    let _one_at_a_time = measuring();
    let model = [
        "--multi-latent-attention",
        "--q-lora-rank",
        "64",
        "--kv-lora-rank",
        "48",
        "--qk-head-dim",
        "32",
        "--qk-pos-emb-head-dim",
        "16",
        "--v-head-dim",
        "32",
        "--qk-layernorm",
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--position-embedding-type",
        "rope",
        "--mtp-num-layers",
        "1",
    ];
    let tp2: &[&str] = &["--tensor-model-parallel-size", "2", "--sequence-parallel"];
    for layout in [tp2, &[][..]] {
        assert_peak_predicted("MLA + MTP", &[&model[..], layout].concat());
    }
}
