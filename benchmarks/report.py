"""Render chain_bench.py's JSON as the markdown tables of benchmarks/README.md.

    python benchmarks/report.py benchmarks/results/chain_bench.json
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    data = json.load(open(path))
    m = data["machine"]
    print(f"Machine: {m['cpus']} CPU cores, Python {m['python']}, torch {m['torch']}, {m['platform']}"
          f"{' (--quick)' if data['quick'] else ''}.\n")
    for name, w in data["workloads"].items():
        print(f"### {name}: {w['checkpoints']} checkpoints, "
              f"{w['torch_save_bytes'] / 1e6:.1f} MB as torch.save\n")
        print("| setting | tpde MB | ratio vs torch.save | save MB/s | restore latest MB/s | codecs |")
        print("|---|---|---|---|---|---|")
        for label, r in w["settings"].items():
            codecs = ", ".join(f"{k} {v}" for k, v in sorted(r["codecs"].items()))
            print(f"| {label} | {r['stored_bytes'] / 1e6:.1f} | {r['ratio_vs_torch_save']:.2f}x | "
                  f"{r['save_mb_s']:.0f} | {r['restore_latest_mb_s']:.0f} | {codecs} |")
        print()


if __name__ == "__main__":
    main(sys.argv[1])
