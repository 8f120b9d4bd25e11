//! T5 conversion against transformers (`bench/make_hf_t5_fixture.py`; a tiny random
//! `T5ForConditionalGeneration` committed with its outputs): the converted model gives
//! transformers' logits (padded encoder input, causal decoder, relative position buckets,
//! tied rescaled output) and loss; converted back it gives the original file byte for byte.

mod common;

use clap::Parser;
use common::{safetensor_f32 as floats, safetensor_i64 as ints, tmpdir};
use megatron_core::models::t5::T5Batch;
use megatron_core::tensor_parallel::{serial_group, Tp};
use megatron_core::transformer::step::StepContext;
use megatron_tensor::cpu::IGNORE_INDEX;
use megatron_training::convert::{hf_to_megatron, megatron_to_hf};
use megatron_training::load::load_t5;
use safetensors::SafeTensors;

#[derive(Parser)]
struct GenWrap {
    #[command(flatten)]
    args: megatron_training::GenerateArgs,
}
use std::path::PathBuf;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/t5")
}

/// A fixture's reference inputs (`bench/make_hf_t5_fixture.py`): encoder ids with padding and
/// their lengths, decoder ids, labels (-100 not counted).
struct Reference {
    enc: Vec<u32>,
    dec: Vec<u32>,
    labels: Vec<u32>,
    mask: Vec<f32>,
    enc_lens: Vec<usize>,
    dec_lens: Vec<usize>,
    te: usize,
    td: usize,
}

impl Reference {
    fn read(r: &SafeTensors) -> Reference {
        let enc: Vec<u32> = ints(r, "input_ids").iter().map(|&x| x as u32).collect();
        let dec: Vec<u32> = ints(r, "decoder_input_ids")
            .iter()
            .map(|&x| x as u32)
            .collect();
        let labels: Vec<u32> = ints(r, "labels")
            .iter()
            .map(|&x| if x < 0 { IGNORE_INDEX } else { x as u32 })
            .collect();
        let mask = labels
            .iter()
            .map(|&l| if l == IGNORE_INDEX { 0.0 } else { 1.0 })
            .collect();
        let te = r.tensor("input_ids").unwrap().shape()[1];
        let td = r.tensor("decoder_input_ids").unwrap().shape()[1];
        let enc_lens = ints(r, "attention_mask")
            .chunks(te)
            .map(|m| m.iter().filter(|&&x| x == 1).count())
            .collect();
        Reference {
            enc,
            dec,
            labels,
            mask,
            enc_lens,
            dec_lens: vec![td, td],
            te,
            td,
        }
    }

    fn batch(&self) -> T5Batch<'_> {
        T5Batch {
            enc_tokens: &self.enc,
            dec_tokens: &self.dec,
            labels: &self.labels,
            loss_mask: &self.mask,
            enc_lens: &self.enc_lens,
            dec_lens: &self.dec_lens,
            b: 2,
            te: self.te,
            td: self.td,
        }
    }
}

#[test]
fn t5_converts_to_transformers_logits_and_loss_and_back_byte_for_byte() {
    let dir = tmpdir("convert-t5");
    let save = dir.join("megatron");
    hf_to_megatron(&fixture(), &save, 128).unwrap();
    let refb = std::fs::read(fixture().join("reference.safetensors")).unwrap();
    let r = SafeTensors::deserialize(&refb).unwrap();
    let reference = Reference::read(&r);
    let batch = reference.batch();
    let (b, te, td) = (2, reference.te, reference.td);
    let (enc, enc_lens) = (&reference.enc, &reference.enc_lens);
    let (model, params, ck) = load_t5(&save).unwrap();
    let mut one = serial_group();
    let mut tp = Tp::new(&mut one, false);
    let logits = model.logits(&params, &mut tp, &batch).unwrap();
    let vocab = ck.meta.vocab_rows();
    let vp = logits.shape()[1];
    let want = floats(&r, "logits");
    let mut diff = 0.0f32;
    for row in 0..b * td {
        for c in 0..vocab {
            diff = diff.max((logits.data()[row * vp + c] - want[row * vocab + c]).abs());
        }
    }
    eprintln!("t5: max |logit difference| {diff:e}");
    assert!(diff <= 1e-4, "logits differ by {diff}");
    // The loss counts the padded vocabulary's zero rows too (as Megatron's would): converted
    // with no padding it is transformers' loss.
    let save1 = dir.join("unpadded");
    hf_to_megatron(&fixture(), &save1, 1).unwrap();
    let (m1, p1, _) = load_t5(&save1).unwrap();
    let st = m1
        .forward(&p1, None, &mut tp, &batch, 1.0, &StepContext::eval())
        .unwrap();
    let want_loss = floats(&r, "loss")[0];
    assert!(
        (st.loss() - want_loss).abs() <= 1e-5 * want_loss,
        "loss {} vs {want_loss}",
        st.loss()
    );
    // Greedy decoding: transformers' `generate` (decoder start 0, eos 1, pad 0).
    let want: Vec<u32> = ints(&r, "greedy").iter().map(|&x| x as u32).collect();
    let steps = r.tensor("greedy").unwrap().shape()[1] - 1;
    let got = model
        .greedy(&params, &mut tp, enc, enc_lens, (0, 1, 0), vocab, steps)
        .unwrap();
    assert_eq!(got.concat(), want, "greedy decoding");
    // The same through `megatron generate` (the prompt is the encoder's input).
    let prompt: Vec<String> = enc[..te].iter().map(|t| t.to_string()).collect();
    let ids = prompt.join(" ");
    let g = GenWrap::try_parse_from([
        "m",
        "--load",
        save.to_str().unwrap(),
        "--prompt-ids",
        &ids,
        "--greedy",
        "--max-new-tokens",
        &steps.to_string(),
    ])
    .unwrap();
    let text = megatron_training::generate::generate(&g.args).unwrap();
    let gen: Vec<u32> = text
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    let expect: Vec<u32> = want[1..=steps]
        .iter()
        .copied()
        .take_while(|&t| t != 1)
        .collect();
    assert_eq!(gen, expect, "megatron generate");
    // Sampling: top-k 1 is greedy; a seed gives one output; seeds at a high temperature differ.
    let sample = |extra: &[&str]| -> Vec<u32> {
        let base = [
            "m",
            "--load",
            save.to_str().unwrap(),
            "--prompt-ids",
            &ids,
            "--max-new-tokens",
            "12",
            "--eos-id",
            "100000",
        ];
        let g = GenWrap::try_parse_from(base.iter().copied().chain(extra.iter().copied())).unwrap();
        megatron_training::generate::generate(&g.args)
            .unwrap()
            .split_whitespace()
            .map(|x| x.parse().unwrap())
            .collect()
    };
    let greedy12 = sample(&["--greedy"]);
    assert_eq!(greedy12.len(), 12);
    // Up to transformers' end of sequence, the same ids as its greedy output.
    let k = want[1..=steps]
        .iter()
        .position(|&t| t == 1)
        .unwrap_or(steps)
        .min(12);
    assert!(k > 0);
    assert_eq!(greedy12[..k], want[1..=k], "greedy without an end id");
    assert_eq!(
        sample(&["--top-k", "1", "--seed", "3"]),
        greedy12,
        "top-k 1"
    );
    let hot = |seed: &str| sample(&["--temperature", "5", "--seed", seed]);
    let a = hot("1");
    assert_eq!(a, hot("1"), "one seed, one output");
    assert!(
        a.iter().all(|&t| (t as usize) < vocab),
        "sampled ids in the vocabulary"
    );
    let outputs: std::collections::HashSet<Vec<u32>> =
        ["1", "2", "3", "4"].into_iter().map(hot).collect();
    assert!(
        outputs.len() > 1,
        "seeds sample different outputs: {outputs:?}"
    );
    // And back.
    let back = dir.join("hf");
    megatron_to_hf(&save, &back).unwrap();
    let a = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let c = std::fs::read(back.join("model.safetensors")).unwrap();
    assert!(
        a == c,
        "the exported model.safetensors differs from the original"
    );
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(back.join("config.json")).unwrap()).unwrap();
    let orig: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap())
            .unwrap();
    for key in [
        "architectures",
        "d_kv",
        "num_decoder_layers",
        "relative_attention_num_buckets",
        "layer_norm_epsilon",
        "feed_forward_proj",
    ] {
        assert_eq!(cfg[key], orig[key], "config.json {key}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The original T5's ReLU MLP (tied, rescaled output) and T5 v1.1's gated GELU with an untied
/// `lm_head` and no rescaling (`bench/make_hf_t5_variant_fixtures.py`), and squared ReLU and
/// Quick-GEGLU (`bench/make_hf_activation_fixtures.py`): transformers' logits and loss, and back
/// byte for byte with the config's MLP and tying.
#[test]
fn t5_relu_and_gated_gelu_untied_variants_convert_both_ways() {
    for (name, proj, tied) in [
        ("t5_relu", "relu", true),
        ("t5_gated", "gated-gelu", false),
        ("t5_relu2", "relu2", true),
        ("t5_quick_geglu", "gated-quick_gelu", true),
    ] {
        let src = fixture().with_file_name(name);
        let dir = tmpdir(&format!("convert-{name}"));
        let save = dir.join("megatron");
        hf_to_megatron(&src, &save, 1).unwrap();
        let refb = std::fs::read(src.join("reference.safetensors")).unwrap();
        let r = SafeTensors::deserialize(&refb).unwrap();
        let reference = Reference::read(&r);
        let batch = reference.batch();
        let (model, params, ck) = load_t5(&save).unwrap();
        assert_eq!(
            ck.meta.model.untie_embeddings_and_output_weights, !tied,
            "{name}: tying"
        );
        assert_eq!(model.output_layer.is_some(), !tied, "{name}: output layer");
        let mut one = serial_group();
        let mut tp = Tp::new(&mut one, false);
        let logits = model.logits(&params, &mut tp, &batch).unwrap();
        let want = floats(&r, "logits");
        let diff = logits
            .data()
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        eprintln!("{name}: max |logit difference| {diff:e}");
        assert!(diff <= 1e-4, "{name}: logits differ by {diff}");
        let st = model
            .forward(&params, None, &mut tp, &batch, 1.0, &StepContext::eval())
            .unwrap();
        let want_loss = floats(&r, "loss")[0];
        assert!(
            (st.loss() - want_loss).abs() <= 1e-5 * want_loss,
            "{name}: loss {} vs {want_loss}",
            st.loss()
        );
        let back = dir.join("hf");
        megatron_to_hf(&save, &back).unwrap();
        let a = std::fs::read(src.join("model.safetensors")).unwrap();
        let c = std::fs::read(back.join("model.safetensors")).unwrap();
        assert!(a == c, "{name}: the exported model.safetensors differs");
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(back.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(cfg["feed_forward_proj"], proj, "{name}");
        assert_eq!(cfg["tie_word_embeddings"], tied, "{name}");
        assert_eq!(cfg["scale_decoder_outputs"], tied, "{name}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
