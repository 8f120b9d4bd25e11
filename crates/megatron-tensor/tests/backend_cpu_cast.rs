//! The bf16 casts every 16-bit tensor goes through: narrowing must give the `half` crate's bits
//! (round to nearest even, NaN kept quiet) on every kind of value, widening is exact.

mod common;

use common::*;
use half::bf16;
use megatron_tensor::cpu::cast::{bf16_to_f32, f32_to_bf16};

fn every_kind_of_value() -> Vec<f32> {
    let mut x = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        1.0e-40,
        -1.0e-41,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0xffc0_1234),
        // Ties: the lower half exactly 0x8000, with an even and an odd upper half.
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::from_bits(0x3f80_7fff),
        f32::from_bits(0x3f80_8001),
        // Rounds up into infinity.
        f32::from_bits(0x7f7f_ffff),
    ];
    x.extend(randn(1000, 11, 100.0));
    x
}

#[test]
fn f32_to_bf16_matches_the_half_crate_on_every_kind_of_value() {
    let x = every_kind_of_value();
    let mut out = vec![bf16::ZERO; x.len()];
    f32_to_bf16(&mut out, &x);
    for (i, (o, v)) in out.iter().zip(&x).enumerate() {
        let want = bf16::from_f32(*v);
        assert_eq!(
            o.to_bits(),
            want.to_bits(),
            "[{i}] {v:?} (bits {:#x})",
            v.to_bits()
        );
    }
}

#[test]
fn bf16_to_f32_is_exact() {
    let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
    let mut out = vec![0.0f32; all.len()];
    bf16_to_f32(&mut out, &all);
    for (o, v) in out.iter().zip(&all) {
        assert_eq!(o.to_bits(), (v.to_bits() as u32) << 16);
    }
}
