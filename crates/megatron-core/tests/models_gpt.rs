use megatron_core::inference::{decode_step, KVCache};
use megatron_core::transformer::step::StepContext;
use megatron_core::{Batch, GPTModel, Grads, TransformerConfig};

fn tiny(untie: bool, dropout: f32) -> TransformerConfig {
    TransformerConfig {
        num_layers: 2,
        hidden_size: 16,
        num_attention_heads: 2,
        ffn_hidden_size: 64,
        seq_length: 8,
        max_position_embeddings: 8,
        padded_vocab_size: 64,
        hidden_dropout: dropout,
        attention_dropout: dropout,
        init_method_std: 0.2,
        layernorm_epsilon: 1e-5,
        untie_embeddings_and_output_weights: untie,
    }
}

fn data(b: usize, t: usize) -> (Vec<u32>, Vec<u32>, Vec<f32>) {
    let tokens: Vec<u32> = (0..b * t).map(|i| ((i * 37 + 11) % 64) as u32).collect();
    let labels: Vec<u32> = (0..b * t).map(|i| ((i * 53 + 5) % 64) as u32).collect();
    let mask: Vec<f32> = (0..b * t)
        .map(|i| if i % 5 == 4 { 0.0 } else { 1.0 })
        .collect();
    (tokens, labels, mask)
}

fn gradient_check(untie: bool) {
    let cfg = tiny(untie, 0.0);
    let (model, mut params) = GPTModel::new(cfg, 42);
    let (b, t) = (2, 8);
    let (tokens, labels, mask) = data(b, t);
    let batch = Batch {
        tokens: &tokens,
        labels: &labels,
        loss_mask: &mask,
        b,
        t,
        position_ids: None,
        doc_start: None,
    };
    let mut grads = Grads::zeros_like(&params);
    let r = model.forward_backward_serial(&params, &mut grads, &batch, 1.0, &StepContext::eval());
    let l0 = model.forward_loss_serial(&params, &batch);
    assert!(
        (r.loss - l0).abs() < 1e-5,
        "forward_backward loss {} vs forward_loss {}",
        r.loss,
        l0
    );
    let eps = 1e-2f32;
    let mut checked = 0;
    let mut max_rel = 0.0f64;
    for meta in params.metas.clone() {
        // Three coordinates per parameter tensor, spread over it.
        for k in 0..3 {
            let i = meta.offset + (meta.numel * (2 * k + 1)) / 6;
            let orig = params.data[i];
            params.data[i] = orig + eps;
            let fp = model.forward_loss_serial(&params, &batch) as f64;
            params.data[i] = orig - eps;
            let fm = model.forward_loss_serial(&params, &batch) as f64;
            params.data[i] = orig;
            let fd = (fp - fm) / (2.0 * eps as f64);
            let an = grads.data[i] as f64;
            // Tolerance: f32 forward noise (~1e-6 of the loss) over 2*eps, plus 5% relative.
            assert!(
                (fd - an).abs() <= 1e-3 + 5e-2 * an.abs(),
                "{}[{}]: finite difference {fd} vs analytic {an}",
                meta.name,
                i - meta.offset
            );
            if an.abs() > 1e-2 {
                max_rel = max_rel.max((fd - an).abs() / an.abs());
            }
            checked += 1;
        }
    }
    assert!(checked >= 3 * 20);
    assert!(max_rel < 5e-2, "max relative error {max_rel}");
}

#[test]
fn gpt_whole_model_gradient_matches_finite_difference() {
    gradient_check(false);
}

#[test]
fn gpt_untied_output_layer_gradient_matches_finite_difference() {
    gradient_check(true);
}

#[test]
fn gpt_parameters_carry_megatron_names_and_decay_flags() {
    let (_, params) = GPTModel::new(tiny(false, 0.0), 1);
    let names: Vec<&str> = params.metas.iter().map(|m| m.name.as_str()).collect();
    for want in [
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.1.mlp.linear_fc2.bias",
        "decoder.final_layernorm.weight",
    ] {
        assert!(names.contains(&want), "missing {want}");
    }
    assert!(
        !names.contains(&"output_layer.weight"),
        "tied model has no output layer"
    );
    for m in &params.metas {
        let is_vector = m.shape.len() == 1;
        assert_eq!(
            m.weight_decay, !is_vector,
            "{}: decay only on matrices",
            m.name
        );
    }
    let qkv = params
        .find("decoder.layers.0.self_attention.linear_qkv.weight")
        .unwrap();
    assert_eq!(params.metas[qkv.0].shape, vec![48, 16]);
}

#[test]
fn gpt_init_scales_output_projections() {
    let mut cfg = tiny(false, 0.0);
    cfg.hidden_size = 64;
    cfg.ffn_hidden_size = 256;
    cfg.init_method_std = 0.02;
    let (_, params) = GPTModel::new(cfg, 3);
    let std_of = |name: &str| {
        let x = params.get(params.find(name).unwrap());
        (x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt()
    };
    let qkv = std_of("decoder.layers.0.self_attention.linear_qkv.weight");
    let proj = std_of("decoder.layers.0.self_attention.linear_proj.weight");
    assert!((qkv - 0.02).abs() < 0.001, "qkv std {qkv}");
    assert!(
        (proj - 0.01).abs() < 0.001,
        "proj std {proj} (0.02 / sqrt(2 * 2 layers))"
    );
    assert!(params
        .get(params.find("decoder.layers.0.mlp.linear_fc1.bias").unwrap())
        .iter()
        .all(|v| *v == 0.0));
    assert!(params
        .get(
            params
                .find("decoder.layers.0.input_layernorm.weight")
                .unwrap()
        )
        .iter()
        .all(|v| *v == 1.0));
}

#[test]
fn gpt_dropout_changes_loss_in_training_but_not_in_eval() {
    let (model, params) = GPTModel::new(tiny(false, 0.3), 7);
    let (b, t) = (2, 8);
    let (tokens, labels, mask) = data(b, t);
    let batch = Batch {
        tokens: &tokens,
        labels: &labels,
        loss_mask: &mask,
        b,
        t,
        position_ids: None,
        doc_start: None,
    };
    let mut g = Grads::zeros_like(&params);
    let a = model
        .forward_backward_serial(&params, &mut g, &batch, 1.0, &StepContext::train(1, 1, 0))
        .loss;
    let a2 = model
        .forward_backward_serial(&params, &mut g, &batch, 1.0, &StepContext::train(1, 1, 0))
        .loss;
    let c = model
        .forward_backward_serial(&params, &mut g, &batch, 1.0, &StepContext::train(1, 2, 0))
        .loss;
    assert_eq!(a, a2, "same key, same masks");
    assert_ne!(a, c, "another iteration draws other masks");
    assert_eq!(
        model.forward_loss_serial(&params, &batch),
        model.forward_loss_serial(&params, &batch)
    );
}

#[test]
fn kv_cache_decoding_reproduces_full_sequence_loss() {
    let (model, params) = GPTModel::new(tiny(false, 0.0), 9);
    let (b, t) = (2, 8);
    let (tokens, labels, _) = data(b, t);
    let mask = vec![1.0f32; b * t];
    let batch = Batch {
        tokens: &tokens,
        labels: &labels,
        loss_mask: &mask,
        b,
        t,
        position_ids: None,
        doc_start: None,
    };
    let full = model.forward_loss_serial(&params, &batch) as f64;
    let mut cache = KVCache::new(&model, b, t);
    let mut total = 0.0f64;
    for pos in 0..t {
        let step_tokens: Vec<u32> = (0..b).map(|bi| tokens[bi * t + pos]).collect();
        let logits = decode_step(&model, &params, &mut cache, &step_tokens);
        let v = model.config.padded_vocab_size;
        for bi in 0..b {
            let row = &logits.data()[bi * v..(bi + 1) * v];
            let mx = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = mx + row.iter().map(|z| (*z as f64 - mx).exp()).sum::<f64>().ln();
            total += lse - row[labels[bi * t + pos] as usize] as f64;
        }
    }
    let decoded = total / (b * t) as f64;
    assert!(
        (decoded - full).abs() < 1e-4,
        "decode {decoded} vs full {full}"
    );
}

#[test]
fn reset_position_ids_and_attention_mask_isolate_documents() {
    // Sequence 1 = [doc A (5 tokens incl. its end-of-document 63), doc B (11 tokens)];
    // sequence 2 = [doc B, 5 filler tokens]. With positions and attention reset at the
    // end-of-document token, B's losses are the same in both.
    let mut cfg = tiny(false, 0.0);
    cfg.seq_length = 16;
    cfg.max_position_embeddings = 16;
    let (model, params) = GPTModel::new(cfg, 5);
    let t = 16;
    let doc_a = [7u32, 8, 9, 10, 63];
    let doc_b: Vec<u32> = (0..12).map(|i| (i * 5 + 3) % 60).collect();
    let mut s1: Vec<u32> = doc_a.to_vec();
    s1.extend(&doc_b[..]);
    let (tok1, lab1) = (s1[..t].to_vec(), s1[1..=t].to_vec());
    let mut s2: Vec<u32> = doc_b.clone();
    s2.extend([1u32, 2, 3, 4, 5]);
    let (tok2, lab2) = (s2[..t].to_vec(), s2[1..=t].to_vec());
    let mut pos1 = vec![0u32; t];
    let mut start1 = vec![0u32; t];
    for q in 0..t {
        if q >= 5 {
            pos1[q] = (q - 5) as u32;
            start1[q] = 5;
        } else {
            pos1[q] = q as u32;
        }
    }
    // Losses on B's 11 labels only.
    let mask1: Vec<f32> = (0..t).map(|q| if q >= 5 { 1.0 } else { 0.0 }).collect();
    let mask2: Vec<f32> = (0..t).map(|q| if q < 11 { 1.0 } else { 0.0 }).collect();
    let l1 = model.forward_loss_serial(
        &params,
        &Batch {
            tokens: &tok1,
            labels: &lab1,
            loss_mask: &mask1,
            b: 1,
            t,
            position_ids: Some(&pos1),
            doc_start: Some(&start1),
        },
    );
    let l2 = model.forward_loss_serial(
        &params,
        &Batch {
            tokens: &tok2,
            labels: &lab2,
            loss_mask: &mask2,
            b: 1,
            t,
            position_ids: None,
            doc_start: None,
        },
    );
    assert!(
        (l1 - l2).abs() < 1e-5,
        "document B alone {l2} vs after A with resets {l1}"
    );
    let l_no_reset = model.forward_loss_serial(
        &params,
        &Batch {
            tokens: &tok1,
            labels: &lab1,
            loss_mask: &mask1,
            b: 1,
            t,
            position_ids: None,
            doc_start: None,
        },
    );
    assert!(
        (l_no_reset - l2).abs() > 1e-4,
        "without resets, document A leaks into B"
    );
}
