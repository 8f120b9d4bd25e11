"""Builds a JSON-lines corpus of about --mb megabytes from a Linux kernel source tree (Debian
package linux-source-6.1: /usr/src/linux-source-6.1.tar.xz), one document per .c/.h/.rst/.txt
file, in sorted path order. Usage: make_kernel_corpus.py TREE OUT.jsonl [--mb 120]"""
import argparse, json, os

p = argparse.ArgumentParser()
p.add_argument("tree")
p.add_argument("out")
p.add_argument("--mb", type=float, default=120)
a = p.parse_args()
total = 0
with open(a.out, "w", encoding="utf-8") as out:
    for root, dirs, files in sorted(os.walk(a.tree)):
        dirs.sort()
        for f in sorted(files):
            if not f.endswith((".c", ".h", ".rst", ".txt")):
                continue
            try:
                text = open(os.path.join(root, f), encoding="utf-8").read()
            except (UnicodeDecodeError, OSError):
                continue
            line = json.dumps({"text": text}) + "\n"
            out.write(line)
            total += len(line.encode())
            if total >= a.mb * 1e6:
                raise SystemExit(print(f"{total / 1e6:.1f} MB written"))
print(f"{total / 1e6:.1f} MB written")
