//! `--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16` (moment_buf.rs): the update runs in f32 on the
//! widened moments and only the stored moments are rounded, block by block across the widening
//! boundary; checkpoint views widen exactly.

use half::bf16;
use megatron_core::optimizer::moment_buf::apply_rule;
use megatron_core::optimizer::{MomentBuf, MomentDtype, MomentDtypes, UpdateRule};

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) as f32 / u32::MAX as f32) - 0.5
        })
        .collect()
}

#[test]
fn bf16_moments_step_in_f32_and_round_only_what_they_store() {
    let rule = UpdateRule::Adam {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
    };
    // More than one widening block (2^18), starting inside a shard.
    let n = (1 << 18) * 2 + 777;
    let offset = 5;
    let dtypes = MomentDtypes {
        exp_avg: MomentDtype::Bf16,
        exp_avg_sq: MomentDtype::Bf16,
    };
    let mut state = dtypes.new_state(rule, n + offset);
    assert!(matches!(state[0], MomentBuf::Bf16(_)));
    assert_eq!(state[0].bytes(), (n + offset) * 2, "half the bytes of f32");
    let mut p = values(n, 1);
    // The reference: the f32 rule on f32 moments, rounded to bf16 after every step.
    let mut p_ref = p.clone();
    let (mut m_ref, mut v_ref) = (vec![0.0f32; n], vec![0.0f32; n]);
    for step in 1..=3u64 {
        let g = values(n, 7 + step as u32);
        apply_rule(
            rule,
            &mut p,
            &g,
            &mut state,
            offset..offset + n,
            1e-3,
            0.1,
            step,
        );
        rule.apply(
            &mut p_ref,
            &g,
            &mut [&mut m_ref[..], &mut v_ref[..]],
            1e-3,
            0.1,
            step,
        );
        for x in m_ref.iter_mut().chain(v_ref.iter_mut()) {
            *x = bf16::from_f32(*x).to_f32();
        }
        assert_eq!(p, p_ref, "step {step}: parameters");
        assert_eq!(
            &*state[0].f32s(offset..offset + n),
            &m_ref[..],
            "step {step}: exp_avg"
        );
        assert_eq!(
            &*state[1].f32s(offset..offset + n),
            &v_ref[..],
            "step {step}: exp_avg_sq"
        );
    }
    // The elements before the shard were never touched.
    assert!(state[0].f32s(0..offset).iter().all(|&x| x == 0.0));
    // Rounding is to nearest: the stored moments differ from the unrounded f32 ones.
    let mut m32 = vec![0.0f32; n];
    let mut v32 = vec![0.0f32; n];
    let mut p32 = values(n, 1);
    rule.apply(
        &mut p32,
        &values(n, 8),
        &mut [&mut m32[..], &mut v32[..]],
        1e-3,
        0.1,
        1,
    );
    let mut one = dtypes.new_state(rule, n);
    let mut p1 = values(n, 1);
    apply_rule(rule, &mut p1, &values(n, 8), &mut one, 0..n, 1e-3, 0.1, 1);
    assert_eq!(p1, p32, "the first step's update is the f32 one");
    assert_ne!(&*one[0].f32s(0..n), &m32[..]);
    let within = one[0]
        .f32s(0..n)
        .iter()
        .zip(&m32)
        .all(|(r, x)| (r - x).abs() <= x.abs() * (1.0 / 256.0));
    assert!(within, "bf16 keeps 8 bits of mantissa");
}
