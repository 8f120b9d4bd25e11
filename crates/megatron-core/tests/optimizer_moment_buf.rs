//! `--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16` (moment_buf.rs): the update runs in f32 on the
//! widened moments and only the stored moments are rounded, block by block across the widening
//! boundary; checkpoint views widen exactly.

use half::bf16;
use megatron_core::optimizer::moment_buf::apply_rule;
use megatron_core::optimizer::{MomentDtype, MomentDtypes, UpdateRule};

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
    // More than one widening block (2^18), starting inside a shard; both moments in bf16 (the
    // backend's fused kernel) and one of them (the widening path).
    let n = (1 << 18) * 2 + 777;
    let offset = 5;
    let (bf, f) = (MomentDtype::Bf16, MomentDtype::F32);
    for (exp_avg, exp_avg_sq) in [(bf, bf), (bf, f), (f, bf)] {
        let dtypes = MomentDtypes {
            exp_avg,
            exp_avg_sq,
        };
        let mut state = dtypes.new_state(rule, n + offset);
        let bytes = |d: MomentDtype| (n + offset) * d.bytes();
        assert_eq!(state[0].bytes(), bytes(exp_avg));
        assert_eq!(state[1].bytes(), bytes(exp_avg_sq));
        let mut p = values(n, 1);
        // The reference: the f32 rule on f32 moments, the bf16 ones rounded after every step.
        let mut p_ref = p.clone();
        let (mut m_ref, mut v_ref) = (vec![0.0f32; n], vec![0.0f32; n]);
        let round = |x: &mut [f32], d: MomentDtype| {
            if d == MomentDtype::Bf16 {
                for y in x.iter_mut() {
                    *y = bf16::from_f32(*y).to_f32();
                }
            }
        };
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
            round(&mut m_ref, exp_avg);
            round(&mut v_ref, exp_avg_sq);
            let what = format!("{exp_avg:?}/{exp_avg_sq:?} step {step}");
            assert_eq!(p, p_ref, "{what}: parameters");
            assert_eq!(
                &*state[0].f32s(offset..offset + n),
                &m_ref[..],
                "{what}: exp_avg"
            );
            assert_eq!(
                &*state[1].f32s(offset..offset + n),
                &v_ref[..],
                "{what}: exp_avg_sq"
            );
        }
        // The elements before the shard were never touched.
        assert!(state[0].f32s(0..offset).iter().all(|&x| x == 0.0));
    }
    let dtypes = MomentDtypes {
        exp_avg: bf,
        exp_avg_sq: bf,
    };
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
