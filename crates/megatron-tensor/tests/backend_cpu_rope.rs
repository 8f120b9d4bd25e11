mod common;
use common::*;
use megatron_tensor::cpu::{
    rope_backward, rope_forward, RopeDims, RopeScaling, RopeStyle, RopeTable, YarnScaling,
};

/// Hugging Face Llama's formulation, in f64: `x * cos(emb) + rotate_half(x) * sin(emb)` with
/// `emb = cat(freqs, freqs)` over the first `rot` features (rotate-half), or Megatron's
/// interleaved one (`emb = [f0, f0, f1, f1, ...]`, `rotate = [-x1, x0, -x3, x2, ...]`).
fn naive_rope_head(x: &[f32], pos: usize, rot: usize, base: f64, style: RopeStyle) -> Vec<f32> {
    let half = rot / 2;
    let freq = |i: usize| pos as f64 * base.powf(-((2 * i) as f64) / rot as f64);
    let mut out: Vec<f32> = x.to_vec();
    for j in 0..rot {
        let (f, rotated) = match style {
            RopeStyle::RotateHalf => {
                let r = if j < half { -x[j + half] } else { x[j - half] };
                (freq(j % half), r)
            }
            RopeStyle::Interleaved => {
                let r = if j % 2 == 0 { -x[j + 1] } else { x[j - 1] };
                (freq(j / 2), r)
            }
        };
        out[j] = (x[j] as f64 * f.cos() + rotated as f64 * f.sin()) as f32;
    }
    out
}

/// Rows `[b * t]` of 2 groups x (2 query heads + k + v) x head_dim 8.
fn naive_rope(qkv: &[f32], d: RopeDims, rot: usize, base: f64) -> Vec<f32> {
    let hd = d.head_dim;
    let row = d.groups * (d.q_per_group + 2) * hd;
    let mut out = qkv.to_vec();
    for (r, chunk) in out.chunks_mut(row).enumerate() {
        let pos = d.first_pos + r % d.t;
        for g in chunk.chunks_mut((d.q_per_group + 2) * hd) {
            for h in 0..=d.q_per_group {
                let head = &mut g[h * hd..(h + 1) * hd];
                let rotated = naive_rope_head(head, pos, rot, base, d.style);
                head.copy_from_slice(&rotated);
            }
        }
    }
    out
}

fn dims(style: RopeStyle) -> RopeDims {
    RopeDims {
        t: 13,
        groups: 2,
        q_per_group: 2,
        head_dim: 8,
        first_pos: 0,
        style,
    }
}

#[test]
fn rope_forward_matches_hugging_face_rotate_half_and_megatron_interleaved() {
    for style in [RopeStyle::RotateHalf, RopeStyle::Interleaved] {
        // Full rotation and --rotary-percent 0.5 (the last 4 features pass through).
        for rot in [8, 4] {
            let d = dims(style);
            let x = randn(3 * 13 * 2 * 4 * 8, 1, 1.0);
            let table = RopeTable::new(rot, 10000.0, 64, None);
            let mut y = x.clone();
            rope_forward(&mut y, &table, d);
            let want = naive_rope(&x, d, rot, 10000.0);
            assert_close(&y, &want, 1e-5, 1e-5, &format!("{style:?} rot {rot}"));
            // Values (every 4th head of a group) are untouched.
            for r in 0..3 * 13 * 2 {
                let v = (r * 4 + 3) * 8;
                assert_eq!(&y[v..v + 8], &x[v..v + 8]);
            }
        }
    }
}

#[test]
fn rope_positions_continue_from_first_pos_for_the_kv_cache() {
    // One token at position 9 rotates as row 9 of a 13-token sequence does.
    let d = dims(RopeStyle::RotateHalf);
    let table = RopeTable::new(8, 500.0, 64, None);
    let x = randn(13 * 2 * 4 * 8, 2, 1.0);
    let mut full = x.clone();
    rope_forward(&mut full, &table, d);
    let row = 2 * 4 * 8;
    let mut one = x[9 * row..10 * row].to_vec();
    rope_forward(
        &mut one,
        &table,
        RopeDims {
            t: 1,
            first_pos: 9,
            ..d
        },
    );
    assert_eq!(&one[..], &full[9 * row..10 * row]);
}

#[test]
fn rope_backward_matches_finite_difference_in_both_conventions() {
    // YaRN scales cos and sin by its concentration factor: a scaled rotation, whose transpose
    // backward must apply, not the plain inverse rotation.
    let yarn = RopeScaling::Yarn(YarnScaling {
        factor: 4.0,
        original_max_position: 16.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        mscale: 1.0,
        mscale_all_dim: 0.0,
        round_to_int: true,
    });
    for (style, scaling) in [
        (RopeStyle::RotateHalf, None),
        (RopeStyle::Interleaved, None),
        (RopeStyle::RotateHalf, Some(yarn)),
        (RopeStyle::RotateHalf, Some(RopeScaling::Linear(4.0))),
    ] {
        let d = dims(style);
        let table = RopeTable::new(6, 10000.0, 64, scaling);
        let mut x = randn(2 * 13 * 2 * 4 * 8, 3, 1.0);
        let r = randn(x.len(), 4, 1.0);
        let mut dx = r.clone();
        rope_backward(&mut dx, &table, d);
        let f = |x: &[f32]| {
            let mut y = x.to_vec();
            rope_forward(&mut y, &table, d);
            dot(&y, &r)
        };
        check_grad(
            &mut x,
            &dx,
            f,
            1e-2,
            1e-3,
            1e-3,
            300,
            &format!("{style:?} {scaling:?}"),
        );
    }
}

#[test]
fn llama3_rope_scaling_divides_long_wavelengths_and_keeps_short_ones() {
    // Llama 3.1 (factor 8, low 1, high 4, original 8192): wavelengths above 8192 are divided by
    // 8, below 2048 kept; in between blended. Base 500000, rot 128, like Llama 3.1 8B.
    let (rot, base) = (128usize, 500000.0f64);
    let plain = RopeTable::new(rot, base, 2, None);
    let scaled = RopeTable::new(rot, base, 2, Some(RopeScaling::llama3(8.0)));
    // Position 1: sin(inv_freq) recovers each frequency (angles are below pi/2 here).
    let mut x = vec![0.0f32; 2 * 3 * rot];
    let d = RopeDims {
        t: 2,
        groups: 1,
        q_per_group: 1,
        head_dim: rot,
        first_pos: 0,
        style: RopeStyle::RotateHalf,
    };
    for r in 0..2 {
        x[r * 3 * rot] = 1.0; // q feature 0 of each row; pairs with feature rot/2.
    }
    let mut checked = [0usize; 3];
    for i in 0..rot / 2 {
        let inv = base.powf(-((2 * i) as f64) / rot as f64);
        let wavelen = 2.0 * std::f64::consts::PI / inv;
        let want = if wavelen < 2048.0 {
            checked[0] += 1;
            inv
        } else if wavelen > 8192.0 {
            checked[1] += 1;
            inv / 8.0
        } else {
            checked[2] += 1;
            let s = (8192.0 / wavelen - 1.0) / 3.0;
            (1.0 - s) * inv / 8.0 + s * inv
        };
        // Rotate a unit vector in pair i by position 1 and read the angle back.
        let mut v = vec![0.0f32; 2 * 3 * rot];
        v[3 * rot + i] = 1.0;
        let mut p = v.clone();
        rope_forward(&mut v, &scaled, d);
        rope_forward(&mut p, &plain, d);
        let angle = (v[3 * rot + i + rot / 2] as f64).atan2(v[3 * rot + i] as f64);
        assert!(
            (angle - want).abs() < 1e-6,
            "pair {i}: angle {angle}, want {want}"
        );
        let plain_angle = (p[3 * rot + i + rot / 2] as f64).atan2(p[3 * rot + i] as f64);
        assert!((plain_angle - inv).abs() < 1e-6, "pair {i} unscaled");
    }
    assert!(
        checked.iter().all(|&c| c > 0),
        "all three bands: {checked:?}"
    );
    let _ = x;
}

/// YaRN's frequencies, worked by hand for rot 8, base 10000, factor 4 over 16 original
/// positions: the correction range is dims [floor(8 ln(16/(32*2pi)) / (2 ln 1e4)) clamped to
/// 0, ceil(8 ln(16/(2pi)) / (2 ln 1e4))] = [0, 1], so frequency 0 keeps its value, frequencies
/// 1..3 are divided by 4, and cos/sin carry 0.1 ln 4 + 1.
#[test]
fn yarn_keeps_fast_frequencies_interpolates_slow_ones_and_scales_by_its_concentration() {
    let yarn = RopeScaling::Yarn(YarnScaling {
        factor: 4.0,
        original_max_position: 16.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        mscale: 1.0,
        mscale_all_dim: 0.0,
        round_to_int: true,
    });
    let table = RopeTable::new(8, 10000.0, 2, Some(yarn));
    let c = 0.1 * 4f64.ln() + 1.0;
    // Position 1: angle = frequency; one head of 8 rotated from (1,...,1 | 0,...,0) gives
    // (c cos f_i | c sin f_i) in the rotate-half layout.
    let d = RopeDims {
        t: 2,
        groups: 1,
        q_per_group: 1,
        head_dim: 8,
        first_pos: 0,
        style: RopeStyle::RotateHalf,
    };
    let mut qkv = vec![0.0f32; 2 * 3 * 8];
    for row in 0..2 {
        qkv[row * 24..row * 24 + 4].fill(1.0);
    }
    rope_forward(&mut qkv, &table, d);
    let q1 = &qkv[24..32];
    for i in 0..4 {
        let f = 10000f64.powf(-((2 * i) as f64) / 8.0) / if i == 0 { 1.0 } else { 4.0 };
        let (want_cos, want_sin) = ((c * f.cos()) as f32, (c * f.sin()) as f32);
        assert!(
            (q1[i] - want_cos).abs() < 1e-6,
            "cos {i}: {} vs {want_cos}",
            q1[i]
        );
        assert!(
            (q1[4 + i] - want_sin).abs() < 1e-6,
            "sin {i}: {} vs {want_sin}",
            q1[4 + i]
        );
    }
}
