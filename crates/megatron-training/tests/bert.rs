//! `megatron train --model bert` on the committed sentence-split fixture: losses fall, and
//! every layout trains the model one rank trains (fp32, dropout on): TP 2 with sequence
//! parallelism, PP 2, DP 2 with the distributed optimizer; the checkpoint records the BERT
//! heads and resumes bit for bit; BERT-only flags and refusals are named.

mod common;

use common::{assert_same_training, bert_args, bert_args_on, sentencepiece_sotu, tmpdir};
use megatron_training::checkpointing::{load_checkpoint, LoadedCheckpoint};
use megatron_training::{pretrain, TrainSummary};

fn bert_run(
    dir: &std::path::Path,
    name: &str,
    layout: &[&str],
) -> (TrainSummary, LoadedCheckpoint) {
    let save = dir.join(name);
    let s = save.to_str().unwrap().to_string();
    let mut extra = vec!["--train-iters", "5", "--save", &s];
    extra.extend_from_slice(layout);
    let summary = pretrain(&bert_args(&extra)).unwrap();
    (summary, load_checkpoint(&save, None).unwrap())
}

#[test]
fn bert_layouts_match_one_rank() {
    let dir = tmpdir("bert-layouts");
    let serial = bert_run(&dir, "serial", &[]);
    let heads = serial
        .1
        .meta
        .bert
        .expect("a BERT checkpoint records its heads");
    assert_eq!(heads.num_tokentypes, 2);
    assert!(serial.1.tensors.contains_key("binary_head.weight"));
    assert!(serial
        .1
        .tensors
        .contains_key("encoder.final_layernorm.weight"));
    for (name, layout) in [
        (
            "tp2 + sp",
            &[
                "--nproc-per-node",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
            ][..],
        ),
        (
            "pp2",
            &[
                "--nproc-per-node",
                "2",
                "--pipeline-model-parallel-size",
                "2",
            ][..],
        ),
        (
            "dp2 + distributed optimizer",
            &["--nproc-per-node", "2", "--use-distributed-optimizer"][..],
        ),
    ] {
        let run = bert_run(&dir, &name.replace(' ', ""), layout);
        assert_same_training(&format!("bert {name}"), &serial, &run, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bert_at_tp2_pp2_dp2_with_the_distributed_optimizer_matches_one_rank_and_reshards() {
    // Every layout at once (8 rank threads), then its checkpoint resumed at another layout.
    let dir = tmpdir("bert-3d");
    let serial = bert_run(&dir, "serial", &[]);
    let three_d = [
        "--nproc-per-node",
        "8",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--use-distributed-optimizer",
        "--num-threads",
        "1",
    ];
    let run = bert_run(&dir, "3d", &three_d);
    assert_same_training("bert tp2 x pp2 x dp2", &serial, &run, 1e-5);
    // The 8-rank checkpoint continued on one rank and on 2 pipeline stages: the same losses.
    let more = |name: &str, layout: &[&str]| {
        let from = dir.join("3d");
        let to = dir.join(name);
        let mut flags = vec![
            "--train-iters",
            "7",
            "--override-opt_param-scheduler",
            "--load",
            from.to_str().unwrap(),
            "--save",
            to.to_str().unwrap(),
        ];
        flags.extend_from_slice(layout);
        // A copy to load from, so the two continuations start alike.
        pretrain(&bert_args(&flags)).unwrap()
    };
    let one = more("resumed-1", &[]);
    let pp2 = more(
        "resumed-pp2",
        &[
            "--nproc-per-node",
            "2",
            "--pipeline-model-parallel-size",
            "2",
        ],
    );
    assert_eq!(one.start_iteration, 5);
    common::assert_losses_close("bert resharded 3d -> pp2", &one.losses, &pp2.losses, 1e-5);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bert_pretraining_loss_falls_and_post_ln_without_the_binary_head_trains() {
    let dir = tmpdir("bert-falls");
    let save = dir.join("ck");
    let s = save.to_str().unwrap();
    let flags = [
        "--train-iters",
        "60",
        "--lr",
        "5e-3",
        "--eval-interval",
        "60",
        "--transformer-block-type",
        "post_ln",
        "--bert-no-binary-head",
        "--save",
        s,
    ];
    let summary = pretrain(&bert_args(&flags)).unwrap();
    let first: f64 = summary.losses[..5].iter().map(|l| l.1).sum::<f64>() / 5.0;
    let last: f64 = summary.losses[55..].iter().map(|l| l.1).sum::<f64>() / 5.0;
    assert!(
        first > 9.5,
        "an untrained MLM loss is near ln(30522) = 10.3: {first}"
    );
    assert!(last < first - 1.0, "loss {first} -> {last}");
    let ck = load_checkpoint(&save, None).unwrap();
    let heads = ck.meta.bert.unwrap();
    assert_eq!(heads.num_tokentypes, 0);
    assert!(!ck.tensors.contains_key("binary_head.weight"));
    assert!(ck.tensors.contains_key("embedding.layernorm.weight"));
    assert!(ck
        .tensors
        .contains_key("encoder.layers.1.post_mlp_layernorm.weight"));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bert_resumes_from_its_checkpoint_bit_for_bit() {
    let dir = tmpdir("bert-resume");
    let (a, b) = (dir.join("a"), dir.join("b"));
    let full = pretrain(&bert_args(&[
        "--train-iters",
        "6",
        "--save",
        a.to_str().unwrap(),
    ]))
    .unwrap();
    pretrain(&bert_args(&[
        "--train-iters",
        "3",
        "--save",
        b.to_str().unwrap(),
    ]))
    .unwrap();
    let resumed = pretrain(&bert_args(&[
        "--train-iters",
        "6",
        "--override-opt_param-scheduler",
        "--load",
        b.to_str().unwrap(),
        "--save",
        b.to_str().unwrap(),
    ]))
    .unwrap();
    assert_eq!(resumed.start_iteration, 3);
    for (x, y) in full.losses[3..].iter().zip(&resumed.losses) {
        assert_eq!(x.0, y.0);
        assert_eq!(
            x.1.to_bits(),
            y.1.to_bits(),
            "iteration {}: {} vs {}",
            x.0,
            x.1,
            y.1
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bert_refuses_what_it_does_not_support_by_flag() {
    for (flags, want) in [
        (
            &["--context-parallel-size", "2", "--nproc-per-node", "2"][..],
            "--context-parallel-size",
        ),
        (&["--reset-attention-mask"][..], "--reset-attention-mask"),
        (
            &["--untie-embeddings-and-output-weights"][..],
            "--untie-embeddings-and-output-weights",
        ),
        (&["--mask-prob", "1.5"][..], "--mask-prob"),
        (
            &["--seq-length", "4", "--max-position-embeddings", "4"][..],
            "--seq-length must be at least 5",
        ),
    ] {
        let e = pretrain(&bert_args(&[&["--train-iters", "3"], flags].concat()))
            .expect_err("refused")
            .to_string();
        assert!(e.contains(want), "{flags:?}: {e}");
    }
    // A tokenizer without BERT's special tokens is named.
    let e = pretrain(&bert_args(&[
        "--train-iters",
        "3",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "30522",
    ]))
    .expect_err("refused")
    .to_string();
    assert!(e.contains("[CLS]") && e.contains("NullTokenizer"), "{e}");
}

/// megatron-core's `BertLMHead` runs torch's exact `F.gelu` whatever the layers run (their
/// default is the fused tanh bias-GELU), so a BERT trained from flags records an erf head.
/// Hugging Face BERT (post-LN) has one `hidden_act` for both: such a model's export is refused
/// by name, and one trained with `--no-bias-gelu-fusion` (erf everywhere) exports as `gelu`.
#[test]
fn the_mlm_head_runs_megatrons_exact_gelu_and_exports_only_when_the_layers_agree() {
    use megatron_core::transformer::config::GeluForm;
    let dir = tmpdir("bert-head-gelu");
    let post_ln = ["--transformer-block-type", "post_ln"];
    let mixed = bert_run(&dir, "mixed", &post_ln);
    let heads = mixed.1.meta.bert.expect("BERT heads");
    assert_eq!(heads.lm_head_gelu, Some(GeluForm::Erf));
    assert_eq!(mixed.1.meta.model.gelu, GeluForm::Tanh);
    let e = megatron_training::convert::megatron_to_hf(&dir.join("mixed"), &dir.join("mixed-hf"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("MLM head") && e.contains("--no-bias-gelu-fusion"),
        "{e}"
    );
    assert!(!dir.join("mixed-hf").exists());
    let erf = bert_run(
        &dir,
        "erf",
        &[&post_ln[..], &["--no-bias-gelu-fusion"]].concat(),
    );
    let heads = erf.1.meta.bert.expect("BERT heads");
    assert_eq!(heads.lm_head_gelu, Some(GeluForm::Erf));
    assert_eq!(erf.1.meta.model.gelu, GeluForm::Erf);
    megatron_training::convert::megatron_to_hf(&dir.join("erf"), &dir.join("erf-hf")).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("erf-hf/config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["hidden_act"], "gelu");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bert_trains_on_megatrons_sentencepiece_tokenizer_with_its_appended_specials() {
    let dir = tmpdir("bert-sentencepiece");
    let sp = sentencepiece_sotu(&dir, "tiny-sotu-bpe.model", 0);
    // 1,000 pieces and <CLS> <SEP> <EOD> <MASK> <PAD> appended (BOS and EOS are the model's).
    assert_eq!(sp.vocab_size, 1005);
    let flags = [
        "--train-iters",
        "150",
        "--lr",
        "1e-2",
        "--eval-interval",
        "150",
    ];
    let tokenizer: Vec<&str> = sp.flags.iter().map(String::as_str).collect();
    let summary = pretrain(&bert_args_on(&sp.data, &tokenizer, &flags)).unwrap();
    let first: f64 = summary.losses[..5].iter().map(|l| l.1).sum::<f64>() / 5.0;
    let last: f64 = summary.losses[145..].iter().map(|l| l.1).sum::<f64>() / 5.0;
    assert!(
        (6.0..9.0).contains(&first),
        "an untrained MLM loss is near ln(1005) = 6.9 (plus the binary head's): {first}"
    );
    // About 20 masked tokens a step: the loss is noisy, and the run deterministic.
    assert!(last < first - 0.5, "loss {first} -> {last}");
    let _ = std::fs::remove_dir_all(dir);
}

/// The metrics file's rows of a BERT run at `layout`: training rows and evaluation rows.
fn bert_metrics(
    dir: &std::path::Path,
    name: &str,
    extra: &[&str],
) -> (TrainSummary, Vec<serde_json::Value>, Vec<serde_json::Value>) {
    let f = dir.join(format!("{name}.jsonl"));
    let flags = [
        &[
            "--train-iters",
            "4",
            "--log-interval",
            "1",
            "--eval-interval",
            "2",
            "--metrics-file",
            f.to_str().unwrap(),
        ][..],
        extra,
    ]
    .concat();
    let s = pretrain(&bert_args(&flags)).unwrap();
    let (train, eval) = common::metrics_rows(&f);
    (s, train, eval)
}

#[test]
fn the_log_shows_the_sentence_order_loss_apart_as_megatron_does() {
    let dir = tmpdir("bert-sop-log");
    for (name, layout) in [
        ("serial", &[][..]),
        (
            "tp2-pp2",
            &[
                "--nproc-per-node",
                "4",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--pipeline-model-parallel-size",
                "2",
            ][..],
        ),
    ] {
        let (s, train, eval) = bert_metrics(&dir, name, layout);
        assert_eq!(train.len(), 4, "{name}");
        for (row, &(it, total)) in train.iter().zip(&s.losses) {
            assert_eq!(row["iteration"].as_u64().unwrap(), it);
            let (lm, sop) = (
                row["lm_loss"].as_f64().unwrap(),
                row["sop_loss"].as_f64().unwrap(),
            );
            // Two classes: near ln 2 while untrained; the MLM part near ln(vocabulary).
            assert!(
                (0.4..1.0).contains(&sop),
                "{name} iteration {it}: sop {sop}"
            );
            assert!(lm > 8.0, "{name} iteration {it}: lm {lm}");
            assert!(
                (lm + sop - total).abs() < 1e-6 * total,
                "{name} iteration {it}: {lm} + {sop} vs {total}"
            );
        }
        assert_eq!(eval.len(), s.val_losses.len());
        for (row, &(_, total)) in eval.iter().zip(&s.val_losses) {
            let (lm, sop) = (
                row["val_loss"].as_f64().unwrap(),
                row["val_sop_loss"].as_f64().unwrap(),
            );
            assert!((0.4..1.0).contains(&sop), "{name}: validation sop {sop}");
            assert!(
                (lm + sop - total).abs() < 1e-6 * total,
                "{name}: validation"
            );
        }
    }
    // TensorBoard: Megatron's `sop loss` beside `lm loss`, each iteration and each validation.
    let tb = dir.join("tb");
    let (s, _, eval) = bert_metrics(&dir, "tb", &["--tensorboard-dir", tb.to_str().unwrap()]);
    let file = std::fs::read_dir(&tb)
        .unwrap()
        .flatten()
        .next()
        .unwrap()
        .path();
    let scalars = megatron_training::tensorboard::read_scalars(&file).unwrap();
    let tag = |t: &str| scalars.iter().filter(|x| x.tag == t).count();
    assert_eq!(tag("sop loss"), 4);
    assert_eq!(tag("sop loss validation"), eval.len());
    let lm = scalars.iter().find(|x| x.tag == "lm loss").unwrap().value as f64;
    let sop = scalars.iter().find(|x| x.tag == "sop loss").unwrap().value as f64;
    assert!((lm + sop - s.losses[0].1).abs() < 1e-5 * s.losses[0].1);
    let (s, train, eval) = bert_metrics(&dir, "no-binary-head", &["--bert-no-binary-head"]);
    assert!(train.iter().all(|r| r.get("sop_loss").is_none()));
    assert!(eval.iter().all(|r| r.get("val_sop_loss").is_none()));
    assert_eq!(train[0]["lm_loss"].as_f64().unwrap(), s.losses[0].1);
    let _ = std::fs::remove_dir_all(dir);
}
