"""Sums an `ncu --csv --metrics gpu__time_duration.sum` log by kernel name: where one decode
step's GPU time goes, kernel by kernel (tools/gpu-check.sh profile). With --one-span, only the
launches from the first prefill embedding (embed_b*) to the next (one prefill chunk: tools/gpu-check.sh
prefill-kernels), whose count the log may overrun; with --launches=N also the span's first N
launches one by one (grid and µs: two builds' layers side by side)."""
import csv
import re
import sys
from collections import defaultdict

args = [a for a in sys.argv[1:] if not a.startswith("--")]
one_span = "--one-span" in sys.argv
launches = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--launches=")), 0)
listed = []
totals, counts = defaultdict(float), defaultdict(int)
with open(args[0]) as f:
    rows = [line for line in f if line.startswith('"')]
embeds = 0
for row in csv.DictReader(rows):
    if row.get("Metric Name") != "gpu__time_duration.sum":
        continue
    name = row["Kernel Name"].split("(")[0]
    if one_span and re.match(r"embed_b\d", name):
        embeds += 1
    if one_span and embeds != 1:
        if embeds > 1:
            break
        continue
    value = float(row["Metric Value"].replace(",", ""))
    scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(row.get("Metric Unit", "nsecond"), 1e-3)
    totals[name] += value * scale
    counts[name] += 1
    if len(listed) < launches:
        listed.append((name, row.get("Grid Size", ""), value * scale))
# One embedding launch per decode step (embed_rows_b*): the number of steps seen.
steps = 1.0 if one_span else float(sum(n for k, n in counts.items() if k.startswith("embed_rows_b")) or 1)
total = sum(totals.values())
print(f"| kernel | launches per step | µs per step | share |\n|---|---:|---:|---:|")
for name, us in sorted(totals.items(), key=lambda kv: -kv[1]):
    print(f"| {name} | {counts[name] / steps:.0f} | {us / steps:.1f} | {100 * us / total:.0f} % |")
print(f"| total | {sum(counts.values()) / steps:.0f} | {total / steps:.1f} | 100 % |")
if listed:
    print(f"\n| launch | kernel | grid | µs |\n|---:|---|---|---:|")
    for i, (name, grid, us) in enumerate(listed):
        print(f"| {i} | {name} | {grid} | {us:.1f} |")
