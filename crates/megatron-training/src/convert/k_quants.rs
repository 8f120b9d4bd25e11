//! ggml's k-quants (`Q2_K` ... `Q6_K`: super-blocks of 256 values in 16 or 8 sub-blocks with
//! their own quantized scales), dequantized to f32 with the operations in the order gguf-py's
//! `quants.py` performs them, so the values are those of its reference bit for bit. Most GGUF
//! files people download are `Q4_K_M` (Q4_K with Q6_K for some tensors). Written by hand: no
//! maintained Rust crate reads these blocks.

/// Values per super-block.
const QK_K: usize = 256;

fn f16(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// The eight 6-bit scales and minimums of a Q4_K / Q5_K super-block, packed in 12 bytes.
fn scale_min_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 0x3F;
        mn[j] = s[j + 4] & 0x3F;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
    (sc, mn)
}

/// One super-block of ggml type `ty` (10 = Q2_K ... 14 = Q6_K) as its 256 values.
pub(crate) fn dequantize_block(ty: u32, b: &[u8]) -> [f32; QK_K] {
    let mut out = [0f32; QK_K];
    match ty {
        10 => {
            // scales[16] (low nibble scale, high nibble min), qs[64] (2 bits), d, dmin.
            let (scales, qs) = (&b[..16], &b[16..80]);
            let (d, dmin) = (f16(&b[80..82]), f16(&b[82..84]));
            for (e, o) in out.iter_mut().enumerate() {
                let (h, s, j) = (e / 128, (e % 128) / 32, e % 32);
                let q = ((qs[h * 32 + j] >> (2 * s)) & 3) as f32;
                let g = scales[e / 16];
                let dl = d * (g & 0x0F) as f32;
                let ml = dmin * (g >> 4) as f32;
                *o = dl * q - ml;
            }
        }
        11 => {
            // hmask[32] (bit 3, inverted), qs[64] (low 2 bits), scales[12] (6 bits, -32), d.
            let (hmask, qs, sc, d) = (&b[..32], &b[32..96], &b[96..108], f16(&b[108..110]));
            let mut scale = [0f32; 16];
            for (k, v) in scale.iter_mut().enumerate() {
                let low = (sc[k % 8] >> (4 * (k / 8))) & 0x0F;
                let high = (sc[8 + k % 4] >> (2 * (k / 4))) & 0x03;
                *v = ((low | (high << 4)) as i8 - 32) as f32;
            }
            for (e, o) in out.iter_mut().enumerate() {
                let (h, s, j) = (e / 128, (e % 128) / 32, e % 32);
                let low = ((qs[h * 32 + j] >> (2 * s)) & 3) as i8;
                let bit = (hmask[e % 32] >> (e / 32)) & 1;
                let q = if bit == 0 { low - 4 } else { low };
                *o = (d * scale[e / 16]) * q as f32;
            }
        }
        12 | 13 => {
            // d, dmin, scales[12], (Q5_K: qh[32],) qs[128] (4 bits).
            let (d, dmin) = (f16(&b[..2]), f16(&b[2..4]));
            let (sc, mn) = scale_min_k4(&b[4..16]);
            let (qh, qs) = if ty == 13 {
                (Some(&b[16..48]), &b[48..176])
            } else {
                (None, &b[16..144])
            };
            for (e, o) in out.iter_mut().enumerate() {
                let (g, j) = (e / 32, e % 32);
                let (c, a) = (g / 2, g % 2);
                let mut q = (qs[c * 32 + j] >> (4 * a)) & 0x0F;
                if let Some(qh) = qh {
                    q |= ((qh[j] >> g) & 1) << 4;
                }
                *o = (d * sc[g] as f32) * q as f32 - dmin * mn[g] as f32;
            }
        }
        14 => {
            // ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (i8), d.
            let (ql, qh, scales, d) = (&b[..128], &b[128..192], &b[192..208], f16(&b[208..210]));
            for (e, o) in out.iter_mut().enumerate() {
                let (h, r) = (e / 128, e % 128);
                let low = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
                let high = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 0x03;
                let q = (low | (high << 4)) as i8 - 32;
                *o = (d * scales[e / 16] as i8 as f32) * q as f32;
            }
        }
        _ => unreachable!("only k-quant types reach here"),
    }
    out
}
