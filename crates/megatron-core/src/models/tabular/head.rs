//! The tabular model's prediction head, read off the target column of the query rows: a final
//! LayerNorm, then a linear map to up to `MAX_CLASSES` class logits (classification) or to
//! `BINS` logits over intervals of the standardised target (regression as a binned distribution,
//! as TabPFN does: Hollmann et al. 2023 / 2025), trained with softmax cross-entropy over the
//! classes the table has or over all bins; and the same kind of binned distribution for feature
//! cells hidden from the input (masked-cell reconstruction).

use crate::params::Sharding;
use crate::params::{Grads, Init, ParamId, Params};
use crate::transformer::norm::{LayerNorm, LayerNormSaved};
use megatron_tensor::cpu::table_features::MAX_CLASSES;
use megatron_tensor::cpu::{
    embedding_lookup_backward, embedding_lookup_forward, masked_cross_entropy, matmul_backward,
    matmul_forward,
};
use megatron_tensor::Tensor;

/// Bins of the regression distribution's body, cut at equal-probability quantiles of the
/// prior's targets; tail bins may be added beyond them, so a head's width is its borders + 1.
pub const BINS: usize = 32;

pub struct TabularHead {
    pub norm: LayerNorm,
    pub classes: (ParamId, ParamId),
    pub bins: (ParamId, ParamId),
    /// Masked-cell reconstruction: bins over a feature cell's standardised value.
    pub cells: (ParamId, ParamId),
    emb: usize,
    /// Bins of the regression and reconstruction distributions.
    bin_count: usize,
}

/// Which cells the head predicts and against what, for one task kind.
pub struct HeadRows<'a> {
    /// Cell indices (rows of the model output) of query rows' target cells.
    pub cells: &'a [u32],
    /// Per row: the class index, or the regression bin (see [`bin_of`]).
    pub targets: &'a [u32],
    /// Per row: classes of its table (classification); ignored for regression.
    pub valid: &'a [u32],
    /// Per row: the weight of its loss (e.g. 1 / (query rows of its table x tables)).
    pub weights: &'a [f32],
}

/// The bin of standardised target `z` among `borders` (increasing values).
pub fn bin_of(z: f32, borders: &[f32]) -> u32 {
    borders.partition_point(|&b| b < z) as u32
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Task {
    Classification,
    Regression,
    /// A hidden feature cell's value (imputation; its negative log-likelihood scores anomalies).
    Reconstruction,
}

impl TabularHead {
    /// A head over `bin_count` bins (the borders + 1) for regression and reconstruction.
    pub fn new(
        emb: usize,
        bin_count: usize,
        init_std: f32,
        eps: f32,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let norm = LayerNorm::new(
            "tabular.head.norm",
            emb,
            eps,
            Sharding::Replicated,
            params,
            inits,
        );
        let mut linear = |name: &str, width: usize| {
            (
                params.add(
                    inits,
                    format!("tabular.head.{name}.weight"),
                    &[width, emb],
                    true,
                    Init::Normal(init_std),
                ),
                params.add(
                    inits,
                    format!("tabular.head.{name}.bias"),
                    &[width],
                    false,
                    Init::Const(0.0),
                ),
            )
        };
        let classes = linear("classes", MAX_CLASSES);
        let bins = linear("bins", bin_count);
        let cells = linear("cells", bin_count);
        TabularHead {
            norm,
            classes,
            bins,
            cells,
            emb,
            bin_count,
        }
    }

    /// Bins of the regression and reconstruction distributions.
    pub fn bins(&self) -> usize {
        self.bin_count
    }

    fn linear(&self, task: Task) -> ((ParamId, ParamId), usize) {
        match task {
            Task::Classification => (self.classes, MAX_CLASSES),
            Task::Regression => (self.bins, self.bin_count),
            Task::Reconstruction => (self.cells, self.bin_count),
        }
    }

    /// Logits `[rows, width]` for the cells `cells` of the model output `y`.
    pub fn logits(&self, params: &Params, y: &Tensor, cells: &[u32], task: Task) -> Tensor {
        self.forward(params, y, cells, task).logits
    }

    fn forward(&self, params: &Params, y: &Tensor, cells: &[u32], task: Task) -> HeadForward {
        let n = cells.len();
        let mut x = Tensor::for_overwrite(&[n, self.emb]);
        embedding_lookup_forward(x.data_mut(), cells, y.data(), 0, false);
        let (normed, norm) = self.norm.forward(params, &x);
        let ((w, b), width) = self.linear(task);
        let mut logits = Tensor::for_overwrite(&[n, width]);
        matmul_forward(
            logits.data_mut(),
            normed.data(),
            params.operand(w).operand(),
            Some(&params.get(b)),
            n,
            self.emb,
            width,
        );
        HeadForward {
            x,
            norm,
            normed,
            logits,
        }
    }

    /// The weighted loss of `rows`; with `backward`, parameter gradients accumulate into its
    /// `Grads` and the gradient of the model output into its tensor (`[cells, emb]`).
    pub fn loss(
        &self,
        params: &Params,
        y: &Tensor,
        rows: &HeadRows,
        task: Task,
        backward: Option<(&mut Grads, &mut Tensor)>,
    ) -> f64 {
        let n = rows.cells.len();
        if n == 0 {
            return 0.0;
        }
        let f = self.forward(params, y, rows.cells, task);
        let ((w, b), width) = self.linear(task);
        let valid: Vec<u32> = match task {
            Task::Classification => rows.valid.to_vec(),
            Task::Regression | Task::Reconstruction => vec![self.bin_count as u32; n],
        };
        let mut losses = vec![0.0f32; n];
        let mut dlogits = backward
            .is_some()
            .then(|| Tensor::for_overwrite(&[n, width]));
        masked_cross_entropy(
            &mut losses,
            dlogits.as_mut().map(|d| d.data_mut()),
            f.logits.data(),
            rows.targets,
            &valid,
            rows.weights,
            width,
        );
        let loss = losses
            .iter()
            .zip(rows.weights)
            .map(|(l, w)| *l as f64 * *w as f64)
            .sum();
        if let (Some((grads, dy)), Some(dlogits)) = (backward, dlogits) {
            let mut dnormed = Tensor::for_overwrite(&[n, self.emb]);
            let [dw, db] = grads.many_mut([w, b]);
            matmul_backward(
                Some(dnormed.data_mut()),
                dw,
                Some(db),
                dlogits.data(),
                f.normed.data(),
                params.operand(w).operand(),
                n,
                self.emb,
                width,
            );
            let dx = self.norm.backward(params, grads, &f.norm, &f.x, &dnormed);
            embedding_lookup_backward(dy.data_mut(), dx.data(), rows.cells, 0);
        }
        loss
    }
}

/// What backward needs of the head's forward.
struct HeadForward {
    x: Tensor,
    norm: LayerNormSaved,
    normed: Tensor,
    logits: Tensor,
}
