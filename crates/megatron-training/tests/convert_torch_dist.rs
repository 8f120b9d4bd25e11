//! `megatron convert --from torch_dist` against the outside reference: checkpoints that
//! Megatron-LM's own code saved (`bench/make_megatron_dist_fixtures.py`: its argument parser,
//! `gpt_builder` and `dist_checkpointing.save`, on CPU ranks; committed with the logits
//! megatron-core computes from them), converted, give megatron-core's logits and train in
//! every layout as at one rank.

mod common;

use common::hf_fixtures::{megatron_fixture as fixture, megatron_fixture_gives_reference_logits};
use common::tmpdir;
use megatron_training::checkpointing::load_checkpoint;
use megatron_training::convert::pickle::{unpickle, PyValue};
use megatron_training::convert::torch_dist_to_megatron;
use megatron_training::convert::OptimizerExport;
use std::path::{Path, PathBuf};

/// `name` converted under a directory of the calling test's own (`test`).
fn converted(name: &str, test: &str) -> (PathBuf, PathBuf) {
    let dir = tmpdir(&format!("torch-dist-{name}-{test}"));
    let save = dir.join("converted");
    torch_dist_to_megatron(&fixture(name), &save).unwrap();
    (dir, save)
}

fn logits_match(name: &str) {
    megatron_fixture_gives_reference_logits(name, torch_dist_to_megatron);
}

#[test]
fn a_megatron_lm_gpt_checkpoint_converts_to_megatron_cores_logits() {
    // LayerNorm, GELU (the fused bias-GELU's tanh form, as the saved arguments say), learned
    // positions, biases, tied output layer; one rank, layers stacked under one key each.
    logits_match("gpt");
}

#[test]
fn a_llama_checkpoint_saved_at_tp2_pp2_converts_to_megatron_cores_logits() {
    // RMSNorm, SwiGLU (fc1's gate and up halves saved from each TP rank), RoPE, 4 heads in 2
    // groups, query/key norms, no biases, untied output layer; chunks from 4 ranks' files.
    logits_match("llama_tp2_pp2");
}

#[test]
fn a_gpt_trained_in_bf16_at_tp2_dp2_converts_to_megatron_cores_logits() {
    // bf16 parameters (widened exactly to f32: the reference loads them into an fp32 model),
    // chunks written once over the data-parallel replicas.
    logits_match("gpt_bf16_tp2_dp2");
}

#[test]
fn mixtral_style_experts_saved_at_expert_parallel_2_convert_to_megatron_cores_logits() {
    // 4 SwiGLU experts, top 2, softmax router; the experts stored together under one key per
    // weight (layer and expert leading), each expert-parallel rank's experts from its file.
    logits_match("mixtral_ep2");
}

#[test]
fn a_deepseek_style_moe_saved_at_pp2_converts_to_megatron_cores_logits() {
    // A dense first layer (--moe-layer-freq [0,1,1,1], so megatron-core keeps per-layer keys),
    // a shared expert, a sigmoid router with a non-zero expert bias (a buffer) and top-k
    // scaling 2.5.
    logits_match("deepseek_moe_pp2");
}

#[test]
fn multi_latent_attention_saved_at_tp2_converts_to_megatron_cores_logits() {
    // DeepSeek's MLA: query latent 16 and key/value latent 12 with their RMSNorms, heads of 8
    // content + 4 rotary features and values of 6, YaRN (factor 4, mscale 0.7 over 0.5) from
    // rope_type; the local spec's down projections split over the two TP ranks' files.
    logits_match("mla_yarn_tp2");
}

#[test]
fn multi_latent_attention_without_a_query_latent_saved_at_pp2_converts_to_megatron_cores_logits() {
    // linear_q_proj, no latent norms, plain RoPE (base 500), over two pipeline stages.
    logits_match("mla_rope_pp2");
}

#[test]
fn the_model_and_tokenizer_come_from_the_saved_arguments() {
    let (dir, save) = converted("llama_tp2_pp2", "arguments");
    let ck = load_checkpoint(&save, None).unwrap();
    let m = &ck.meta.model;
    assert_eq!(
        (
            m.num_layers,
            m.hidden_size,
            m.ffn_hidden_size,
            m.num_attention_heads
        ),
        (4, 32, 48, 4)
    );
    assert_eq!(m.num_query_groups, Some(2));
    // Saved as layernorm_epsilon, the destination of Megatron-LM's --norm-epsilon.
    assert_eq!(m.layernorm_epsilon, 1e-6);
    assert!(m.qk_layernorm && m.untie_embeddings_and_output_weights && !m.add_bias_linear);
    // Megatron padded 101 ids (NullTokenizer --vocab-size 100) to 32 x TP 2.
    assert_eq!(m.padded_vocab_size, 128);
    assert_eq!(
        (ck.meta.tokenizer_type.as_str(), ck.meta.vocab_size),
        ("NullTokenizer", 100)
    );
    assert_eq!(ck.meta.iteration, 0);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_converted_megatron_lm_checkpoint_trains_at_tp2_pp2_like_one_rank() {
    // --lr 0: every step sees the converted weights, so every layout computes the same losses.
    let (dir, save) = converted("llama_tp2_pp2", "trains");
    let s = save.to_str().unwrap();
    let run = |layout: &[&str]| common::hf_fixtures::train_converted_with_vocab(s, "100", layout);
    let one = run(&[]);
    assert_eq!(one.losses.len(), 2);
    assert!(one.losses.iter().all(|l| l.1.is_finite()));
    let tp2pp2 = run(common::TP2_PP2);
    common::assert_losses_close("TP 2 x PP 2", &one.losses, &tp2pp2.losses, 1e-5);
    let _ = std::fs::remove_dir_all(dir);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

#[test]
fn a_damaged_or_other_format_checkpoint_is_refused_by_name() {
    let dir = tmpdir("torch-dist-damaged");
    let out = dir.join("out");
    // A rank's file cut short: the key stored past its end is named.
    let cut = dir.join("cut");
    copy_dir(&fixture("llama_tp2_pp2"), &cut);
    let f = cut.join("iter_0000010/__3_0.distcp");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let e = torch_dist_to_megatron(&cut, &out).unwrap_err().to_string();
    assert!(e.contains("past the end of __3_0.distcp"), "{e}");
    // A rank's file missing.
    std::fs::remove_file(&f).unwrap();
    let e = torch_dist_to_megatron(&cut, &out).unwrap_err().to_string();
    assert!(
        e.contains("__3_0.distcp") && e.contains("cannot open"),
        "{e}"
    );
    // A tracker naming an iteration that is not there.
    std::fs::write(cut.join("latest_checkpointed_iteration.txt"), "20").unwrap();
    let e = torch_dist_to_megatron(&cut, &out).unwrap_err().to_string();
    assert!(e.contains("iter_0000020"), "{e}");
    // Megatron's legacy format.
    let legacy = dir.join("legacy");
    std::fs::create_dir_all(legacy.join("iter_0000005/mp_rank_00")).unwrap();
    std::fs::write(legacy.join("latest_checkpointed_iteration.txt"), "5").unwrap();
    let e = torch_dist_to_megatron(&legacy, &out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--ckpt-format torch checkpoint"), "{e}");
    // Nothing was written for any of them.
    assert!(!out.join("latest_checkpointed_iteration.txt").exists());
    let _ = std::fs::remove_dir_all(dir);
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn pickles_of_protocols_2_and_4_read_as_python_wrote_them() {
    // Python 3.11: pickle.dumps({'a': [1, 2.5, 'x', None, True], 'b': (1, -300, 2**40),
    // 'c': collections.OrderedDict([('k', b'by')])}, protocol=2 and 4).
    let p2 = "80027d71002858010000006171015d7102284b0147400400000000000058010000007871034e886558010000006271044b014ad4feffff8a06000000000001877105580100000063710663636f6c6c656374696f6e730a4f726465726564446963740a71072952710858010000006b7109635f636f646563730a656e636f64650a710a58020000006279710b58060000006c6174696e31710c86710d52710e73752e";
    let p4 = "80049562000000000000007d94288c0161945d94284b014740040000000000008c0178944e88658c0162944b014ad4feffff8a0600000000000187948c0163948c0b636f6c6c656374696f6e73948c0b4f726465726564446963749493942952948c016b94430262799473752e";
    for (proto, bytes) in [(2, p2), (4, p4)] {
        let v = unpickle(&hex(bytes)).unwrap();
        assert_eq!(
            v.get("a"),
            Some(&PyValue::List(vec![
                PyValue::Int(1),
                PyValue::Float(2.5),
                PyValue::Str("x".into()),
                PyValue::None,
                PyValue::Bool(true)
            ])),
            "protocol {proto}"
        );
        assert_eq!(
            v.get("b").and_then(|b| b.as_seq()).map(|s| s.to_vec()),
            Some(vec![
                PyValue::Int(1),
                PyValue::Int(-300),
                PyValue::Int(1 << 40)
            ]),
            "protocol {proto}"
        );
        // An OrderedDict is a dict; protocol 2 pickles bytes as a call of _codecs.encode.
        let c = v.get("c").and_then(|c| c.get("k")).unwrap();
        match proto {
            2 => assert_eq!(c.class_name().as_deref(), Some("_codecs.encode")),
            _ => assert_eq!(c, &PyValue::Bytes(b"by".to_vec())),
        }
    }
    // Cut short, or an opcode this reader does not know: an error, not a panic.
    let e = unpickle(&hex(&p4[..60])).unwrap_err();
    assert!(e.contains("ends inside"), "{e}");
    let e = unpickle(&[0x80, 0x02, 0xff]).unwrap_err();
    assert!(e.contains("opcode 0xff"), "{e}");
}

/// Every parameter of two checkpoints, by name, as stored.
fn parameters(save: &Path) -> Vec<(String, Vec<f32>)> {
    let mut t: Vec<(String, Vec<f32>)> =
        megatron_training::checkpointing::load_checkpoint_weights(save)
            .unwrap()
            .tensors
            .into_iter()
            .collect();
    t.sort_by(|a, b| a.0.cmp(&b.0));
    t
}

#[test]
fn an_export_to_torch_dist_reads_back_bit_for_bit_as_a_release_checkpoint() {
    // Megatron-LM's own load_checkpoint reading these exports at TP 1 and 2 gives the
    // original's logits (bench/megatron_dist_export_check.py, which needs torch); here the
    // format's own reading of it: the same tensors, bit for bit, and the same model.
    for name in [
        "gpt",
        "llama_tp2_pp2",
        "gpt_bf16_tp2_dp2",
        "mixtral_ep2",
        "deepseek_moe_pp2",
    ] {
        let (dir, first) = converted(name, "export");
        let export = dir.join("export");
        let release = megatron_training::convert::megatron_to_torch_dist(
            &first,
            &export,
            OptimizerExport::default(),
            megatron_training::convert::LayerSpec::default(),
        )
        .unwrap();
        assert!(release.ends_with("release"));
        assert_eq!(
            std::fs::read_to_string(export.join("latest_checkpointed_iteration.txt")).unwrap(),
            "release"
        );
        let back = dir.join("back");
        torch_dist_to_megatron(&export, &back).unwrap();
        assert_eq!(parameters(&first), parameters(&back), "{name}");
        let (a, b) = (
            load_checkpoint(&first, None).unwrap().meta,
            load_checkpoint(&back, None).unwrap().meta,
        );
        assert_eq!(a.model, b.model, "{name}");
        assert_eq!(
            (a.tokenizer_type, a.vocab_size),
            (b.tokenizer_type, b.vocab_size),
            "{name}"
        );
        // An export never overwrites one.
        let e = megatron_training::convert::megatron_to_torch_dist(
            &first,
            &export,
            OptimizerExport::default(),
            megatron_training::convert::LayerSpec::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("already exists"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn an_export_names_norms_for_the_layer_spec_that_will_load_it() {
    // Transformer Engine (Megatron-LM's default) fuses MLA's latent norms into the up
    // projections and keeps an MoE layer's pre-MLP norm apart; the local spec keeps MLA's
    // norms under their own names and maps an MoE layer's onto linear_fc1's. Either export
    // reads back bit for bit.
    use megatron_training::convert::LayerSpec;
    let cases: [(&str, LayerSpec, &[&str], &[&str]); 4] = [
        (
            "mla_yarn_tp2",
            LayerSpec::TransformerEngine,
            &[
                "decoder.layers.self_attention.linear_q_up_proj.layer_norm_weight",
                "decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight",
                "decoder.layers.input_layernorm.weight",
                "decoder.layers.mlp.linear_fc1.layer_norm_weight",
            ],
            &["decoder.layers.self_attention.q_layernorm.weight"],
        ),
        (
            "mla_yarn_tp2",
            LayerSpec::Local,
            &[
                "decoder.layers.self_attention.q_layernorm.weight",
                "decoder.layers.self_attention.kv_layernorm.weight",
                "decoder.layers.input_layernorm.weight",
                "decoder.layers.pre_mlp_layernorm.weight",
            ],
            &["decoder.layers.self_attention.linear_q_up_proj.layer_norm_weight"],
        ),
        (
            "mixtral_ep2",
            LayerSpec::TransformerEngine,
            &[
                "decoder.layers.pre_mlp_layernorm.weight",
                "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            ],
            &["decoder.layers.mlp.linear_fc1.layer_norm_weight"],
        ),
        (
            "mixtral_ep2",
            LayerSpec::Local,
            &["decoder.layers.mlp.linear_fc1.layer_norm_weight"],
            &["decoder.layers.pre_mlp_layernorm.weight"],
        ),
    ];
    for (name, spec, present, absent) in cases {
        let (dir, first) = converted(name, &format!("spec-{spec:?}"));
        let export = dir.join("export");
        megatron_training::convert::megatron_to_torch_dist(
            &first,
            &export,
            OptimizerExport::default(),
            spec,
        )
        .unwrap();
        let ck =
            megatron_training::convert::torch_dist::TorchDistCheckpoint::open(&export).unwrap();
        for key in present {
            assert!(ck.sizes.contains_key(*key), "{name} {spec:?}: no {key}");
        }
        for key in absent {
            assert!(!ck.sizes.contains_key(*key), "{name} {spec:?}: {key}");
        }
        let back = dir.join("back");
        torch_dist_to_megatron(&export, &back).unwrap();
        assert_eq!(parameters(&first), parameters(&back), "{name} {spec:?}");
        assert_eq!(
            load_checkpoint(&first, None).unwrap().meta.model,
            load_checkpoint(&back, None).unwrap().meta.model,
            "{name} {spec:?}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn a_model_megatron_lm_cannot_load_is_refused_for_export_by_name() {
    let dir = tmpdir("torch-dist-export-mtp");
    let save = dir.join("mtp");
    let mut a = common::args(&[
        "--mtp-num-layers",
        "1",
        "--train-iters",
        "2",
        "--lr-warmup-iters",
        "0",
        "--save",
        save.to_str().unwrap(),
    ]);
    a.save_interval = Some(1);
    megatron_training::pretrain(&a).unwrap();
    let e = megatron_training::convert::megatron_to_torch_dist(
        &save,
        &dir.join("out"),
        OptimizerExport::default(),
        megatron_training::convert::LayerSpec::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("multi-token prediction"), "{e}");
    assert!(!dir.join("out/release").exists());
    let _ = std::fs::remove_dir_all(dir);
}
