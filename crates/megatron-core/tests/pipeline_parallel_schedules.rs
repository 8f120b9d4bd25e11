//! Schedules as pure functions: closed-form warm-up / steady / cool-down counts, Megatron's
//! validity rules, the in-flight bound, and that every valid combination completes (a
//! simulation of all stages exchanging messages, which a deadlock would stall).

use megatron_core::pipeline_parallel::partition::{EncoderStages, StagePartition};
use megatron_core::pipeline_parallel::{interleaved, peak_in_flight, schedule, Op};
use std::collections::HashSet;

/// Runs all stages' schedules against each other; `Err` names the stuck ops if they stall.
fn simulate(p: usize, m: usize, v: usize) -> Result<(), String> {
    let ops: Vec<Vec<Op>> = (0..p).map(|r| schedule(p, r, m, v).unwrap()).collect();
    let stages = p * v;
    let mut next = vec![0usize; p];
    let mut msgs: HashSet<(usize, usize, bool)> = HashSet::new();
    let mut done: HashSet<(usize, usize, usize)> = HashSet::new();
    loop {
        let mut progress = false;
        for r in 0..p {
            while next[r] < ops[r].len() {
                let ok = match ops[r][next[r]] {
                    Op::Forward { chunk, mb } => {
                        let vs = chunk * p + r;
                        if vs == 0 || msgs.remove(&(vs, mb, false)) {
                            if vs + 1 < stages {
                                msgs.insert((vs + 1, mb, false));
                            }
                            done.insert((r, chunk, mb));
                            true
                        } else {
                            false
                        }
                    }
                    Op::Backward { chunk, mb } => {
                        let vs = chunk * p + r;
                        assert!(done.contains(&(r, chunk, mb)), "backward before forward");
                        if vs + 1 == stages || msgs.remove(&(vs, mb, true)) {
                            if vs > 0 {
                                msgs.insert((vs - 1, mb, true));
                            }
                            true
                        } else {
                            false
                        }
                    }
                };
                if !ok {
                    break;
                }
                next[r] += 1;
                progress = true;
            }
        }
        if (0..p).all(|r| next[r] == ops[r].len()) {
            return Ok(());
        }
        if !progress {
            let stuck: Vec<_> = (0..p).map(|r| ops[r].get(next[r]).copied()).collect();
            return Err(format!("p {p} m {m} v {v}: stalled at {stuck:?}"));
        }
    }
}

#[test]
fn one_f_one_b_has_the_closed_form_phases_for_p_1_to_8_and_m_1_to_16() {
    for p in 1..=8 {
        for m in 1..=16 {
            for r in 0..p {
                let ops = schedule(p, r, m, 1).unwrap();
                assert_eq!(ops.len(), 2 * m);
                let first_b = ops
                    .iter()
                    .position(|o| matches!(o, Op::Backward { .. }))
                    .unwrap();
                let warmup = if p == 1 { 0 } else { (p - r - 1).min(m) };
                // Warm-up forwards, then the first steady forward (if any), then alternation.
                let steady = m - warmup;
                assert_eq!(first_b, warmup + (steady > 0) as usize, "p {p} r {r} m {m}");
                for i in 0..steady {
                    assert!(
                        matches!(ops[warmup + 2 * i], Op::Forward { mb, .. } if mb == warmup + i)
                    );
                    assert!(matches!(ops[warmup + 2 * i + 1], Op::Backward { mb, .. } if mb == i));
                }
                let cooldown = &ops[warmup + 2 * steady..];
                assert_eq!(cooldown.len(), warmup);
                assert!(cooldown.iter().all(|o| matches!(o, Op::Backward { .. })));
                assert_eq!(peak_in_flight(&ops), (p - r).min(m), "p {p} r {r} m {m}");
            }
            simulate(p, m, 1).unwrap();
        }
    }
}

#[test]
fn interleaved_schedules_follow_megatron_and_never_stall() {
    for p in 2..=8 {
        for m in 1..=16 {
            for v in [2, 3] {
                let valid = m % p == 0;
                match schedule(p, 0, m, v) {
                    Err(e) => {
                        assert!(!valid, "p {p} m {m} v {v}: {e}");
                        assert!(e.contains("is not divisible by pipeline-model-parallel-size"));
                        continue;
                    }
                    Ok(_) => assert!(valid, "p {p} m {m} v {v} should be refused"),
                }
                for r in 0..p {
                    let ops = schedule(p, r, m, v).unwrap();
                    assert_eq!(ops.len(), 2 * m * v);
                    // Every (chunk, micro-batch) once forward and once backward.
                    let f: HashSet<_> = ops
                        .iter()
                        .filter_map(|o| match o {
                            Op::Forward { chunk, mb } => Some((*chunk, *mb)),
                            _ => None,
                        })
                        .collect();
                    assert_eq!(f.len(), m * v);
                    let w = interleaved::warmup(p, r, m, v);
                    let want = if m == p {
                        m * v
                    } else {
                        ((p - r - 1) * 2 + (v - 1) * p).min(m * v)
                    };
                    assert_eq!(w, want);
                    let first_b = ops
                        .iter()
                        .position(|o| matches!(o, Op::Backward { .. }))
                        .unwrap();
                    assert_eq!(first_b, (w + 1).min(m * v), "p {p} r {r} m {m} v {v}");
                    // The first forwards go through chunk 0 for p micro-batches, then chunk 1.
                    assert_eq!(ops[0], Op::Forward { chunk: 0, mb: 0 });
                    if w > p {
                        assert_eq!(ops[p], Op::Forward { chunk: 1, mb: 0 });
                    }
                    assert_eq!(peak_in_flight(&ops), (w + 1).min(m * v));
                }
                simulate(p, m, v).unwrap();
            }
        }
    }
}

#[test]
fn stage_partitions_split_layers_or_name_the_flag() {
    let even = StagePartition {
        num_layers: 8,
        p: 4,
        v: 1,
        first: None,
        last: None,
        encoder: None,
        ..Default::default()
    };
    even.check().unwrap();
    assert_eq!(
        (0..4).map(|r| even.layers(r, 0)).collect::<Vec<_>>(),
        vec![0..2, 2..4, 4..6, 6..8]
    );
    // The embedding and the loss counted as layers (Megatron's account-for flags): 8 layers
    // + 2 over 2 stages, then over 2 stages of 5 one-slot chunks.
    let accounted = StagePartition {
        p: 2,
        account_for_embedding: true,
        account_for_loss: true,
        ..even.clone()
    };
    accounted.check().unwrap();
    assert_eq!(
        (accounted.layers(0, 0), accounted.layers(1, 0)),
        (0..4, 4..8)
    );
    let chunks = StagePartition {
        v: 5,
        ..accounted.clone()
    };
    chunks.check().unwrap();
    assert_eq!(
        (0..5)
            .flat_map(|c| (0..2).map(move |r| (c, r)))
            .map(|(c, r)| chunks.layers(r, c))
            .collect::<Vec<_>>(),
        vec![0..0, 0..1, 1..2, 2..3, 3..4, 4..5, 5..6, 6..7, 7..8, 8..8]
    );
    assert_eq!(
        chunks.describe(),
        "stage 0: [embedding] [layer 1] [layer 3] [layer 5] [layer 7] | stage 1: [layer 0] [layer 2] [layer 4] [layer 6] [loss]"
    );
    let embedding_only = StagePartition {
        p: 3,
        account_for_loss: false,
        ..accounted.clone()
    };
    embedding_only.check().unwrap();
    assert_eq!(
        (0..3)
            .map(|r| embedding_only.layers(r, 0))
            .collect::<Vec<_>>(),
        vec![0..2, 2..5, 5..8]
    );
    let odd = StagePartition {
        p: 4,
        ..embedding_only.clone()
    };
    assert!(odd.check().unwrap_err().contains("plus the 1 accounted"));
    let mixed = StagePartition {
        first: Some(1),
        ..accounted.clone()
    };
    assert!(mixed.check().unwrap_err().contains("cannot be combined"));
    let virt = StagePartition {
        v: 2,
        ..even.clone()
    };
    virt.check().unwrap();
    // Virtual stage chunk * p + rank holds layers [vs, vs + 1).
    assert_eq!(virt.layers(1, 0), 1..2);
    assert_eq!(virt.layers(1, 1), 5..6);
    assert!(virt.is_last(3, 1) && !virt.is_last(3, 0) && virt.is_first(0, 0));
    let uneven = StagePartition {
        num_layers: 7,
        first: Some(1),
        last: Some(2),
        encoder: None,
        ..even.clone()
    };
    uneven.check().unwrap();
    assert_eq!(
        (0..4).map(|r| uneven.layers(r, 0)).collect::<Vec<_>>(),
        vec![0..1, 1..3, 3..5, 5..7]
    );
    // T5's split rank 1 of 3 stages: the 2 encoder layers on stage 0, 4 decoder layers on 1 and 2.
    let t5 = StagePartition {
        num_layers: 6,
        p: 3,
        encoder: Some(EncoderStages {
            layers: 2,
            stages: 1,
        }),
        ..even.clone()
    };
    t5.check().unwrap();
    assert_eq!(
        (0..3).map(|r| t5.layers(r, 0)).collect::<Vec<_>>(),
        vec![0..2, 2..4, 4..6]
    );
    let bad = StagePartition {
        num_layers: 5,
        ..t5.clone()
    };
    assert!(bad.check().unwrap_err().contains("decoder's 3 over its 2"));
    let bad = StagePartition {
        encoder: Some(EncoderStages {
            layers: 2,
            stages: 3,
        }),
        ..t5.clone()
    };
    assert!(bad.check().unwrap_err().contains("split-rank (3)"));
    let bad = StagePartition {
        num_layers: 6,
        ..even.clone()
    };
    assert!(bad.check().unwrap_err().contains("--num-layers (6)"));
    let bad = StagePartition {
        num_layers: 8,
        v: 3,
        ..even.clone()
    };
    assert!(bad.check().unwrap_err().contains("virtual stages"));
    let bad = StagePartition {
        num_layers: 8,
        first: Some(3),
        ..even.clone()
    };
    assert!(bad
        .check()
        .unwrap_err()
        .contains("--decoder-first/last-pipeline-num-layers"));
    assert!(interleaved::check(4, 6, 2).is_err());
}
