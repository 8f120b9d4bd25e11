//! `megatron convert` against the outside reference: tiny random Hugging Face models made by
//! transformers (`bench/make_hf_fixtures.py`; committed with their fp32 logits), converted to
//! megatron-rs, give transformers' logits; converted back they give the original tensors, byte
//! for byte.

mod common;

use common::hf_fixtures::*;
use common::{args, tmpdir, LLAMA, MOE, SMALL_RUN};
use megatron_training::checkpointing::load_checkpoint;
use megatron_training::convert::{hf_to_megatron, megatron_to_hf};
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};

#[test]
fn gpt2_converts_to_transformers_logits_and_back_byte_for_byte() {
    check("gpt2");
}

#[test]
fn llama_with_gqa_and_untied_output_converts_to_transformers_logits_and_back() {
    check("llama");
}

/// `--no-bias-gelu-fusion`'s exact GELU, `--squared-relu` and `--quick-geglu` against
/// transformers' `gelu`, `relu2` and `quick_gelu` (`bench/make_hf_activation_fixtures.py`), and
/// back with the activation in config.json.
#[test]
fn erf_gelu_and_squared_relu_gpt2_and_quick_gelu_llama_convert_to_transformers_logits_and_back() {
    for (arch, key, act) in [
        ("gpt2_gelu", "activation_function", "gelu"),
        ("gpt2_relu2", "activation_function", "relu2"),
        ("llama_quick_gelu", "hidden_act", "quick_gelu"),
    ] {
        check(arch);
        let dir = tmpdir(&format!("convert-act-{arch}"));
        hf_to_megatron(&fixture(arch), &dir.join("m"), 128).unwrap();
        megatron_to_hf(&dir.join("m"), &dir.join("hf")).unwrap();
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("hf/config.json")).unwrap())
                .unwrap();
        assert_eq!(cfg[key], act, "{arch}");
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// transformers' `sliding_window` W is `--window-size (W-1,0)`: Mistral's on every layer,
/// Qwen2's on the layers `layer_types` marks (`bench/make_hf_sliding_window_fixtures.py`;
/// 16 tokens, so the windows bind), through the KV cache; and back with the same config keys.
#[test]
fn sliding_window_mistral_and_qwen2_convert_to_transformers_logits_and_back() {
    for (arch, left, windowed) in [
        ("mistral_swa", 4, [true, true]),
        ("qwen2_swa", 3, [false, true]),
    ] {
        check(arch);
        let dir = tmpdir(&format!("convert-swa-{arch}"));
        hf_to_megatron(&fixture(arch), &dir.join("m"), 128).unwrap();
        let cfg = load_checkpoint(&dir.join("m"), None).unwrap().meta.model;
        let got: Vec<Option<usize>> = (0..2).map(|l| cfg.attention_window(l)).collect();
        let want: Vec<Option<usize>> = windowed.iter().map(|&w| w.then_some(left)).collect();
        assert_eq!(got, want, "{arch}");
        megatron_to_hf(&dir.join("m"), &dir.join("hf")).unwrap();
        let read = |p: &Path| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(p.join("config.json")).unwrap()).unwrap()
        };
        let (orig, back) = (read(&fixture(arch)), read(&dir.join("hf")));
        for key in [
            "architectures",
            "model_type",
            "sliding_window",
            "layer_types",
        ] {
            assert_eq!(orig[key], back[key], "{arch}: {key}");
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// gpt-oss (`bench/make_hf_gpt_oss_fixture.py`): attention sinks, q/k/v/o biases, a window
/// on every other layer, YaRN, biased router and experts with the interleaved, clamped
/// Quick-GEGLU (the clamp binding on 10-26 % of the activations); and back with the same
/// config keys.
#[test]
fn gpt_oss_converts_to_transformers_logits_and_back() {
    check("gpt_oss");
    let (cfg, back) = converted_and_exported("gpt_oss");
    assert_eq!(
        cfg.softmax_type,
        megatron_core::transformer::config::SoftmaxType::Learnable
    );
    assert_eq!(cfg.glu.clamp_value, Some(1.5));
    assert_eq!(cfg.glu.linear_offset, 1.0);
    assert!(cfg.add_bias_linear);
    let orig: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("gpt_oss").join("config.json")).unwrap(),
    )
    .unwrap();
    for key in [
        "architectures",
        "model_type",
        "sliding_window",
        "layer_types",
        "swiglu_limit",
        "swiglu_alpha",
        "attention_bias",
        "num_local_experts",
        "num_experts_per_tok",
        "intermediate_size",
        "head_dim",
    ] {
        assert_eq!(orig[key], back[key], "gpt_oss: {key}");
    }
    // YaRN's settings as the fixture has them (ours adds transformers' defaults of the mscales).
    for (k, v) in orig["rope_parameters"].as_object().unwrap() {
        assert_eq!(
            v, &back["rope_parameters"][k],
            "gpt_oss: rope_parameters.{k}"
        );
    }
}

#[derive(clap::Parser)]
struct GenWrap {
    #[command(flatten)]
    args: megatron_training::GenerateArgs,
}

/// `megatron generate` on the converted gpt-oss gives transformers' greedy tokens: the KV
/// cache with the sinks, the window (4 tokens, passed by the 16 the decoding reaches) and
/// YaRN's positions.
#[test]
fn a_converted_gpt_oss_decodes_transformers_greedy_tokens() {
    use clap::Parser;
    let dir = tmpdir("convert-gpt-oss-generate");
    let save = dir.join("m");
    hf_to_megatron(&fixture("gpt_oss"), &save, 128).unwrap();
    let r = std::fs::read(fixture("gpt_oss").join("reference.safetensors")).unwrap();
    let r = SafeTensors::deserialize(&r).unwrap();
    let want: Vec<u32> = common::safetensor_i64(&r, "greedy")
        .iter()
        .map(|&x| x as u32)
        .collect();
    let prompt: Vec<String> = want[..5].iter().map(|t| t.to_string()).collect();
    let g = GenWrap::try_parse_from([
        "m",
        "--load",
        save.to_str().unwrap(),
        "--prompt-ids",
        &prompt.join(" "),
        "--greedy",
        "--max-new-tokens",
        "11",
        "--eos-id",
        "100000",
    ])
    .unwrap();
    let got: Vec<u32> = megatron_training::generate::generate(&g.args)
        .unwrap()
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    assert_eq!(got, want[5..], "megatron generate vs transformers' greedy");
    let _ = std::fs::remove_dir_all(dir);
}

/// The released gpt-oss checkpoints store their experts in MXFP4 (`*_blocks`, `*_scales`,
/// `quant_method: mxfp4`; `bench/make_hf_gpt_oss_fixture.py`'s `gpt_oss_mxfp4`): read and
/// dequantized, they give transformers' logits from its own dequantization
/// (`Mxfp4Config(dequantize=True)`), and export as the unquantized model. Another quantization
/// is refused by name.
#[test]
fn a_gpt_oss_with_mxfp4_experts_converts_to_transformers_dequantized_logits() {
    let dir = tmpdir("convert-gpt-oss-mxfp4");
    let save = dir.join("m");
    hf_to_megatron(&fixture("gpt_oss_mxfp4"), &save, 128).unwrap();
    let diff = max_logit_difference(
        &save,
        &fixture("gpt_oss_mxfp4").join("reference.safetensors"),
        "logits",
    );
    eprintln!("gpt_oss_mxfp4: max |logit difference| {diff:e}");
    assert!(diff <= 1e-4, "logits differ by {diff}");
    megatron_to_hf(&save, &dir.join("hf")).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("hf/config.json")).unwrap())
            .unwrap();
    assert!(cfg.get("quantization_config").is_none());
    let bytes = std::fs::read(dir.join("hf/model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let w = st
        .tensor("model.layers.0.mlp.experts.gate_up_proj")
        .unwrap();
    assert_eq!(w.shape(), [4, 32, 64]);
    assert!(st
        .names()
        .iter()
        .all(|n| !n.ends_with("_blocks") && !n.ends_with("_scales")));
    // Another quantization is refused by name, and nothing is written.
    let hf = fixture_with_config("gpt_oss", &dir, "gptq", |c| {
        c["quantization_config"] = serde_json::json!({"quant_method": "gptq"})
    });
    let e = hf_to_megatron(&hf, &dir.join("gptq-m"), 128)
        .unwrap_err()
        .to_string();
    assert!(e.contains("quant_method 'gptq'"), "{e}");
    assert!(!dir
        .join("gptq-m/latest_checkpointed_iteration.txt")
        .exists());
    let _ = std::fs::remove_dir_all(dir);
}

/// What gpt-oss's design needs and another model lacks is refused by name on export.
#[test]
fn a_model_with_part_of_gpt_osss_design_is_refused_for_export_by_name() {
    let dir = tmpdir("convert-gpt-oss-partial");
    for (name, flags, want) in [
        (
            "dense-sinks",
            &[
                "--softmax-type",
                "learnable",
                "--quick-geglu",
                "--glu-linear-offset",
                "1",
                "--activation-func-clamp-value",
                "7",
                "--normalization",
                "RMSNorm",
                "--position-embedding-type",
                "rope",
            ][..],
            "a dense MLP",
        ),
        (
            "swiglu-sinks",
            &[
                "--softmax-type",
                "learnable",
                "--swiglu",
                "--num-experts",
                "4",
                "--normalization",
                "RMSNorm",
                "--position-embedding-type",
                "rope",
            ][..],
            "an MLP other than gpt-oss's",
        ),
        (
            "off-by-one",
            &[
                "--softmax-type",
                "off-by-one",
                "--swiglu",
                "--normalization",
                "RMSNorm",
                "--position-embedding-type",
                "rope",
            ][..],
            "--softmax-type off-by-one",
        ),
    ] {
        let save = dir.join(name);
        let mut a = args(
            &[
                flags,
                &[
                    "--train-iters",
                    "1",
                    "--lr-warmup-iters",
                    "0",
                    "--save",
                    save.to_str().unwrap(),
                ],
            ]
            .concat(),
        );
        a.save_interval = Some(1);
        megatron_training::pretrain(&a).unwrap();
        let e = megatron_to_hf(&save, &dir.join(format!("{name}-hf")))
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{name}: {e}");
        assert!(!dir.join(format!("{name}-hf/model.safetensors")).exists());
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn qwen2_with_qkv_bias_and_tied_embeddings_converts_to_transformers_logits_and_back() {
    check("qwen2");
}

#[test]
fn mixtral_experts_and_router_convert_to_transformers_logits_and_back() {
    check("mixtral");
}

#[test]
fn qwen2_moe_with_gated_shared_expert_converts_to_transformers_logits_and_back() {
    check("qwen2_moe");
}

/// Qwen2-MoE's dense layers (`decoder_sparse_step` 2 and `mlp_only_layers` [3]: experts on
/// layer 1 only) become a `--moe-layer-freq` list with the plain MLP on the others, and go
/// back as the same set of sparse layers.
#[test]
fn qwen2_moe_with_dense_layers_converts_to_transformers_logits_and_back() {
    check("qwen2_moe_dense");
    let (cfg, back) = converted_and_exported("qwen2_moe_dense");
    let moe: Vec<bool> = (0..4).map(|l| cfg.is_moe_layer(l)).collect();
    assert_eq!(moe, [false, true, false, false]);
    assert_eq!(back["decoder_sparse_step"], 1);
    assert_eq!(back["mlp_only_layers"], serde_json::json!([0, 2, 3]));
}

/// Qwen3 (per-head q/k RMSNorms before RoPE: `--qk-layernorm`; head_dim apart from hidden /
/// heads; a sliding window on layer 1) and Qwen3-MoE (renormalized top-k, a dense first layer)
/// against transformers' logits, back byte for byte with the same config, and a converted Qwen3
/// trains at TP 2 with sequence parallelism (its norms replicated, their gradients summed over
/// the heads' ranks) and Qwen3-MoE at EP 2 as at one rank.
#[test]
fn qwen3_and_qwen3_moe_convert_to_transformers_logits_and_back_and_train_in_every_layout() {
    for (arch, keys) in [
        (
            "qwen3",
            &[
                "architectures",
                "model_type",
                "head_dim",
                "layer_types",
                "sliding_window",
                "tie_word_embeddings",
            ][..],
        ),
        (
            "qwen3_moe",
            &[
                "architectures",
                "model_type",
                "head_dim",
                "mlp_only_layers",
                "norm_topk_prob",
                "num_experts_per_tok",
                "moe_intermediate_size",
            ][..],
        ),
    ] {
        check(arch);
        let dir = tmpdir(&format!("convert-{arch}-layouts"));
        let save = dir.join("m");
        hf_to_megatron(&fixture(arch), &save, 128).unwrap();
        let cfg = load_checkpoint(&save, None).unwrap().meta.model;
        assert!(cfg.qk_layernorm, "{arch}");
        megatron_to_hf(&save, &dir.join("hf")).unwrap();
        let read = |p: &Path| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(p.join("config.json")).unwrap()).unwrap()
        };
        let (orig, back) = (read(&fixture(arch)), read(&dir.join("hf")));
        for key in keys {
            assert_eq!(orig[key], back[key], "{arch}: {key}");
        }
        let s = save.to_str().unwrap();
        let run = |layout: &[&str]| {
            train_converted(s, &[&["--micro-batch-size", "1"][..], layout].concat())
        };
        let one = run(&[]);
        let layout: &[&str] = if arch == "qwen3" {
            &[
                "--nproc-per-node",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
            ]
        } else {
            &["--nproc-per-node", "2", "--expert-model-parallel-size", "2"]
        };
        let r = run(layout);
        common::assert_losses_close(arch, &one.losses, &r.losses, 1e-5);
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// YaRN (`rope_type: "yarn"`, factor 4 over 256 original positions, on a Qwen3): the
/// interpolated frequencies and the concentration factor give transformers' logits, and the
/// export writes the same rope parameters back.
#[test]
fn yarn_rope_converts_to_transformers_logits_and_back() {
    check("qwen3_yarn");
    let (cfg, back) = converted_and_exported("qwen3_yarn");
    let y = cfg.rotary.yarn.expect("YaRN read");
    assert_eq!((y.factor, y.original_max_position_embeddings), (4.0, 256));
    let r = &back["rope_parameters"];
    assert_eq!(r["rope_type"], "yarn");
    assert_eq!(r["factor"], 4.0);
    assert_eq!(r["original_max_position_embeddings"], 256);
}

/// Linear position interpolation (`rope_type: "linear"`, factor 4; Megatron's
/// `--rotary-seq-len-interpolation-factor`) against transformers' logits, and back.
#[test]
fn linear_rope_interpolation_converts_to_transformers_logits_and_back() {
    check("llama_linear_rope");
    let (cfg, back) = converted_and_exported("llama_linear_rope");
    assert_eq!(cfg.rotary.seq_len_interpolation_factor, Some(4.0));
    assert_eq!(back["rope_parameters"]["rope_type"], "linear");
    assert_eq!(back["rope_parameters"]["factor"], 4.0);
}

/// Mixtral has experts on every layer: a model whose `--moe-layer-freq` leaves dense layers
/// and which has no shared expert (so is not Qwen2-MoE either) is refused by flag.
#[test]
fn an_moe_model_with_dense_layers_and_no_shared_expert_is_refused_for_export() {
    let dir = tmpdir("convert-moe-dense-refused");
    let save = dir.join("m");
    let s = save.to_str().unwrap();
    let v = [
        MOE,
        &[
            "--moe-layer-freq",
            "[0,1]",
            "--position-embedding-type",
            "rope",
            "--normalization",
            "RMSNorm",
            "--disable-bias-linear",
            "--train-iters",
            "2",
            "--save",
            s,
        ],
    ]
    .concat();
    megatron_training::pretrain(&args(&v)).unwrap();
    let e = megatron_to_hf(&save, &dir.join("hf"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--moe-layer-freq") && e.contains("--moe-shared-expert-intermediate-size"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_converted_mixtral_trains_at_expert_parallel_layouts_like_one_rank() {
    let dir = tmpdir("convert-mixtral-train");
    let save = dir.join("megatron");
    hf_to_megatron(&fixture("mixtral"), &save, 128).unwrap();
    let s = save.to_str().unwrap();
    let run =
        |layout: &[&str]| train_converted(s, &[&["--micro-batch-size", "1"][..], layout].concat());
    let one = run(&[]);
    for (name, layout) in [
        (
            "EP 4 alltoall",
            &[
                "--nproc-per-node",
                "4",
                "--expert-model-parallel-size",
                "4",
                "--moe-token-dispatcher-type",
                "alltoall",
            ][..],
        ),
        (
            "EP 2 x TP 2",
            &[
                "--nproc-per-node",
                "4",
                "--expert-model-parallel-size",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
            ][..],
        ),
    ] {
        let r = run(layout);
        common::assert_losses_close(name, &one.losses, &r.losses, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_router_expert_bias_with_no_hugging_face_counterpart_is_refused_by_name() {
    let dir = tmpdir("convert-expert-bias");
    let save = dir.join("moe");
    let s = save.to_str().unwrap();
    megatron_training::pretrain(&common::args(&[
        "--num-experts",
        "4",
        "--moe-router-score-function",
        "sigmoid",
        "--moe-router-enable-expert-bias",
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--disable-bias-linear",
        "--train-iters",
        "2",
        "--save",
        s,
    ]))
    .unwrap();
    let e = megatron_to_hf(&save, &dir.join("hf"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("router.expert_bias"), "{e}");
    assert!(!dir.join("hf").exists() && !dir.join("hf.partial").exists());
    let _ = std::fs::remove_dir_all(dir);
}

/// A Llama-shaped model with a non-gated MLP (squared ReLU) and a GPT-2-shaped one with a gated
/// MLP have no Hugging Face counterpart: the export names the activation, writes nothing.
#[test]
fn an_activation_the_hugging_face_family_cannot_express_is_refused_by_name() {
    let dir = tmpdir("convert-activation");
    for (name, act, family, extra) in [
        (
            "rope",
            "--squared-relu",
            "Llama",
            &[
                "--position-embedding-type",
                "rope",
                "--normalization",
                "RMSNorm",
            ][..],
        ),
        ("learned", "--quick-geglu", "GPT-2", &[][..]),
    ] {
        let save = dir.join(name);
        let s = save.to_str().unwrap();
        let mut flags = vec![act, "--train-iters", "2", "--save", s];
        flags.extend_from_slice(extra);
        megatron_training::pretrain(&common::args(&flags)).unwrap();
        let out = dir.join(format!("{name}-hf"));
        let e = megatron_to_hf(&save, &out).unwrap_err().to_string();
        let shown = if act == "--squared-relu" {
            "SquaredRelu"
        } else {
            "QuickGeGLU"
        };
        assert!(e.contains(shown) && e.contains(family), "{e}");
        assert!(!out.exists());
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn an_unknown_architecture_and_a_missing_tensor_are_named() {
    let dir = tmpdir("convert-bad");
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("llama").join(f), hf.join(f)).unwrap();
    }
    let text = std::fs::read_to_string(hf.join("config.json")).unwrap();
    std::fs::write(
        hf.join("config.json"),
        text.replace("LlamaForCausalLM", "FalconForCausalLM"),
    )
    .unwrap();
    let e = hf_to_megatron(&hf, &dir.join("out"), 128)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("config.json") && e.contains("FalconForCausalLM"),
        "{e}"
    );
    // A checkpoint missing a tensor: the GPT-2 fixture read as a Llama.
    std::fs::write(hf.join("config.json"), text).unwrap();
    std::fs::copy(
        fixture("gpt2").join("model.safetensors"),
        hf.join("model.safetensors"),
    )
    .unwrap();
    let e = hf_to_megatron(&hf, &dir.join("out"), 128)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("missing tensor model.embed_tokens.weight"),
        "{e}"
    );
    assert!(!dir
        .join("out")
        .join("latest_checkpointed_iteration.txt")
        .exists());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_quantized_llama_gguf_dequantizes_and_unpermutes_exactly_as_gguf_py() {
    // bench/make_gguf_fixture.py: the HF llama fixture written by gguf-py with llama.cpp's Q/K
    // permutation, as F32, F16, Q8_0, Q4_0 and Q4_1; the expected file holds gguf-py's own
    // dequantization with the permutation undone.
    let dir = tmpdir("convert-gguf");
    let fx = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf");
    let save = dir.join("megatron");
    megatron_training::convert::gguf_to_megatron(&fx.join("tiny-llama.gguf"), &save, 128).unwrap();
    let back = dir.join("hf");
    megatron_to_hf(&save, &back).unwrap();
    let want = std::fs::read(fx.join("tiny-llama-expected.safetensors")).unwrap();
    let got = std::fs::read(back.join("model.safetensors")).unwrap();
    let (want, got) = (
        SafeTensors::deserialize(&want).unwrap(),
        SafeTensors::deserialize(&got).unwrap(),
    );
    assert_eq!(want.len(), got.len());
    for (name, w) in want.tensors() {
        let g = got
            .tensor(&name)
            .unwrap_or_else(|_| panic!("{name} missing"));
        assert_eq!(w.shape(), g.shape(), "{name}");
        assert_eq!(w.data(), g.data(), "{name}: values differ from gguf-py's");
    }
    // A directory given for the .gguf file is named as one (mapping it fails with ENODEV).
    let e = megatron_training::convert::gguf_to_megatron(&fx, &dir.join("d"), 128)
        .unwrap_err()
        .to_string();
    assert!(e.contains("is a directory"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

/// llama.cpp's Qwen2 (q/k/v biases, tied) and Qwen3 (q/k norms, head_dim 16 beside hidden
/// 48 / 4 heads from `attention.key_length`, untied) GGUFs, without the Llama Q/K permutation
/// (`bench/make_gguf_qwen_fixtures.py`, names from gguf-py's own table): logits against
/// transformers' on the same weights, and back to Hugging Face as the same architecture. YaRN
/// from llama.cpp's `rope.scaling.*` keys, Llama 3.1's scaling from its `rope_freqs` tensor.
#[test]
fn qwen2_qwen3_and_scaled_rope_ggufs_give_transformers_logits() {
    let dir = tmpdir("convert-gguf-qwen");
    let fx = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf");
    let reference = fx.join("qwen_reference.safetensors");
    for (arch, class, qk_norm) in [
        ("qwen2", "Qwen2ForCausalLM", false),
        ("qwen3", "Qwen3ForCausalLM", true),
        ("qwen3_yarn", "Qwen3ForCausalLM", true),
    ] {
        let save = dir.join(arch);
        megatron_training::convert::gguf_to_megatron(
            &fx.join(format!("tiny-{arch}.gguf")),
            &save,
            128,
        )
        .unwrap();
        let cfg = load_checkpoint(&save, None).unwrap().meta.model;
        assert_eq!(cfg.qk_layernorm, qk_norm, "{arch}");
        assert_eq!(cfg.add_qkv_bias, !qk_norm, "{arch}");
        assert_eq!(cfg.rotary.yarn.is_some(), arch == "qwen3_yarn", "{arch}");
        let diff = max_logit_difference(&save, &reference, &format!("{arch}.logits"));
        eprintln!("{arch} GGUF: max |logit difference| {diff:e}");
        assert!(diff <= 1e-4, "{arch}: logits differ by {diff}");
        megatron_to_hf(&save, &dir.join(format!("{arch}-hf"))).unwrap();
        let back: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(format!("{arch}-hf")).join("config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(back["architectures"][0], class, "{arch}");
    }
    // llama.cpp's Llama 3.1 scaling: the rope_freqs tensor read back as the factor.
    let save = dir.join("llama3");
    megatron_training::convert::gguf_to_megatron(&fx.join("tiny-llama3_rope.gguf"), &save, 128)
        .unwrap();
    let cfg = load_checkpoint(&save, None).unwrap().meta.model;
    assert_eq!(cfg.rotary.scaling_factor, Some(8.0));
    let diff = max_logit_difference(&save, &reference, "llama3_rope.logits");
    assert!(diff <= 1e-4, "llama3 rope GGUF: logits differ by {diff}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_converted_llama_trains_from_its_own_config_and_matches_one_rank_at_tp2_pp2() {
    // --use-checkpoint-args takes the model from the converted checkpoint; --finetune starts at
    // iteration 0 with fresh Adam; with --lr 0 the weights stay as converted, so every layout
    // must compute the same losses from them.
    let dir = tmpdir("convert-train");
    let save = dir.join("megatron");
    hf_to_megatron(&fixture("llama"), &save, 128).unwrap();
    let s = save.to_str().unwrap();
    let run = |layout: &[&str]| train_converted(s, layout);
    let one = run(&[]);
    assert_eq!(one.start_iteration, 0);
    // The whole converted model trains: its parameter count (not the flags').
    assert!(one.bytes_per_param > 0.0);
    assert_eq!((one.losses.len(), one.val_losses.len()), (2, 1));
    // With --lr 0 both steps see the converted weights.
    assert!(one.losses.iter().all(|l| l.1.is_finite()));
    let tp2pp2 = run(common::TP2_PP2);
    assert_eq!(tp2pp2.losses.len(), 2);
    common::assert_losses_close("TP 2 x PP 2", &one.losses, &tp2pp2.losses, 1e-5);
    common::assert_losses_close(
        "TP 2 x PP 2 validation",
        &one.val_losses,
        &tp2pp2.val_losses,
        1e-5,
    );
    // Model flags that disagree with the checkpoint are refused without --use-checkpoint-args.
    let e = megatron_training::pretrain(&common::args(&["--load", s, "--train-iters", "2"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("another model configuration"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_llama2_tokenizer_checkpoint_exports_its_sentencepiece_model_for_transformers() {
    // A model trained with Megatron's Llama2Tokenizer: `--to hf` writes the tokenizer.model as
    // it is, and a tokenizer.json that gives what the sentencepiece library gives, after BOS
    // (the fixture's vectors: sentencepiece's own ids).
    let dir = tmpdir("convert-llama2-tokenizer");
    let fx = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../megatron-data/tests/fixtures/sentencepiece");
    let model = fx.join("tiny-sotu-bpe.model");
    let m = model.to_str().unwrap();
    let hf = trained_and_exported(
        &dir,
        &[
            "--tokenizer-type",
            "Llama2Tokenizer",
            "--tokenizer-model",
            m,
        ],
    );
    assert_eq!(
        std::fs::read(hf.join("tokenizer.model")).unwrap(),
        std::fs::read(&model).unwrap()
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        (
            &config["bos_token"],
            &config["eos_token"],
            &config["add_bos_token"]
        ),
        (&"<s>".into(), &"</s>".into(), &true.into())
    );
    let t = tokenizers::Tokenizer::from_file(hf.join("tokenizer.json")).unwrap();
    let vectors: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fx.join("tiny-sotu-bpe-vectors.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["tokenizer_class"], "PreTrainedTokenizerFast");
    let mut checked = 0;
    for c in vectors["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        // A Hugging Face tokenizer reads control tokens written in the text as those tokens.
        if text.contains("<s>") {
            continue;
        }
        let mut want = vec![1u32];
        want.extend(
            c["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i.as_u64().unwrap() as u32),
        );
        assert_eq!(
            t.encode(text, true).unwrap().get_ids(),
            &want[..],
            "{text:?}"
        );
        checked += 1;
    }
    assert_eq!(checked, 52);
    let _ = std::fs::remove_dir_all(dir);
}

/// A tiny GPT trained 3 steps on mock data with `tokenizer` flags, exported to HF under `dir`.
fn trained_and_exported(dir: &Path, tokenizer: &[&str]) -> PathBuf {
    let save = dir.join("m");
    let s = save.to_str().unwrap();
    let v = [
        &["megatron", "--mock-data"],
        SMALL_RUN,
        tokenizer,
        &["--train-iters", "3", "--save", s],
    ];
    megatron_training::pretrain(&common::parse_train(&v.concat())).unwrap();
    let hf = dir.join("hf");
    megatron_to_hf(&save, &hf).unwrap();
    hf
}

#[test]
fn a_gpt2_tokenizer_checkpoint_exports_its_vocab_and_merges_for_transformers() {
    let dir = tmpdir("convert-gpt2-tokenizer");
    let gpt2 =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../megatron-data/tests/fixtures/gpt2");
    let (v, m) = (gpt2.join("vocab.json"), gpt2.join("merges.txt"));
    let flags = [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        v.to_str().unwrap(),
        "--merge-file",
        m.to_str().unwrap(),
    ];
    let hf = trained_and_exported(&dir, &flags);
    for (from, name) in [(&v, "vocab.json"), (&m, "merges.txt")] {
        assert_eq!(
            std::fs::read(hf.join(name)).unwrap(),
            std::fs::read(from).unwrap(),
            "{name}"
        );
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["tokenizer_class"], "GPT2Tokenizer");
    assert_eq!(config["eos_token"], "<|endoftext|>");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_hf_llama_with_only_a_tokenizer_model_records_it_as_llama2_tokenizer() {
    // Older Llama repositories ship the sentencepiece model without a tokenizer.json: the
    // checkpoint records it (by absolute path) for Megatron's Llama2Tokenizer, and `--to hf`
    // gives it back. A tokenizer.model no reader here takes is not recorded.
    let dir = tmpdir("convert-tokenizer-model");
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("llama").join(f), hf.join(f)).unwrap();
    }
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../megatron-data/tests/fixtures/sentencepiece/tiny-sotu-bpe.model");
    std::fs::copy(&model, hf.join("tokenizer.model")).unwrap();
    hf_to_megatron(&hf, &dir.join("m"), 128).unwrap();
    let meta = load_checkpoint(&dir.join("m"), None).unwrap().meta;
    assert_eq!(meta.tokenizer_type, "Llama2Tokenizer");
    let recorded = PathBuf::from(meta.tokenizer_model.unwrap());
    assert!(
        recorded.is_absolute() && recorded.ends_with("hf/tokenizer.model"),
        "{recorded:?}"
    );
    megatron_to_hf(&dir.join("m"), &dir.join("back")).unwrap();
    assert_eq!(
        std::fs::read(dir.join("back/tokenizer.model")).unwrap(),
        std::fs::read(&model).unwrap()
    );
    // Not a sentencepiece BPE model: the weights convert, no tokenizer is recorded.
    std::fs::write(hf.join("tokenizer.model"), b"not a model").unwrap();
    hf_to_megatron(&hf, &dir.join("m2"), 128).unwrap();
    let meta = load_checkpoint(&dir.join("m2"), None).unwrap().meta;
    assert_eq!(
        (meta.tokenizer_type.as_str(), meta.tokenizer_model),
        ("NullTokenizer", None)
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_whitespace_collapsing_sentencepiece_model_is_refused_for_transformers() {
    // No Llama tokenizer.json drops and merges spaces as this model does: refused, and nothing
    // is left at the output.
    let dir = tmpdir("convert-collapsing-tokenizer");
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../megatron-data/tests/fixtures/sentencepiece/tiny-sotu-bpe-collapsing.model");
    let m = model.to_str().unwrap();
    let save = dir.join("m");
    let s = save.to_str().unwrap();
    let tok = [
        "--tokenizer-type",
        "Llama2Tokenizer",
        "--tokenizer-model",
        m,
    ];
    let v = [
        &["megatron", "--mock-data"],
        SMALL_RUN,
        &tok,
        &["--train-iters", "3", "--save", s],
    ];
    megatron_training::pretrain(&common::parse_train(&v.concat())).unwrap();
    let e = megatron_to_hf(&save, &dir.join("hf"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("remove_extra_whitespaces"), "{e}");
    assert!(!dir.join("hf").exists() && !dir.join("hf.partial").exists());
    let _ = std::fs::remove_dir_all(dir);
}

/// [`LLAMA`] with `extra` trained 2 iterations and saved under `dir/m` (returned).
fn train_llama(dir: &Path, extra: &[&str]) -> PathBuf {
    let save = dir.join("m");
    let s = save.to_str().unwrap();
    let v = [LLAMA, extra, &["--train-iters", "2", "--save", s]].concat();
    megatron_training::pretrain(&args(&v)).unwrap();
    save
}

/// A NullTokenizer's `--vocab-size V` has V + 1 ids (the end-of-document id is V), and the model
/// trains that row: the export keeps it, and the import records the tokenizer that gives the
/// same ids, so a round trip loses no row.
#[test]
fn a_null_tokenizer_models_end_of_document_row_survives_export_and_import() {
    let dir = tmpdir("convert-null-tokenizer-rows");
    let save = train_llama(&dir, &["--make-vocab-size-divisible-by", "1"]);
    let before = load_checkpoint(&save, None).unwrap();
    // `args` trains with --vocab-size 61: 62 ids.
    assert_eq!(before.meta.vocab_rows(), 62);
    megatron_to_hf(&save, &dir.join("hf")).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("hf/config.json")).unwrap())
            .unwrap();
    assert_eq!(
        config["vocab_size"], 62,
        "the end-of-document row is exported"
    );
    hf_to_megatron(&dir.join("hf"), &dir.join("back"), 1).unwrap();
    let after = load_checkpoint(&dir.join("back"), None).unwrap();
    assert_eq!(after.meta.vocab_size, 61, "the tokenizer of 62 ids");
    assert_eq!(after.meta.vocab_rows(), 62);
    for name in ["embedding.word_embeddings.weight", "output_layer.weight"] {
        let (a, b) = (&before.tensors[name], &after.tensors[name]);
        assert_eq!(a.len(), 62 * 32, "{name}");
        assert!(
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{name} changed in the round trip"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A model part the chosen Hugging Face family has no place for is refused by the flag that
/// made it, not reported as a missing or misshapen tensor.
#[test]
fn a_part_the_hugging_face_family_cannot_hold_is_refused_by_its_flag() {
    let dir = tmpdir("convert-refused-parts");
    let rope = ["--position-embedding-type", "rope"];
    let rms = ["--normalization", "RMSNorm"];
    let cases: [(&str, Vec<&str>, &str); 7] = [
        ("learned-rmsnorm", rms.to_vec(), "--normalization RMSNorm"),
        (
            "learned-gqa",
            vec!["--group-query-attention", "--num-query-groups", "2"],
            "--group-query-attention",
        ),
        (
            "learned-nobias",
            vec!["--disable-bias-linear"],
            "--disable-bias-linear",
        ),
        ("learned-qknorm", vec!["--qk-layernorm"], "--qk-layernorm"),
        ("rope-layernorm", rope.to_vec(), "--normalization LayerNorm"),
        (
            "rope-partial",
            [&rope[..], &rms[..], &["--rotary-percent", "0.5"][..]].concat(),
            "--rotary-percent 0.5",
        ),
        (
            "rope-qknorm-biases",
            [&rope[..], &rms[..], &["--qk-layernorm"][..]].concat(),
            "without --disable-bias-linear",
        ),
    ];
    for (name, extra, want) in cases {
        let save = dir.join(name);
        let s = save.to_str().unwrap();
        let flags = [&["--train-iters", "2", "--save", s][..], &extra].concat();
        megatron_training::pretrain(&common::args(&flags)).unwrap();
        let out = dir.join(format!("{name}-hf"));
        let e = megatron_to_hf(&save, &out).unwrap_err().to_string();
        assert!(e.contains(want), "{name}: {e}");
        assert!(!out.exists(), "{name}: nothing is written");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// An `--rotary-interleaved` model (pairs `(2i, 2i + 1)`) exports as the rotate-half model with
/// the same scores (its query and key features permuted), with query/key norms and grouped
/// queries; converted back it gives the original logits.
#[test]
fn an_interleaved_rotary_model_exports_as_the_rotate_half_model_with_its_logits() {
    let dir = tmpdir("convert-interleaved-rotary");
    let save = train_llama(&dir, &["--rotary-interleaved", "--qk-layernorm"]);
    megatron_to_hf(&save, &dir.join("hf")).unwrap();
    hf_to_megatron(&dir.join("hf"), &dir.join("back"), 128).unwrap();
    let back = load_checkpoint(&dir.join("back"), None).unwrap();
    assert!(!back.meta.model.rotary.interleaved);
    let (b, t, vocab) = (2, 8, 62);
    let ids: Vec<i64> = (0..b * t).map(|i| (i * 7 % 61) as i64).collect();
    let want = megatron_logits(&save, &ids, b, t, vocab);
    let got = megatron_logits(&dir.join("back"), &ids, b, t, vocab);
    let diff = want
        .iter()
        .zip(&got)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    eprintln!("interleaved -> rotate-half: max |logit difference| {diff:e}");
    assert!(diff <= 1e-5, "logits differ by {diff}");
    // The permutation is not the identity: the query rows moved.
    let name = "decoder.layers.0.self_attention.linear_qkv.weight";
    let (before, after) = (
        &load_checkpoint(&save, None).unwrap().tensors[name],
        &back.tensors[name],
    );
    assert_ne!(before, after);
    let _ = std::fs::remove_dir_all(dir);
}
