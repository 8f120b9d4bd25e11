use std::fmt;

/// Element types. Compute is always f32 on the CPU; bf16 and f16 are storage formats that the
/// kernels upcast on read, so the reduced-precision path costs memory traffic, not accuracy of the
/// accumulation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
}

impl DType {
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    pub fn parse(s: &str) -> Option<DType> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Some(DType::F32),
            "bf16" | "bfloat16" => Some(DType::BF16),
            "f16" | "fp16" | "float16" => Some(DType::F16),
            _ => None,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        };
        f.write_str(s)
    }
}
