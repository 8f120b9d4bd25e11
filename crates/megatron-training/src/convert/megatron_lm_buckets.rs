//! The distributed optimizer's default checkpoint form, `dp_reshardable`: per tensor- and
//! pipeline-parallel domain (`optimizer.distributed.dp_group_idx_K`), each gradient bucket's
//! main parameters, `exp_avg` and `exp_avg_sq` as flat tensors, stored one chunk per parameter
//! (or padding) of the domain's local shards, in Megatron's bucket order.
//!
//! Which parameter a chunk holds is not written down: it is Megatron's bucketing of that model
//! (parameters in reverse registration order, 64-element starts, shared embeddings apart), which
//! depends on the module tree of its spec and changes between Megatron-LM versions. So chunks
//! are matched by value instead: a chunk's main parameters are the weights of exactly one local
//! shard (equal for an fp32 run; rounding to them for a bf16 one). That needs no knowledge of
//! the order, works for any spec, TP and PP, and checks itself: every local shard must be found
//! exactly once. Shards whose values coincide (a bf16 run's norms, still near 1) are told
//! apart by elimination, and then by Megatron's reverse order.

use super::megatron_lm::{TensorKind, WantedTensor};
use super::megatron_lm_state::insert_moments;
use super::pickle::PyValue;
use super::torch_dist::TorchDistCheckpoint;
use super::torch_save::TorchArchive;
use super::tp_shards::{place_piece, shard_of};
use super::Tensors;
use std::collections::{HashMap, HashSet};

/// How a run's weights follow from its fp32 main parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WeightsOf {
    /// An fp32 run: the weights are the main parameters.
    Fp32,
    /// A bf16 run: the weights are the main parameters rounded to bf16.
    Bf16,
    /// An fp16 run: rounded to fp16.
    Fp16,
}

impl WeightsOf {
    /// The precision of the weights of a run saved with arguments `args`.
    pub(crate) fn of_args(args: &PyValue) -> WeightsOf {
        let set = |k: &str| matches!(args.attr(k), Some(PyValue::Bool(true)));
        if set("bf16") {
            WeightsOf::Bf16
        } else if set("fp16") {
            WeightsOf::Fp16
        } else {
            WeightsOf::Fp32
        }
    }

    /// The weight a main parameter `m` is kept as.
    pub(crate) fn weight(self, m: f32) -> f32 {
        match self {
            WeightsOf::Fp32 => m,
            WeightsOf::Bf16 => half::bf16::from_f32(m).to_f32(),
            WeightsOf::Fp16 => half::f16::from_f32(m).to_f32(),
        }
    }

    pub(crate) fn matches(self, main: &[f32], weights: &[f32]) -> bool {
        main.len() == weights.len()
            && main
                .iter()
                .zip(weights)
                .all(|(&m, &w)| self.weight(m).to_bits() == w.to_bits())
    }
}

/// One class of interchangeable local shards: parameter `param`'s shard on the ranks in
/// `ranks` (several where the parameter is the same on every tensor-parallel rank).
struct Class<'a> {
    param: usize,
    ranks: Vec<usize>,
    /// The shard's weights (borrowed where it is the whole tensor).
    values: std::borrow::Cow<'a, [f32]>,
}

/// The model's parameters among `wanted`, and their local shards at tensor-parallel size
/// `tp`, grouped where they are equal.
fn classes_of<'a, 'w>(
    wanted: &'w [WantedTensor],
    weights: &'a Tensors,
    tp: usize,
) -> Result<(Vec<&'w WantedTensor>, Vec<Class<'a>>), String> {
    let params: Vec<&WantedTensor> = wanted
        .iter()
        .filter(|w| w.kind == TensorKind::Parameter)
        .collect();
    let mut classes: Vec<Class> = Vec::new();
    for (i, w) in params.iter().enumerate() {
        let (_, global) = weights
            .get(&w.name)
            .ok_or_else(|| format!("no weights for {}", w.name))?;
        for r in 0..tp {
            let values: std::borrow::Cow<[f32]> = match w.split {
                Some(s) if tp > 1 => shard_of(global, &w.shape, s, tp, r).into(),
                _ => global.as_slice().into(),
            };
            match classes
                .iter_mut()
                .find(|c| c.param == i && c.values == values)
            {
                Some(c) => c.ranks.push(r),
                None => classes.push(Class {
                    param: i,
                    ranks: vec![r],
                    values,
                }),
            }
        }
    }
    Ok((params, classes))
}

/// One parameter's state found in gathered buffers: `[exp_avg, exp_avg_sq, main]`.
pub(crate) type FoundState = [Vec<f32>; 3];

/// Finds parameters in a state of gathered buffers (Megatron's `get_parameter_state_dp_zero`:
/// `distrib_optim.pt` of the legacy format, the `param_state` objects of torch_dist's
/// `dp_zero_gather_scatter` form): per gradient buffer and dtype, the main parameters,
/// `exp_avg` and `exp_avg_sq` as flat tensors over every data-parallel rank, parameters at
/// offsets the file does not record (bucket order, 64-element starts, padding between).
///
/// Candidate `c` is parameter `candidates[c].0` with weights `candidates[c].1`; it is found
/// where the main parameters at an offset are its weights (`weights_of`), and `found[c]` gets
/// its state once. One state holds a parameter once: where several candidates fit (equal
/// weights), the later parameter not yet found in this state, as Megatron lays parameters out
/// in reverse.
pub(crate) fn find_in_gathered_buffers(
    state: &PyValue,
    archive: &TorchArchive,
    candidates: &[(usize, &[f32])],
    weights_of: WeightsOf,
    found: &mut [Option<FoundState>],
) -> Result<(), String> {
    if !matches!(state.get("buckets_coalesced"), Some(PyValue::Bool(true))) {
        return Err(
            "gathered buffers without buckets_coalesced (an older Megatron-LM's per-bucket layout), which are not read"
                .into(),
        );
    }
    let PyValue::Dict(buffers) = state else {
        return Err("the gathered state is not a dict of buffers".into());
    };
    let mut by_first: HashMap<u32, Vec<usize>> = HashMap::new();
    for (c, (_, w)) in candidates.iter().enumerate() {
        if let Some(v) = w.first() {
            by_first.entry(v.to_bits()).or_default().push(c);
        }
    }
    let mut here: HashSet<usize> = HashSet::new(); // parameters found in this state
    for (_, per_dtype) in buffers.iter().filter(|(k, _)| matches!(k, PyValue::Int(_))) {
        let PyValue::Dict(per_dtype) = per_dtype else {
            return Err("a gradient buffer's state is not a dict by dtype".into());
        };
        for (_, flat) in per_dtype {
            let read = |k: &str| -> Result<Vec<f32>, String> {
                let v = flat.get(k).ok_or_else(|| format!("a buffer without {k}"))?;
                Ok(archive.tensor(v)?.values)
            };
            let [exp_avg, exp_avg_sq, main] =
                [read("exp_avg")?, read("exp_avg_sq")?, read("param")?];
            if exp_avg.len() != main.len() || exp_avg_sq.len() != main.len() {
                return Err("a buffer whose param, exp_avg and exp_avg_sq differ in length".into());
            }
            let mut pos = 0;
            while pos < main.len() {
                let key = weights_of.weight(main[pos]).to_bits();
                let fits = |&c: &usize| {
                    let (param, w) = candidates[c];
                    found[c].is_none()
                        && !here.contains(&param)
                        && pos + w.len() <= main.len()
                        && weights_of.matches(&main[pos..pos + w.len()], w)
                };
                let Some(c) = by_first.get(&key).and_then(|cs| {
                    cs.iter()
                        .copied()
                        .filter(fits)
                        .max_by_key(|&c| candidates[c].0)
                }) else {
                    pos += 1; // padding
                    continue;
                };
                let r = pos..pos + candidates[c].1.len();
                found[c] = Some([
                    exp_avg[r.clone()].to_vec(),
                    exp_avg_sq[r.clone()].to_vec(),
                    main[r.clone()].to_vec(),
                ]);
                here.insert(candidates[c].0);
                pos = r.end;
            }
        }
    }
    Ok(())
}

/// The distributed optimizer's `dp_zero_gather_scatter` form (megatron-core 0.7-0.12 with
/// parallel save off): per tensor- and pipeline-parallel domain, one `param_state` object of
/// buffers gathered to data-parallel rank 0 (chained optimizers prefix theirs `chained_N.`).
/// Which domain is which rank is not written down either; every local shard is looked for in
/// every domain, and each must be found.
pub(crate) fn read_gathered_state(
    ck: &TorchDistCheckpoint,
    wanted: &[WantedTensor],
    weights: &Tensors,
    tp: usize,
    weights_of: WeightsOf,
) -> Result<(Tensors, Tensors), String> {
    let (params, classes) = classes_of(wanted, weights, tp)?;
    let candidates: Vec<(usize, &[f32])> =
        classes.iter().map(|c| (c.param, &c.values[..])).collect();
    let mut found: Vec<Option<FoundState>> = vec![None; classes.len()];
    let keys: Vec<&String> = ck
        .keys()
        .filter(|k| k.contains("optimizer.distributed.") && k.contains(".param_state/"))
        .collect();
    if keys.is_empty() {
        return Err("no optimizer.distributed.*.param_state objects".into());
    }
    for key in keys {
        let archive = ck.archive(key)?;
        let state = match &archive.object {
            PyValue::List(one) if one.len() == 1 => &one[0],
            other => other,
        };
        find_in_gathered_buffers(state, &archive, &candidates, weights_of, &mut found)
            .map_err(|e| format!("{key}: {e}"))?;
    }
    if let Some(c) = found.iter().position(|f| f.is_none()) {
        return Err(format!(
            "no gathered buffer holds {} (tensor-parallel rank {}): the buffers are not this model's",
            params[classes[c].param].name, classes[c].ranks[0]
        ));
    }
    Ok(assemble_state(&params, &classes, tp, |c, _| {
        let [m, v, main] = found[c].as_ref().expect("every class found");
        [m.as_slice(), v.as_slice(), main.as_slice()]
    }))
}

/// Each parameter's moments and main parameters put together from its classes' pieces:
/// `piece(c, j)` is `[exp_avg, exp_avg_sq, main]` of class `c` on its `j`-th rank.
fn assemble_state<'s>(
    params: &[&WantedTensor],
    classes: &[Class],
    tp: usize,
    piece: impl Fn(usize, usize) -> [&'s [f32]; 3],
) -> (Tensors, Tensors) {
    let mut optimizer = Tensors::new();
    let mut main_params = Tensors::new();
    for (i, w) in params.iter().enumerate() {
        let numel: usize = w.shape.iter().product();
        let mut out = [
            vec![0.0f32; numel],
            vec![0.0f32; numel],
            vec![0.0f32; numel],
        ];
        for (c, class) in classes.iter().enumerate().filter(|(_, c)| c.param == i) {
            for (j, &r) in class.ranks.iter().enumerate() {
                // The same on every rank (no split): any one of them.
                for (o, src) in out.iter_mut().zip(piece(c, j)) {
                    place_piece(o, &w.shape, w.split, (tp, r), src);
                }
            }
        }
        let [m, v, main] = out;
        insert_moments(&mut optimizer, w, m, v);
        main_params.insert(w.name.clone(), (w.shape.clone(), main));
    }
    (optimizer, main_params)
}

/// The bucket form's main parameters and moments, by this engine's names (`optimizer.<moment>.
/// <name>` and the parameter names), for the model's tensors `wanted` whose weights are
/// `weights`, saved at tensor-parallel size `tp`.
pub(crate) fn read_bucket_state(
    ck: &TorchDistCheckpoint,
    wanted: &[WantedTensor],
    weights: &Tensors,
    tp: usize,
    weights_of: WeightsOf,
) -> Result<(Tensors, Tensors), String> {
    let (params, classes) = classes_of(wanted, weights, tp)?;
    // Every bucket chunk and the classes its main parameters fit.
    let buckets: Vec<String> = ck
        .sizes
        .keys()
        // Chained optimizers (experts apart) prefix theirs `chained_N.`.
        .filter(|k| k.contains("optimizer.distributed.") && k.ends_with(".param"))
        .cloned()
        .collect();
    if buckets.is_empty() {
        return Err("no optimizer.distributed.*.param buckets".into());
    }
    struct Chunk {
        bucket: usize,
        start: usize,
        len: usize,
        fits: Vec<usize>,
    }
    let mut data = Vec::new();
    let mut chunks = Vec::new();
    for (b, key) in buckets.iter().enumerate() {
        let n = ck.sizes[key][0];
        let stem = key.strip_suffix(".param").expect("a .param key");
        let read = |k: &str| ck.region(k, &[0], &[n]);
        let main = read(key)?;
        data.push([
            read(&format!("{stem}.exp_avg"))?,
            read(&format!("{stem}.exp_avg_sq"))?,
            main,
        ]);
        for (off, ext) in ck.chunks(key) {
            let (start, len) = (off[0], ext[0]);
            let main = &data[b][2][start..start + len];
            let fits: Vec<usize> = (0..classes.len())
                .filter(|&c| weights_of.matches(main, &classes[c].values))
                .collect();
            chunks.push(Chunk {
                bucket: b,
                start,
                len,
                fits,
            });
        }
    }
    // Each class takes as many chunks as it has ranks: first the chunks only one class fits
    // (repeatedly, as taking them settles others), then the rest in Megatron's order (a later
    // parameter first in each bucket).
    let mut left: Vec<usize> = classes.iter().map(|c| c.ranks.len()).collect();
    let mut taken: Vec<Option<usize>> = vec![None; chunks.len()];
    loop {
        let mut progress = false;
        for (i, ch) in chunks.iter().enumerate() {
            if taken[i].is_some() {
                continue;
            }
            let open: Vec<usize> = ch.fits.iter().copied().filter(|&c| left[c] > 0).collect();
            if let [c] = open[..] {
                taken[i] = Some(c);
                left[c] -= 1;
                progress = true;
            }
        }
        if !progress {
            break;
        }
    }
    for (i, ch) in chunks.iter().enumerate() {
        if taken[i].is_some() {
            continue;
        }
        if let Some(&c) = ch
            .fits
            .iter()
            .filter(|&&c| left[c] > 0)
            .max_by_key(|&&c| classes[c].param)
        {
            taken[i] = Some(c);
            left[c] -= 1;
        }
    }
    if let Some(c) = left.iter().position(|&n| n > 0) {
        return Err(format!(
            "no bucket chunk holds {} (tensor-parallel rank {}): the buckets are not this model's",
            params[classes[c].param].name, classes[c].ranks[0]
        ));
    }
    if let Some(ch) = chunks
        .iter()
        .zip(&taken)
        .find(|(ch, t)| t.is_none() && ch.len >= 64)
    {
        // Padding between parameters is shorter than their 64-element alignment.
        return Err(format!(
            "{} holds {} elements at {} that are no parameter of the model",
            buckets[ch.0.bucket], ch.0.len, ch.0.start
        ));
    }
    // Each class's chunks, in the order its ranks were listed.
    let mut found: Vec<Vec<usize>> = vec![Vec::new(); classes.len()];
    for (i, t) in taken.iter().enumerate() {
        if let Some(c) = t {
            found[*c].push(i);
        }
    }
    Ok(assemble_state(&params, &classes, tp, |c, j| {
        let ch = &chunks[found[c][j]];
        data[ch.bucket]
            .each_ref()
            .map(|src| &src[ch.start..ch.start + ch.len])
    }))
}
