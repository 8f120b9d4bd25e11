use megatron_core::optimizer::{LrDecayStyle, OptimizerParamScheduler, WsdDecayStyle};

fn sched(style: LrDecayStyle) -> OptimizerParamScheduler {
    OptimizerParamScheduler {
        init_lr: 0.0,
        max_lr: 1.0,
        min_lr: 0.1,
        warmup_steps: 10,
        decay_steps: 110,
        decay_style: style,
        wsd_decay_steps: 20,
        wsd_decay_style: WsdDecayStyle::Linear,
        num_steps: 0,
    }
}

fn at(mut s: OptimizerParamScheduler, n: u64) -> f64 {
    s.num_steps = n;
    s.get_lr()
}

#[test]
fn warmup_is_linear_from_init_lr() {
    let s = sched(LrDecayStyle::Cosine);
    assert_eq!(at(s.clone(), 0), 0.0);
    assert!((at(s.clone(), 5) - 0.5).abs() < 1e-12);
    assert!((at(s, 10) - 1.0).abs() < 1e-12);
}

#[test]
fn decay_styles_follow_megatron_formulas() {
    let lin = sched(LrDecayStyle::Linear);
    assert!((at(lin.clone(), 60) - 0.55).abs() < 1e-12);
    assert!((at(lin.clone(), 110) - 0.1).abs() < 1e-12);
    assert!((at(lin, 500) - 0.1).abs() < 1e-12);
    let cos = sched(LrDecayStyle::Cosine);
    assert!(
        (at(cos, 60) - 0.55).abs() < 1e-12,
        "cosine midpoint is the mean"
    );
    let c = sched(LrDecayStyle::Constant);
    assert_eq!(at(c, 80), 1.0);
    let isr = sched(LrDecayStyle::InverseSquareRoot);
    assert!((at(isr, 40) - (10f64).sqrt() / (40f64).sqrt()).abs() < 1e-12);
}

#[test]
fn wsd_is_flat_then_anneals_over_its_window() {
    let w = sched(LrDecayStyle::WSD);
    assert_eq!(at(w.clone(), 80), 1.0);
    assert_eq!(at(w.clone(), 90), 1.0);
    assert!((at(w.clone(), 100) - 0.55).abs() < 1e-12);
    assert!((at(w, 110) - 0.1).abs() < 1e-12);
}
