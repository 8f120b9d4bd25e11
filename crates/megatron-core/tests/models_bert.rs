//! BERT's heads: the masked-language-model head (dense, GELU, LayerNorm, logits against the
//! tied word embeddings plus an output bias) and the sentence-order head (tanh pooler of the
//! first token, two logits): gradients of every parameter and of the encoder output against
//! central differences. The whole model (`bert_model`): gradients pre-LN and post-LN, the
//! padding mask, and tensor and pipeline parallelism against one rank.

#[path = "models_bert/bert_model.rs"]
mod bert_model;

use megatron_core::models::bert::{BertBinaryHead, BertLMHead, HeadBackward, MaskedTokens};
use megatron_core::params::{Init, ParamId, Params};
use megatron_core::tensor_parallel::{serial_group, Tp};
use megatron_core::transformer::config::GeluForm;
use megatron_core::{Grads, TransformerConfig};
use megatron_tensor::Tensor;

const H: usize = 8;
const V: usize = 11;
const B: usize = 3;
const T: usize = 4;

struct Setup {
    params: Params,
    emb: ParamId,
    lm: BertLMHead,
    binary: BertBinaryHead,
    y: Tensor,
}

fn setup() -> Setup {
    let mut params = Params::for_tp_rank(0, 1);
    let mut inits = Vec::new();
    let emb = params.add(
        &mut inits,
        "embedding.word_embeddings.weight".into(),
        &[V, H],
        true,
        Init::Normal(0.5),
    );
    let cfg = TransformerConfig {
        hidden_size: H,
        padded_vocab_size: V,
        init_method_std: 0.5,
        ..Default::default()
    };
    let lm = BertLMHead::new(&cfg, GeluForm::Erf, &mut params, &mut inits);
    let binary = BertBinaryHead::new(&cfg, &mut params, &mut inits);
    params.initialize(7, &inits);
    // Non-zero biases and norm weights, so their gradients are checked away from the init.
    for (i, v) in params.data.iter_mut().enumerate() {
        *v += 0.05 * ((i * 37 % 11) as f32 - 5.0) / 5.0;
    }
    let y = Tensor::from_vec(
        &[B * T, H],
        (0..B * T * H)
            .map(|i| ((i * 29 % 17) as f32 - 8.0) / 6.0)
            .collect(),
    )
    .expect("shape matches");
    Setup {
        params,
        emb,
        lm,
        binary,
        y,
    }
}

const ROWS: [u32; 4] = [1, 4, 6, 11];
const LABELS: [u32; 4] = [3, 0, 10, 7];
const ORDER: [u32; B] = [0, 1, 1];

fn loss(s: &Setup, params: &Params, y: &Tensor) -> f64 {
    let masked = MaskedTokens {
        rows: &ROWS,
        labels: &LABELS,
    };
    let mut one = serial_group();
    let mut tp = Tp::new(&mut one, false);
    s.lm.loss(params, &mut tp, y, s.emb, &masked, None).unwrap()
        + s.binary.loss(params, y, T, &ORDER, None)
}

#[test]
fn bert_heads_gradients_match_finite_difference() {
    let mut s = setup();
    let mut grads = Grads::zeros_like(&s.params);
    let mut dy = Tensor::zeros(&[B * T, H]);
    let masked = MaskedTokens {
        rows: &ROWS,
        labels: &LABELS,
    };
    let mut one = serial_group();
    let mut tp = Tp::new(&mut one, false);
    let mut back = HeadBackward {
        grads: &mut grads,
        dy: &mut dy,
        dloss: 1.0,
    };
    let l =
        s.lm.loss(
            &s.params,
            &mut tp,
            &s.y,
            s.emb,
            &masked,
            Some(back.reborrow()),
        )
        .unwrap()
            + s.binary.loss(&s.params, &s.y, T, &ORDER, Some(back));
    assert!((l - loss(&s, &s.params, &s.y)).abs() < 1e-9);
    // An untrained head is near chance: ln V for the tokens, ln 2 for the order.
    assert!((l - (V as f64).ln() - 2f64.ln()).abs() < 1.5, "{l}");
    let eps = 1e-2f32;
    let check = |fd: f64, an: f64, what: &str| {
        assert!(
            (fd - an).abs() <= 1e-3 + 3e-2 * an.abs(),
            "{what}: finite difference {fd} vs analytic {an}"
        );
    };
    let mut significant = 0;
    for meta in s.params.metas.clone() {
        for k in 0..4 {
            let i = meta.offset + (meta.numel * (2 * k + 1)) / 8;
            let orig = s.params.data[i];
            s.params.data[i] = orig + eps;
            let fp = loss(&s, &s.params, &s.y);
            s.params.data[i] = orig - eps;
            let fm = loss(&s, &s.params, &s.y);
            s.params.data[i] = orig;
            let an = grads.data[i] as f64;
            check((fp - fm) / (2.0 * eps as f64), an, &meta.name);
            significant += usize::from(an.abs() > 1e-2);
        }
    }
    // The encoder output: masked rows and first tokens get gradients, other rows none.
    for row in 0..B * T {
        for c in [0, H / 2, H - 1] {
            let i = row * H + c;
            let orig = s.y.data()[i];
            s.y.data_mut()[i] = orig + eps;
            let fp = loss(&s, &s.params, &s.y);
            s.y.data_mut()[i] = orig - eps;
            let fm = loss(&s, &s.params, &s.y);
            s.y.data_mut()[i] = orig;
            let an = dy.data()[i] as f64;
            check(
                (fp - fm) / (2.0 * eps as f64),
                an,
                &format!("y[{row}, {c}]"),
            );
            let read = ROWS.contains(&(row as u32)) || row % T == 0;
            if !read {
                assert_eq!(an, 0.0, "row {row} is neither masked nor a first token");
            }
        }
    }
    assert!(
        significant >= 20,
        "{significant} significant parameter gradients"
    );
}
