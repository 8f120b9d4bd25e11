use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

pub fn f32_to_bf16(out: &mut [bf16], inp: &[f32]) {
    out.convert_from_f32_slice(inp);
}
pub fn bf16_to_f32(out: &mut [f32], inp: &[bf16]) {
    inp.convert_to_f32_slice(out);
}
pub fn f32_to_f16(out: &mut [f16], inp: &[f32]) {
    out.convert_from_f32_slice(inp);
}
pub fn f16_to_f32(out: &mut [f32], inp: &[f16]) {
    inp.convert_to_f32_slice(out);
}
