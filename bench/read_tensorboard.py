"""Reads a `megatron train --tensorboard-dir` directory with TensorBoard's own event reader and
checks it against the run's --metrics-file (JSON lines): every logged iteration's learning rate
and grad norm, its loss where the log interval is one iteration (TensorBoard has each
iteration's loss, as Megatron writes it; the log line the interval's mean), and every validation
loss, at the same steps.

    python bench/read_tensorboard.py RUN/tb RUN/metrics.jsonl

Needs the `tensorboard` package (pip install tensorboard); exits non-zero on any mismatch."""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main(tb_dir, metrics_path):
    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    print(f"{len(tags)} scalar tags: {', '.join(sorted(tags))}")
    got = {t: {e.step: e.value for e in acc.Scalars(t)} for t in tags}
    rows = [json.loads(l) for l in open(metrics_path) if l.strip()]
    checks = 0
    previous = 0
    for r in rows:
        if "lm_loss" in r:
            pairs = [("learning-rate", "lr"), ("grad-norm", "grad_norm")]
            if r["iteration"] == previous + 1:
                pairs.append(("lm loss", "lm_loss"))
            previous = r["iteration"]
        else:
            pairs = [("lm loss validation", "val_loss")]
        for tag, key in pairs:
            want, have = r[key], got.get(tag, {}).get(r["iteration"])
            if have is None or abs(have - want) > 1e-5 * max(abs(want), 1e-12):
                sys.exit(f"{tag} at iteration {r['iteration']}: tensorboard {have}, metrics {want}")
            checks += 1
    print(f"{checks} values agree with {metrics_path}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
