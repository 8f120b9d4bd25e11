use crate::cpu::operand::{Operand, OperandMut};
use crate::dtype::DType;
use crate::pool;
use half::f16;
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
}

#[derive(Debug, thiserror::Error)]
pub enum TensorError {
    #[error("shape mismatch: expected {expected:?}, got {got:?}")]
    Shape {
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("tensor holds {got}, operation needs {expected}")]
    DType { expected: DType, got: DType },
}

enum Storage {
    F32(Vec<f32>),
    BF16(pool::Bf16Buf),
    F16(Vec<f16>),
}

/// A dense row-major tensor. f32 buffers come from the per-thread pool and go back to it on drop.
pub struct Tensor {
    shape: Vec<usize>,
    storage: Storage,
    device: Device,
}

impl Tensor {
    pub fn zeros(shape: &[usize]) -> Tensor {
        let n = shape.iter().product();
        Tensor {
            shape: shape.to_vec(),
            storage: Storage::F32(pool::take_zeroed(n)),
            device: Device::Cpu,
        }
    }

    /// A tensor whose contents are arbitrary (stale, never uninitialized memory): for outputs a
    /// kernel overwrites completely, saving the zero fill.
    pub fn for_overwrite(shape: &[usize]) -> Tensor {
        let n = shape.iter().product();
        Tensor {
            shape: shape.to_vec(),
            storage: Storage::F32(pool::take_any(n)),
            device: Device::Cpu,
        }
    }

    /// A bf16 tensor for a kernel to overwrite completely (a `--bf16` layer's output that only
    /// a 16-bit matmul reads).
    pub fn for_overwrite_bf16(shape: &[usize]) -> Tensor {
        let n = shape.iter().product();
        Tensor {
            shape: shape.to_vec(),
            storage: Storage::BF16(pool::Bf16Buf::take_any(n)),
            device: Device::Cpu,
        }
    }

    /// A tensor of `dtype` (f32 or bf16) for a kernel to overwrite completely.
    pub fn for_overwrite_as(shape: &[usize], dtype: DType) -> Tensor {
        match dtype {
            DType::F32 => Tensor::for_overwrite(shape),
            DType::BF16 => Tensor::for_overwrite_bf16(shape),
            DType::F16 => panic!("for_overwrite_as: no kernel writes f16 tensors"),
        }
    }

    pub fn from_vec(shape: &[usize], data: Vec<f32>) -> Result<Tensor, TensorError> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(TensorError::Shape {
                expected: shape.to_vec(),
                got: vec![data.len()],
            });
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            storage: Storage::F32(data),
            device: Device::Cpu,
        })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn device(&self) -> Device {
        self.device
    }
    pub fn dtype(&self) -> DType {
        match self.storage {
            Storage::F32(_) => DType::F32,
            Storage::BF16(_) => DType::BF16,
            Storage::F16(_) => DType::F16,
        }
    }
    pub fn size_in_bytes(&self) -> usize {
        self.numel() * self.dtype().size_in_bytes()
    }

    /// The f32 elements. Panics on a half-precision tensor: that is a programming error in the
    /// caller (it must `to_dtype(F32)` first), never a user error.
    pub fn data(&self) -> &[f32] {
        match &self.storage {
            Storage::F32(v) => v,
            _ => panic!("data() on a {} tensor", self.dtype()),
        }
    }
    pub fn data_mut(&mut self) -> &mut [f32] {
        match &mut self.storage {
            Storage::F32(v) => v,
            _ => panic!("data_mut() on a non-f32 tensor"),
        }
    }

    /// A bf16 tensor's elements as f32 words of two values each (an even count only): for
    /// moves that copy whole words (a collective, a row gather) without arithmetic, which keeps
    /// every bit. `None` for other tensors.
    pub fn bf16_words(&self) -> Option<&[f32]> {
        match &self.storage {
            Storage::BF16(v) if self.numel().is_multiple_of(2) => Some(v.words()),
            _ => None,
        }
    }

    /// The inverse of [`Tensor::bf16_words`]: `words` (f32 storage, two bf16 values each) as a
    /// bf16 tensor of `shape`, without a copy.
    pub fn bf16_from_words(mut words: Tensor, shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        assert_eq!(
            2 * words.numel(),
            n,
            "bf16_from_words: {n} values in {} words",
            words.numel()
        );
        let Storage::F32(v) = &mut words.storage else {
            panic!("bf16_from_words on a {} tensor", words.dtype());
        };
        Tensor {
            shape: shape.to_vec(),
            storage: Storage::BF16(pool::Bf16Buf::from_words(std::mem::take(v), n)),
            device: Device::Cpu,
        }
    }

    /// The elements as a kernel reads them, f32 or bf16 (see
    /// [`crate::cpu::matmul::Operand`]). Panics on an f16 tensor: kernels read those widened,
    /// so reaching here is a programming error in the caller.
    pub fn operand(&self) -> Operand<'_> {
        match &self.storage {
            Storage::F32(v) => Operand::F32(v),
            Storage::BF16(v) => Operand::BF16(v.as_slice()),
            Storage::F16(_) => panic!("operand() on an f16 tensor"),
        }
    }

    /// The elements as a kernel writes them (see [`Tensor::operand`]).
    pub fn operand_mut(&mut self) -> OperandMut<'_> {
        match &mut self.storage {
            Storage::F32(v) => OperandMut::F32(v),
            Storage::BF16(v) => OperandMut::BF16(v.as_mut_slice()),
            Storage::F16(_) => panic!("operand_mut() on an f16 tensor"),
        }
    }

    pub fn reshape(mut self, shape: &[usize]) -> Result<Tensor, TensorError> {
        if shape.iter().product::<usize>() != self.numel() {
            return Err(TensorError::Shape {
                expected: self.shape.clone(),
                got: shape.to_vec(),
            });
        }
        self.shape = shape.to_vec();
        Ok(self)
    }

    /// `[a; b]`: the rows of two f32 `[n, w]` tensors of one width, one after the other (what
    /// travels between pipeline stages as one message when a stage sends two tensors).
    pub fn cat_rows(a: &Tensor, b: &Tensor) -> Tensor {
        let w = a.shape[1..].iter().product::<usize>();
        assert_eq!(
            w,
            b.shape[1..].iter().product::<usize>(),
            "cat_rows: widths"
        );
        let rows = a.numel() / w.max(1) + b.numel() / w.max(1);
        let mut shape = a.shape.clone();
        shape[0] = rows;
        let mut out = Tensor::for_overwrite(&shape);
        let (head, tail) = out.data_mut().split_at_mut(a.numel());
        head.copy_from_slice(a.data());
        tail.copy_from_slice(b.data());
        out
    }

    /// The inverse of [`Tensor::cat_rows`]: the first `rows` rows and the rest.
    pub fn split_rows(&self, rows: usize) -> (Tensor, Tensor) {
        let w = self.shape[1..].iter().product::<usize>();
        let (head, tail) = self.data().split_at(rows * w);
        let mut first = self.shape.clone();
        first[0] = rows;
        let mut second = self.shape.clone();
        second[0] -= rows;
        let mut a = Tensor::for_overwrite(&first);
        a.data_mut().copy_from_slice(head);
        let mut b = Tensor::for_overwrite(&second);
        b.data_mut().copy_from_slice(tail);
        (a, b)
    }

    /// Casts to another storage type (round-to-nearest-even into half types).
    pub fn to_dtype(&self, dtype: DType) -> Tensor {
        if self.dtype() == dtype {
            return self.clone();
        }
        if dtype == DType::F32 {
            // Widening into a pooled buffer: its drop returns it to the pool, so buffers made
            // outside the pool would make the pool grow every step.
            let mut t = Tensor::for_overwrite(&self.shape);
            match &self.storage {
                Storage::BF16(v) => {
                    crate::cpu::cast::bf16_to_f32_parallel(t.data_mut(), v.as_slice())
                }
                Storage::F16(v) => crate::cpu::cast::f16_to_f32(t.data_mut(), v),
                Storage::F32(_) => unreachable!("same dtype returned above"),
            }
            return t;
        }
        // Narrowing straight from f32 (saved activations), or through f32 between half types.
        let widened;
        let src = match &self.storage {
            Storage::F32(v) => v.as_slice(),
            _ => {
                widened = self.to_dtype(DType::F32);
                widened.data()
            }
        };
        let storage = match dtype {
            DType::BF16 => {
                let mut out = pool::Bf16Buf::take_any(src.len());
                crate::cpu::cast::f32_to_bf16_parallel(out.as_mut_slice(), src);
                Storage::BF16(out)
            }
            DType::F16 => {
                let mut out = vec![f16::ZERO; src.len()];
                crate::cpu::cast::f32_to_f16(&mut out, src);
                Storage::F16(out)
            }
            DType::F32 => unreachable!("handled above"),
        };
        Tensor {
            shape: self.shape.clone(),
            storage,
            device: self.device,
        }
    }
}

impl Clone for Tensor {
    fn clone(&self) -> Tensor {
        let storage = match &self.storage {
            Storage::F32(v) => {
                let mut n = pool::take_zeroed(v.len());
                n.copy_from_slice(v);
                Storage::F32(n)
            }
            Storage::BF16(v) => Storage::BF16(v.clone()),
            Storage::F16(v) => Storage::F16(v.clone()),
        };
        Tensor {
            shape: self.shape.clone(),
            storage,
            device: self.device,
        }
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        if let Storage::F32(v) = &mut self.storage {
            pool::give_back(std::mem::take(v));
        }
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({:?}, {})", self.shape, self.dtype())
    }
}
