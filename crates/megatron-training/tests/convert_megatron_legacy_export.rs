//! `convert --to torch` against Megatron-LM's own legacy files: each legacy run of the fixtures
//! (written by Megatron-LM's `save_checkpoint`, `bench/make_megatron_optim_fixtures.py` and
//! `bench/make_megatron_dist_fixtures.py`) read in and written out at the layout that saved it
//! must give back its files: every rank's state-dict keys in Megatron-LM's order, the same
//! shards, and the non-distributed optimizer's groups, parameter indices, moments, steps and
//! fp32 main copies. (That Megatron-LM continues such exports at other layouts with its own
//! losses is checked outside CI: `bench/megatron_legacy_export_check.py`.)

mod common;

use common::megatron_resume::{all_tensors, convert, fixture};
use common::tmpdir;
use megatron_training::convert::pickle::PyValue;
use megatron_training::convert::torch_save::TorchArchive;
use megatron_training::convert::{megatron_to_torch, torch_to_megatron, LegacyLayout, LegacyState};
use std::path::{Path, PathBuf};

fn weights_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/megatron")
        .join(name)
}

fn layout(tp: usize, pp: usize, vp: Option<usize>, ep: usize) -> LegacyLayout {
    LegacyLayout {
        tp,
        pp,
        layers_per_virtual_stage: vp,
        ep,
    }
}

/// The one iteration (or release) directory under a save directory.
fn iteration_dir(save: &Path) -> PathBuf {
    std::fs::read_dir(save)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_dir())
        .unwrap()
}

/// The rank directories of an iteration directory, by name.
fn rank_dirs(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("mp_rank_"))
        .collect();
    v.sort();
    v
}

fn entries(v: &PyValue) -> &[(PyValue, PyValue)] {
    match v {
        PyValue::Dict(e) => e,
        PyValue::Object { entries, .. } => entries,
        other => panic!("not a dict: {other:?}"),
    }
}

/// A tensor's values rounded as Megatron-LM stored them (`bf16`: its bf16 model copy).
fn as_stored(values: &[f32], bf16: bool) -> Vec<f32> {
    if bf16 {
        values
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect()
    } else {
        values.to_vec()
    }
}

/// Asserts that `ours` (an export) holds what Megatron-LM's `theirs` holds, rank file by rank
/// file; `bf16`: Megatron-LM's model copy is bf16 (ours the fp32 main values).
fn assert_same_rank_files(theirs: &Path, ours: &Path, bf16: bool) {
    let names = rank_dirs(theirs);
    assert!(!names.is_empty());
    assert_eq!(rank_dirs(ours), names, "rank directories");
    for rank in names {
        let read = |d: &Path| std::fs::read(d.join(&rank).join("model_optim_rng.pt")).unwrap();
        let (tb, ob) = (read(theirs), read(ours));
        let (t, o) = (
            TorchArchive::read(&tb).unwrap(),
            TorchArchive::read(&ob).unwrap(),
        );
        let chunks: Vec<&str> = entries(&t.object)
            .iter()
            .filter_map(|(k, _)| k.as_str())
            .filter(|k| k.starts_with("model"))
            .collect();
        assert!(!chunks.is_empty());
        for chunk in chunks {
            let (tm, om) = (
                entries(t.object.get(chunk).unwrap()),
                entries(
                    o.object
                        .get(chunk)
                        .unwrap_or_else(|| panic!("{rank}: no {chunk}")),
                ),
            );
            let keys = |m: &[(PyValue, PyValue)]| -> Vec<String> {
                m.iter()
                    .map(|(k, _)| k.as_str().unwrap().to_string())
                    .collect()
            };
            assert_eq!(
                keys(om),
                keys(tm),
                "{rank} {chunk}: the state dict's keys in order"
            );
            for ((name, tv), (_, ov)) in tm.iter().zip(om) {
                if matches!(tv, PyValue::None) {
                    assert!(matches!(ov, PyValue::None), "{rank} {name:?}");
                    continue;
                }
                let (a, b) = (t.tensor(tv).unwrap(), o.tensor(ov).unwrap());
                assert_eq!(b.shape, a.shape, "{rank} {name:?}");
                assert_eq!(as_stored(&b.values, bf16), a.values, "{rank} {name:?}");
            }
        }
        let (Some(topt), Some(oopt)) = (t.object.get("optimizer"), o.object.get("optimizer"))
        else {
            assert!(t.object.get("optimizer").is_none() == o.object.get("optimizer").is_none());
            continue;
        };
        let list = |v: &PyValue| -> Vec<PyValue> {
            match v {
                PyValue::List(l) => l.clone(),
                one => vec![one.clone()],
            }
        };
        let (tl, ol) = (list(topt), list(oopt));
        assert_eq!(ol.len(), tl.len(), "{rank}: chained optimizers");
        for (tx, ox) in tl.iter().zip(&ol) {
            let mixed = tx.get("fp32_from_fp16_params").is_some();
            let inner = |x: &PyValue| {
                if mixed {
                    x.get("optimizer").unwrap().clone()
                } else {
                    x.clone()
                }
            };
            let (ti, oi) = (inner(tx), inner(ox));
            let groups = |x: &PyValue| -> Vec<(String, Vec<usize>)> {
                x.get("param_groups")
                    .unwrap()
                    .as_seq()
                    .unwrap()
                    .iter()
                    .map(|g| {
                        (
                            format!(
                                "wd_mult {:?} experts {:?}",
                                g.get("wd_mult").unwrap(),
                                g.get("is_expert_parallel").unwrap()
                            ),
                            g.get("params").unwrap().as_usizes().unwrap(),
                        )
                    })
                    .collect()
            };
            assert_eq!(groups(&oi), groups(&ti), "{rank}: parameter groups");
            let (ts, os) = (ti.get("state").unwrap(), oi.get("state").unwrap());
            assert_eq!(
                entries(os).len(),
                entries(ts).len(),
                "{rank}: state entries"
            );
            for (id, st) in entries(ts) {
                let (_, ost) = entries(os)
                    .iter()
                    .find(|(k, _)| k.as_int() == id.as_int())
                    .unwrap_or_else(|| panic!("{rank}: no state for index {id:?}"));
                for k in ["exp_avg", "exp_avg_sq", "step"] {
                    let a = t.tensor(st.get(k).unwrap()).unwrap();
                    let b = o.tensor(ost.get(k).unwrap()).unwrap();
                    assert_eq!(
                        (b.shape, b.values),
                        (a.shape, a.values),
                        "{rank} {id:?} {k}"
                    );
                }
            }
            if mixed {
                let mains = |x: &PyValue, a: &TorchArchive| -> Vec<Vec<f32>> {
                    x.get("fp32_from_fp16_params")
                        .unwrap()
                        .as_seq()
                        .unwrap()
                        .iter()
                        .flat_map(|g| g.as_seq().unwrap().iter())
                        .map(|v| a.tensor(v).unwrap().values)
                        .collect()
                };
                assert_eq!(mains(ox, &o), mains(tx, &t), "{rank}: fp32 main copies");
            }
        }
    }
}

/// Megatron-LM's legacy run `theirs` (a save directory) read in and exported at `layout`.
fn exported_again(theirs: &Path, layout: LegacyLayout, test: &str) -> PathBuf {
    let dir = tmpdir(test);
    let (ours, export) = (dir.join("ours"), dir.join("export"));
    torch_to_megatron(theirs, &ours).unwrap();
    megatron_to_torch(&ours, &export, layout, LegacyState::IfSaved).unwrap()
}

#[test]
fn a_legacy_run_exported_at_its_own_layout_gives_back_megatron_lms_files() {
    // Its optimizer state: fp32 with the tied output layer's copy on the last of two stages,
    // bf16 at TP 2 (the fp32 main copies by group), experts in the dense groups at EP 1.
    for (name, l, bf16) in [
        ("legacy_gpt_pp2", layout(1, 2, None, 1), false),
        ("legacy_gpt_bf16_tp2", layout(2, 1, None, 1), true),
        ("legacy_mixtral_adam", layout(1, 1, None, 1), false),
    ] {
        let theirs = iteration_dir(&fixture(name));
        let ours = exported_again(&fixture(name), l, &format!("legacy-export-{name}"));
        assert_eq!(ours.file_name(), theirs.file_name(), "{name}");
        assert_same_rank_files(&theirs, &ours, bf16);
    }
}

#[test]
fn legacy_weights_at_interleaved_expert_and_latent_layouts_come_back_as_megatron_lm_saved_them() {
    // Weights alone (a release directory): interleaved stages (`model0`, `model1`), each expert
    // rank's own experts renumbered from 0 beside TP 2, and MLA's row-split down projections
    // with an MTP depth (`mtp_model_layer`) at TP 2.
    for (name, l) in [
        ("legacy_llama_tp2_pp2_vp2", layout(2, 2, Some(1), 1)),
        ("legacy_mixtral_tp2_ep2", layout(2, 1, None, 2)),
        ("legacy_mla_mtp_tp2", layout(2, 1, None, 1)),
    ] {
        let ours = exported_again(&weights_fixture(name), l, &format!("legacy-export-{name}"));
        assert_eq!(ours.file_name().unwrap(), "release", "{name}");
        assert_same_rank_files(&iteration_dir(&weights_fixture(name)), &ours, false);
    }
}

#[test]
fn a_run_exported_at_another_layout_reads_back_as_the_same_run() {
    // A torch_dist run saved at one rank, laid out at TP 2 x PP 2 and at EP 2 (chained
    // expert optimizer), read back: the same weights, moments and main parameters.
    for (name, l) in [
        ("gpt_adam", layout(2, 2, None, 1)),
        ("mixtral_adam", layout(1, 1, None, 2)),
    ] {
        let dir = tmpdir(&format!("legacy-export-relayout-{name}"));
        let (ours, export, back) = (dir.join("ours"), dir.join("export"), dir.join("back"));
        convert(&fixture(name), &ours).unwrap();
        megatron_to_torch(&ours, &export, l, LegacyState::IfSaved).unwrap();
        torch_to_megatron(&export, &back).unwrap();
        let (a, b) = (all_tensors(&ours), all_tensors(&back));
        assert!(
            a.keys().any(|k| k.starts_with("optimizer.exp_avg.")),
            "{name}"
        );
        assert_eq!(a, b, "{name}");
    }
}

#[test]
fn a_legacy_export_refuses_a_layout_the_model_cannot_take_naming_the_flag() {
    let dir = tmpdir("legacy-export-refusals");
    let (gpt, moe, mtp) = (dir.join("gpt"), dir.join("moe"), dir.join("llama_mtp"));
    convert(&fixture("gpt_adam"), &gpt).unwrap();
    convert(&fixture("mixtral_adam"), &moe).unwrap();
    convert(&fixture("llama_mtp"), &mtp).unwrap();
    let refused = |src: &Path, l: LegacyLayout, out: &str| {
        megatron_to_torch(src, &dir.join(out), l, LegacyState::IfSaved)
            .unwrap_err()
            .to_string()
    };
    // 4 heads over 3 ranks.
    let e = refused(&gpt, layout(3, 1, None, 1), "tp3");
    assert!(
        e.contains("4 attention heads") && e.contains("--tensor-model-parallel-size 3"),
        "{e}"
    );
    let e = refused(&gpt, layout(1, 3, None, 1), "pp3");
    assert!(e.contains("--pipeline-model-parallel-size 3"), "{e}");
    let e = refused(&gpt, layout(1, 1, Some(1), 1), "vp");
    assert!(e.contains("--num-layers-per-virtual-pipeline-stage"), "{e}");
    let e = refused(&gpt, layout(1, 1, None, 2), "ep");
    assert!(e.contains("--expert-model-parallel-size 2"), "{e}");
    let e = refused(&moe, layout(1, 1, None, 3), "ep3");
    assert!(e.contains("4 experts") && e.contains("3"), "{e}");
    let e = refused(&mtp, layout(1, 2, None, 1), "mtp_pp2");
    assert!(e.contains("multi-token prediction"), "{e}");
    // Nothing half-written is left behind by a refusal.
    assert!(!dir.join("tp3").exists() && !dir.join("mtp_pp2").exists());
    // An existing export is not overwritten.
    megatron_to_torch(
        &gpt,
        &dir.join("once"),
        layout(1, 1, None, 1),
        LegacyState::IfSaved,
    )
    .unwrap();
    let e = refused(&gpt, layout(1, 1, None, 1), "once");
    assert!(e.contains("already exists"), "{e}");
}

#[test]
fn a_weights_only_legacy_export_is_a_release_megatron_lm_starts_from() {
    let dir = tmpdir("legacy-export-release");
    let (ours, export) = (dir.join("ours"), dir.join("export"));
    convert(&fixture("gpt_adam"), &ours).unwrap();
    let release = megatron_to_torch(
        &ours,
        &export,
        layout(2, 1, None, 1),
        LegacyState::WeightsOnly,
    )
    .unwrap();
    assert_eq!(release.file_name().unwrap(), "release");
    assert_eq!(
        std::fs::read_to_string(export.join("latest_checkpointed_iteration.txt")).unwrap(),
        "release"
    );
    for rank in rank_dirs(&release) {
        let bytes = std::fs::read(release.join(&rank).join("model_optim_rng.pt")).unwrap();
        let a = TorchArchive::read(&bytes).unwrap();
        assert!(a.object.get("optimizer").is_none(), "{rank}");
        let args = a.object.get("args").unwrap();
        assert_eq!(
            args.attr("tensor_model_parallel_size").unwrap().as_int(),
            Some(2)
        );
        assert_eq!(args.attr("ckpt_format").unwrap().as_str(), Some("torch"));
    }
}
