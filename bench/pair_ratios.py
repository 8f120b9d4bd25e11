"""The summary of an alternating benchmark (bench/compare.sh, bert_compare.sh, t5_compare.sh):
reads the JSON rows (megatron-rs, then the PyTorch run right after it, per pair) and prints the
per-pair step-time ratios, their median and both peak RSS. Each pair's ratio is the figure
that neighbours' load moves least. Usage: python3 bench/pair_ratios.py ROWS_FILE
"""
import json, statistics, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
pairs = [(rows[i], rows[i + 1]) for i in range(0, len(rows) - 1, 2)]
ratios = [t["step_s"] / m["step_s"] for m, t in pairs]
print("# step-time ratio PyTorch / megatron-rs per pair: " + " ".join(f"{r:.2f}" for r in ratios))
print(f"# median ratio {statistics.median(ratios):.2f}x over {len(ratios)} pairs; peak RSS "
      f"{max(m['peak_rss_bytes'] for m, _ in pairs) / 1e9:.2f} vs {max(t['peak_rss_bytes'] for _, t in pairs) / 1e9:.2f} GB")
