//! `--pipeline-model-parallel-layout`: Megatron's layout strings parse to the virtual stages its
//! own docstring gives, and layouts that break its rules (or this engine's placement of the
//! embedding, prediction layers and loss) are refused with the reason.

use megatron_core::pipeline_parallel::layer_layout::{LayerKind, PipelineParallelLayerLayout};
use megatron_core::pipeline_parallel::partition::StagePartition;
use LayerKind::{Decoder as T, Embedding as E, Loss as L, Mtp as M};

#[test]
fn megatrons_example_parses_to_its_documented_stages() {
    // megatron/core/transformer/pipeline_parallel_layer_layout.py: "Ettt|(tt|)*29,m|L" is
    // [["E","t","t","t"]] + [["t","t"]]*29 + [["m"],["L"]].
    let l = PipelineParallelLayerLayout::parse("Et*3|(tt|)*29,m|L").unwrap();
    let mut want = vec![vec![E, T, T, T]];
    want.extend(std::iter::repeat_n(vec![T, T], 29));
    want.push(vec![M]);
    want.push(vec![L]);
    assert_eq!(l.stages, want);
    // Its examples of the repetition rules, as stage lists.
    let flat = |s: &str| {
        PipelineParallelLayerLayout::parse(s)
            .unwrap()
            .stages
            .iter()
            .map(|st| st.iter().filter(|k| **k == T).count())
            .collect::<Vec<_>>()
    };
    assert_eq!(flat("(t|tt|ttt)*2"), vec![1, 2, 4, 2, 3]);
    assert_eq!(flat("t,(t|)*2"), vec![2, 1, 0]);
    assert_eq!(flat("(|t)*2,t"), vec![0, 1, 2]);
    // Nested groups (a superset of Megatron's single level).
    assert_eq!(flat("((t)*2|)*2L"), vec![2, 2, 0]);
}

#[test]
fn layouts_give_each_virtual_stage_its_layers_or_name_the_fault() {
    let l = PipelineParallelLayerLayout::parse("Et|ttt|tt|ttL").unwrap();
    let counts = l.decoder_counts(2, 8, 0).unwrap();
    assert_eq!(counts, vec![1, 3, 2, 2]);
    let part = StagePartition {
        num_layers: 8,
        p: 2,
        v: 2,
        layout: Some(counts),
        ..Default::default()
    };
    part.check().unwrap();
    // Virtual stage chunk * 2 + rank.
    assert_eq!(
        [
            part.layers(0, 0),
            part.layers(1, 0),
            part.layers(0, 1),
            part.layers(1, 1)
        ],
        [0..1, 1..4, 4..6, 6..8]
    );
    assert_eq!(
        part.describe(),
        "stage 0: [embedding + layer 0] [layers 4-5] | stage 1: [layers 1-3] [layers 6-7 + loss]"
    );
    let fault =
        |s: &str, p: usize, layers: usize, mtp: usize| match PipelineParallelLayerLayout::parse(s)
            .and_then(|l| l.decoder_counts(p, layers, mtp))
        {
            Ok(c) => panic!("{s} was accepted as {c:?}"),
            Err(e) => e,
        };
    assert!(
        fault("Et|tt|tL", 2, 4, 0).contains("not a multiple of --pipeline-model-parallel-size (2)")
    );
    assert!(fault("tE|ttL", 2, 3, 0).contains("must open the first stage"));
    assert!(fault("|Ett|ttL", 3, 4, 0).contains("must open the first stage"));
    assert!(fault("Ett|tLt", 2, 4, 0).contains("must close the last stage"));
    assert!(fault("EEt|tL", 2, 2, 0).contains("exactly one E"));
    assert!(fault("Ett|ttL", 2, 5, 0).contains("--num-layers is 5"));
    assert!(fault("Ett|ttL", 2, 4, 1).contains("--mtp-num-layers is 1"));
    assert!(fault("Ettm|ttL", 2, 4, 1).contains("in the last stage with the loss"));
    assert!(fault("Ett|tmtL", 2, 4, 1).contains("must follow every transformer layer"));
    assert!(fault("Et(t|tL", 2, 3, 0).contains("unclosed '('"));
    assert!(fault("Ett)|tL", 2, 3, 0).contains("unbalanced ')'"));
    assert!(fault("Et*|tL", 2, 2, 0).contains("followed by a count"));
    assert!(fault("Etx|tL", 2, 2, 0).contains("'x'"));
    assert_eq!(
        PipelineParallelLayerLayout::parse("Ett|ttmL")
            .unwrap()
            .decoder_counts(2, 4, 1),
        Ok(vec![2, 2])
    );
    // The partition refuses a layout beside the other split flags.
    let mixed = StagePartition {
        account_for_loss: true,
        ..part.clone()
    };
    assert!(mixed.check().unwrap_err().contains("cannot be combined"));
}
