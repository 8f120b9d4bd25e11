//! Parameters and gradients, each one contiguous f32 buffer.
//!
//! One buffer per dtype is what the optimizer, the gradient norm and (later) the data-parallel
//! collectives want to see as a single slice. Each parameter is a named range with the metadata
//! of DESIGN.md section 5; checkpointing and the optimizer read that metadata, nothing guesses it.

use megatron_tensor::RngKey;
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ParamId(pub usize);

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ParamMeta {
    /// Megatron-core global name, e.g. `decoder.layers.3.self_attention.linear_qkv.weight`.
    pub name: String,
    /// Global (unsharded) shape.
    pub shape: Vec<usize>,
    pub offset: usize,
    pub numel: usize,
    pub weight_decay: bool,
    /// Dimension split across tensor-parallel ranks, if any (none until tensor parallelism).
    pub tp_split_dim: Option<usize>,
    /// Same on every tensor-parallel rank (counted once in the gradient norm).
    pub tp_replicated: bool,
}

/// How a parameter starts out.
#[derive(Clone, Copy, Debug)]
pub enum Init {
    Normal(f32),
    Const(f32),
}

#[derive(Clone, Debug, Default)]
pub struct Params {
    pub data: Vec<f32>,
    pub metas: Vec<ParamMeta>,
}

impl Params {
    /// Registers a parameter; values are drawn when [`Params::initialize`] runs.
    pub fn register(&mut self, name: String, shape: &[usize], weight_decay: bool) -> ParamId {
        let numel = shape.iter().product();
        let offset = self.metas.last().map_or(0, |m| m.offset + m.numel);
        self.metas.push(ParamMeta {
            name,
            shape: shape.to_vec(),
            offset,
            numel,
            weight_decay,
            tp_split_dim: None,
            tp_replicated: true,
        });
        ParamId(self.metas.len() - 1)
    }

    /// Registers a parameter and records how it starts out.
    pub fn add(
        &mut self,
        inits: &mut Vec<Init>,
        name: String,
        shape: &[usize],
        weight_decay: bool,
        init: Init,
    ) -> ParamId {
        inits.push(init);
        self.register(name, shape, weight_decay)
    }

    pub fn numel(&self) -> usize {
        self.metas.last().map_or(0, |m| m.offset + m.numel)
    }

    /// Draws every parameter from a stream keyed by its global name, so that values do not
    /// depend on registration order or (later) on how parameters are sharded.
    pub fn initialize(&mut self, seed: u64, inits: &[Init]) {
        assert_eq!(inits.len(), self.metas.len());
        self.data = vec![0.0; self.numel()];
        let base = RngKey::new(seed).fold(0x1417);
        for (m, init) in self.metas.iter().zip(inits) {
            let dst = &mut self.data[m.offset..m.offset + m.numel];
            match *init {
                Init::Const(c) => dst.fill(c),
                Init::Normal(std) => {
                    let key = base.fold(name_hash(&m.name));
                    for (i, v) in dst.iter_mut().enumerate() {
                        *v = key.normal(i as u64) * std;
                    }
                }
            }
        }
    }

    pub fn get(&self, id: ParamId) -> &[f32] {
        let m = &self.metas[id.0];
        &self.data[m.offset..m.offset + m.numel]
    }

    pub fn get_mut(&mut self, id: ParamId) -> &mut [f32] {
        let m = &self.metas[id.0];
        &mut self.data[m.offset..m.offset + m.numel]
    }

    pub fn find(&self, name: &str) -> Option<ParamId> {
        self.metas.iter().position(|m| m.name == name).map(ParamId)
    }
}

/// FNV-1a: a stable hash of a parameter name for its RNG stream.
pub fn name_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Gradients, laid out exactly like [`Params`].
#[derive(Clone, Debug)]
pub struct Grads {
    pub data: Vec<f32>,
    ranges: Vec<(usize, usize)>,
}

impl Grads {
    pub fn zeros_like(p: &Params) -> Grads {
        Grads {
            data: vec![0.0; p.numel()],
            ranges: p.metas.iter().map(|m| (m.offset, m.numel)).collect(),
        }
    }

    pub fn zero(&mut self) {
        self.data.fill(0.0);
    }

    pub fn get(&self, id: ParamId) -> &[f32] {
        let (o, n) = self.ranges[id.0];
        &self.data[o..o + n]
    }

    pub fn get_mut(&mut self, id: ParamId) -> &mut [f32] {
        let (o, n) = self.ranges[id.0];
        &mut self.data[o..o + n]
    }

    /// Disjoint mutable views of several parameters' gradients at once.
    pub fn many_mut<const N: usize>(&mut self, ids: [ParamId; N]) -> [&mut [f32]; N] {
        for i in 0..N {
            for j in i + 1..N {
                assert_ne!(ids[i], ids[j], "many_mut: the same parameter twice");
            }
        }
        let base = self.data.as_mut_ptr();
        let len = self.data.len();
        ids.map(|id| {
            let (o, n) = self.ranges[id.0];
            assert!(o + n <= len);
            // SAFETY: parameter ranges never overlap and the ids are distinct (checked above).
            unsafe { std::slice::from_raw_parts_mut(base.add(o), n) }
        })
    }
}
