"""Render a benchmark's JSON as the markdown tables of benchmarks/README.md.

    python benchmarks/report.py benchmarks/results/compare.json
    python benchmarks/report.py benchmarks/results/chain_bench.json
"""

from __future__ import annotations

import json
import sys


def machine(data: dict) -> str:
    m = data["machine"]
    return (f"Machine: {m['cpus']} CPU cores, Python {m['python']}, torch {m['torch']}, "
            f"{m['platform']}{' (--quick)' if data['quick'] else ''}.\n")


def settings(data: dict) -> None:
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


def contenders(data: dict) -> None:
    print(f"Command: `{data['command']}`, {data['repeats']} timed runs per cell (medians), "
          f"{data['minutes']:.0f} minutes in all.\n")
    print("| workload | tpde ratio | best other ratio | tpde save MB/s | fastest other save "
          "at ≥ tpde's ratio | tpde restore latest MB/s |")
    print("|---|---|---|---|---|---|")
    for name, w in data["workloads"].items():
        rs = {c: r for c, r in w["contenders"].items() if "ratio" in r and r["status"] == "ok"}
        t = rs.get("tpde")
        others = {c: r for c, r in rs.items() if not c.startswith("tpde")}
        if not t or not others:
            continue
        best = max(others, key=lambda c: others[c]["ratio"])
        rivals = {c: r for c, r in others.items() if r["ratio"] >= t["ratio"]}
        fast = max(rivals, key=lambda c: rivals[c]["save_mb_s"]) if rivals else None
        rival = f"{fast} {rivals[fast]['save_mb_s']:.0f}" if fast else "none"
        print(f"| {name} | {t['ratio']:.2f}x | {best} {others[best]['ratio']:.2f}x | "
              f"{t['save_mb_s']:.0f} | {rival} | {t['restore_latest_mb_s']:.0f} |")
    print()
    for name, w in data["workloads"].items():
        workload_table(name, w)


def workload_table(name: str, w: dict) -> None:
    """One workload's contenders as a markdown table, with tpde's codec mix and estimate."""
    kept = w.get("kept", w.get("checkpoints"))
    held = "" if kept == w.get("checkpoints") else \
        f" saved, {kept} kept at the end (ratios against the kept ones)"
    print(f"### {name}: {w.get('checkpoints', '?')} checkpoints{held}, "
          f"{w.get('torch_save_bytes', 0) / 1e6:.1f} MB as torch.save\n")
    print("| contender | stored MB | ratio | save MB/s | restore latest MB/s | worst step "
          "restore s | peak extra RSS save / restore MB | round trip |")
    print("|---|---|---|---|---|---|---|---|")
    for c, r in w["contenders"].items():
        if "ratio" not in r:
            print(f"| {c} | | | | | | | {r['status']} |")
            continue
        print(f"| {c} | {r['stored_bytes'] / 1e6:.1f} | {r['ratio']:.2f}x | "
              f"{r['save_mb_s']:.0f} | {r['restore_latest_mb_s']:.0f} | "
              f"{r['restore_worst_s_median']:.2f} (step {r['worst_step']}) | "
              f"{r['peak_rss_save'] / 1e6:.0f} / {r['peak_rss_restore'] / 1e6:.0f} | "
              f"{'bit-exact' if r['status'] == 'ok' else r['status']} |")
    t = w["contenders"].get("tpde", {})
    if "details" in t:
        codecs = ", ".join(f"{k} {v}" for k, v in sorted(t["details"]["codecs"].items()))
        print(f"\ntpde records: {codecs}.")
    if t.get("delta_entropy_bytes"):
        print(f"Delta steps {t['delta_steps'][0]}–{t['delta_steps'][-1]}: tpde stored "
              f"{t['delta_stored_bytes'] / 1e6:.1f} MB; the order-0 estimate of their "
              f"residuals is {t['delta_entropy_bytes'] / 1e6:.1f} MB "
              f"({t['delta_stored_bytes'] / t['delta_entropy_bytes']:.2f}x of it).")
    print()


def main(path: str) -> None:
    data = json.load(open(path))
    print(machine(data))
    first = next(iter(data["workloads"].values()))
    (contenders if "contenders" in first else settings)(data)


if __name__ == "__main__":
    main(sys.argv[1])
