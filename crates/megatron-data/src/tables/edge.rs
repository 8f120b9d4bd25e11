//! What flows along the graph's edges: each node is a small vector (TabPFN v2 uses vectors per
//! node so one cause can influence several features), and a node's vector is the sum of
//! random functions of its parents' vectors plus Gaussian noise. The functions are the families
//! TabPFN v2's prior lists: small neural networks with activations drawn from a varied set,
//! decision trees, and discretisation to the nearest of a few prototypes (which makes
//! categorical features).

use super::stream::Stream;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Identity,
    Tanh,
    Relu,
    LeakyRelu,
    Sigmoid,
    Sin,
    Abs,
    Square,
    SoftPlus,
    Step,
    Gaussian,
}

const ACTIVATIONS: [Activation; 11] = [
    Activation::Identity,
    Activation::Tanh,
    Activation::Relu,
    Activation::LeakyRelu,
    Activation::Sigmoid,
    Activation::Sin,
    Activation::Abs,
    Activation::Square,
    Activation::SoftPlus,
    Activation::Step,
    Activation::Gaussian,
];

impl Activation {
    fn apply(self, x: f64) -> f64 {
        match self {
            Activation::Identity => x,
            Activation::Tanh => x.tanh(),
            Activation::Relu => x.max(0.0),
            Activation::LeakyRelu => {
                if x > 0.0 {
                    x
                } else {
                    0.1 * x
                }
            }
            Activation::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            Activation::Sin => x.sin(),
            Activation::Abs => x.abs(),
            Activation::Square => (x * x).min(1e3),
            Activation::SoftPlus => {
                if x > 30.0 {
                    x
                } else {
                    x.exp().ln_1p()
                }
            }
            Activation::Step => f64::from(u8::from(x > 0.0)),
            Activation::Gaussian => (-x * x).exp(),
        }
    }
}

/// One edge's function from a parent's vector (width `d_in`) to a contribution to the child's
/// vector (width `d_out`).
pub enum EdgeFunction {
    /// `W2 act(W1 x + b1)`.
    Mlp {
        w1: Vec<f64>,
        b1: Vec<f64>,
        w2: Vec<f64>,
        hidden: usize,
        act: Activation,
    },
    /// A full binary tree of `depth` splits on single input dimensions; leaves hold vectors.
    Tree {
        depth: usize,
        dims: Vec<usize>,
        thresholds: Vec<f64>,
        leaves: Vec<f64>,
    },
    /// The nearest of `k` prototypes in input space selects one of `k` output vectors.
    Discretize {
        prototypes: Vec<f64>,
        outputs: Vec<f64>,
        k: usize,
    },
}

impl EdgeFunction {
    /// A random function; `linear_share` is the chance of a linear map (drawn first),
    /// `categorical_share` that of a discretisation.
    pub fn sample(
        rng: &mut Stream,
        d_in: usize,
        d_out: usize,
        linear_share: f64,
        categorical_share: f64,
    ) -> Self {
        if rng.chance(linear_share) {
            return Self::mlp(rng, d_in, d_out, Activation::Identity);
        }
        if rng.chance(categorical_share) {
            let k = rng.int(2, 10);
            let prototypes = (0..k * d_in).map(|_| rng.normal()).collect();
            let outputs = (0..k * d_out).map(|_| rng.normal()).collect();
            return EdgeFunction::Discretize {
                prototypes,
                outputs,
                k,
            };
        }
        if rng.chance(0.25) {
            let depth = rng.int(1, 4);
            let splits = (1 << depth) - 1;
            return EdgeFunction::Tree {
                depth,
                dims: (0..splits).map(|_| rng.below(d_in)).collect(),
                thresholds: (0..splits).map(|_| rng.normal() * 0.7).collect(),
                leaves: (0..(1 << depth) * d_out).map(|_| rng.normal()).collect(),
            };
        }
        let act = ACTIVATIONS[rng.below(ACTIVATIONS.len())];
        Self::mlp(rng, d_in, d_out, act)
    }

    /// `W2 act(W1 x + b1)` with random weights (a linear map of rank up to 8 for `Identity`).
    fn mlp(rng: &mut Stream, d_in: usize, d_out: usize, act: Activation) -> Self {
        let hidden = rng.int(2, 8);
        let s1 = 1.0 / (d_in as f64).sqrt();
        let s2 = rng.range(0.5, 1.5) / (hidden as f64).sqrt();
        EdgeFunction::Mlp {
            w1: (0..hidden * d_in).map(|_| rng.normal() * s1).collect(),
            b1: (0..hidden).map(|_| rng.normal() * 0.5).collect(),
            w2: (0..d_out * hidden).map(|_| rng.normal() * s2).collect(),
            hidden,
            act,
        }
    }

    /// Adds `f(x)` to `out`; returns the category chosen by a discretisation (for the
    /// categorical column it may become).
    pub fn apply_add(&self, out: &mut [f64], x: &[f64]) -> Option<usize> {
        match self {
            EdgeFunction::Mlp {
                w1,
                b1,
                w2,
                hidden,
                act,
            } => {
                let d_in = x.len();
                let mut hbuf = [0.0f64; 8];
                for (j, hj) in hbuf.iter_mut().enumerate().take(*hidden) {
                    let row = &w1[j * d_in..(j + 1) * d_in];
                    let z = row.iter().zip(x).map(|(w, v)| w * v).sum::<f64>() + b1[j];
                    *hj = act.apply(z);
                }
                for (o, wrow) in out.iter_mut().zip(w2.chunks(*hidden)) {
                    *o += wrow.iter().zip(&hbuf).map(|(w, h)| w * h).sum::<f64>();
                }
                None
            }
            EdgeFunction::Tree {
                depth,
                dims,
                thresholds,
                leaves,
            } => {
                let mut node = 0usize;
                for _ in 0..*depth {
                    let right = x[dims[node]] > thresholds[node];
                    node = 2 * node + 1 + usize::from(right);
                }
                let leaf = node + 1 - (1 << depth);
                let d_out = out.len();
                for (o, l) in out
                    .iter_mut()
                    .zip(&leaves[leaf * d_out..(leaf + 1) * d_out])
                {
                    *o += l;
                }
                None
            }
            EdgeFunction::Discretize {
                prototypes,
                outputs,
                k,
            } => {
                let d_in = x.len();
                let best = (0..*k)
                    .map(|c| {
                        let p = &prototypes[c * d_in..(c + 1) * d_in];
                        let d2: f64 = p.iter().zip(x).map(|(a, b)| (a - b) * (a - b)).sum();
                        (c, d2)
                    })
                    .min_by(|a, b| a.1.total_cmp(&b.1))
                    .map_or(0, |(c, _)| c);
                let d_out = out.len();
                for (o, v) in out
                    .iter_mut()
                    .zip(&outputs[best * d_out..(best + 1) * d_out])
                {
                    *o += v;
                }
                Some(best)
            }
        }
    }

    /// Levels of a discretisation (`None` for continuous functions).
    pub fn levels(&self) -> Option<usize> {
        match self {
            EdgeFunction::Discretize { k, .. } => Some(*k),
            _ => None,
        }
    }
}
