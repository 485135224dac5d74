"""tpde against the checkpoint formats people use today, on chains from real training runs.

For every workload of ``workloads.py`` and every contender of ``contenders.py``, on this
machine, in one run: the whole chain is saved to local disk step by step, then the latest step
and the slowest step to restore are read back by the contender and compared with what was
saved, bit for bit; so is every other kept step, untimed (with the tests' own comparison:
types, key order, strides, ``requires_grad``, tied storage and every bit). A contender that does
not give back what it was handed is reported so, with the first difference, and gets no ratio
or speed in any table.  Each (workload, contender) runs in a child process of its own, so
its peak memory is its own.  Timings are medians over ``--repeats`` runs.

Figures: stored bytes and ratio against ``torch.save``; save MB/s (all steps' raw bytes, as
``torch.save`` sizes, over the wall time of all saves); restore MB/s and seconds for the latest
step and the worst step; peak extra RSS while saving and while restoring.  For tpde: the codec
mix and, for the delta steps, an order-0 entropy estimate of the residuals, to show how close
to the limit the deltas are.

    python benchmarks/compare.py [--quick] [--repeats N] [--only A,B] [--json OUT] [--plots DIR]

Chains are written under the system's temporary folder, or under ``$TPDE_BENCH_DIR``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import contenders  # noqa: E402
from helpers import difference  # noqa: E402  (the tests' own bit-exact comparison)
from report import workload_table  # noqa: E402
import workloads  # noqa: E402
from tpde.codec import dtypes, transform  # noqa: E402
from tpde.state import tree

# tpde's "best level": level 12 gains 0-3% more but saves at 10-40 MB/s here (chain_bench.py).
BEST_LEVEL = 9


# ------------------------------------------------------------------ comparing states
def touch(state: Any) -> None:
    """Reads one byte of every page of every tensor, so lazily mapped restores pay their I/O."""
    if isinstance(state, torch.Tensor):
        if state.numel():
            state.detach().contiguous().reshape(-1).view(torch.uint8)[::4096].sum()
    elif isinstance(state, dict):
        for v in state.values():
            touch(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            touch(v)


# ------------------------------------------------------------------ memory
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> int:
    """Resets the kernel's peak-RSS mark; returns the RSS it starts from."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS:")


def _peak_since(base: int) -> int:
    return max(0, _status("VmHWM:") - base)


# ------------------------------------------------------------------ entropy estimate
def residual_bits(new: torch.Tensor, old: torch.Tensor) -> float:
    """Bits to code ``new`` given ``old`` with an order-0 model of the residual's bit length.

    The residual is the zigzagged difference of the order-preserving integer images (XOR for
    words without an order); each element costs the entropy of its bit length plus the bits
    below its leading one.  A per-tensor estimate, not a proof of optimality.
    """
    d = dtypes.of_tensor(new)
    a, b = transform.to_words(new, d.word_dtype), transform.to_words(old, d.word_dtype)
    r = transform.residual(a, b, "xor" if d.kind == "raw" else "sub", d.kind)
    z = r.numpy().view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[d.word_bytes])
    _, length = np.frexp(z.astype(np.float64))
    counts = np.bincount(length.ravel(), minlength=d.word_bytes * 8 + 1)
    p = counts[counts > 0] / length.size
    return float(-(counts[counts > 0] * np.log2(p)).sum() + np.maximum(length - 1, 0).sum())


def entropy_estimate(states: list, steps: list[int]) -> int:
    """Estimated bytes of the given delta steps, each against the step before it."""
    bits = 0.0
    for step in steps:
        old = {s.name: s.tensor for s in tree.flatten(states[step - 1]).spans}
        for s in tree.flatten(states[step]).spans:
            ref = old.get(s.name)
            if ref is None or ref.dtype != s.tensor.dtype or ref.numel() != s.tensor.numel():
                bits += s.tensor.nbytes * 8
            elif s.tensor.numel():
                bits += residual_bits(s.tensor, ref)
    return math.ceil(bits / 8)


# ------------------------------------------------------------------ one contender, one workload
def measure(workload: str, which: int, quick: bool, repeats: int) -> dict:
    make = contenders.all_contenders(BEST_LEVEL)[which]
    first = make()
    if first.needs:
        try:
            __import__(first.needs)
        except ImportError:
            return {"name": first.name, "status": f"not installed ({first.needs})"}
    states = workloads.load(workload, quick)
    raw = workloads.torch_sizes(workload, quick, states)
    removed_after = workloads.removals(workload, quick)
    gone = {s for steps in removed_after.values() for s in steps}
    kept = [s for s in range(len(states)) if s not in gone]
    out: dict[str, Any] = {"name": first.name, "status": "ok", "save_s": [],
                           "restore_latest_s": [], "restore_worst_s": [],
                           "peak_rss_save": 0, "peak_rss_restore": 0}
    scratch = os.environ.get("TPDE_BENCH_DIR") or None
    try:
        for repeat in range(repeats):
            folder = tempfile.mkdtemp(prefix="tpde-compare-", dir=scratch)
            try:
                c = make()
                base = _reset_peak()
                started = time.perf_counter()
                for step, state in enumerate(states):
                    c.save(folder, step, state)
                    for old in removed_after.get(step, []):
                        c.remove(folder, old)
                c.close(folder)
                out["save_s"].append(time.perf_counter() - started)
                out["peak_rss_save"] = max(out["peak_rss_save"], _peak_since(base))
                out["stored_bytes"] = sum(os.path.getsize(os.path.join(d, f))
                                          for d, _, files in os.walk(folder) for f in files)
                worst = c.worst_step(folder, kept)
                out["worst_step"] = worst
                for key, target in (("restore_latest_s", kept[-1]),
                                    ("restore_worst_s", worst)):
                    base = _reset_peak()
                    started = time.perf_counter()
                    restored = c.load(folder, target)
                    touch(restored)
                    out[key].append(time.perf_counter() - started)
                    out["peak_rss_restore"] = max(out["peak_rss_restore"], _peak_since(base))
                    del restored
                if repeat == 0:  # every kept step, untimed: a contender must give back each
                    for target in kept:
                        found = difference(c.load(folder, target), states[target])
                        if found:
                            out["status"] = f"not exact at step {target}: {found}"[:300]
                            break
                if repeat == 0:
                    out["details"] = c.details(folder)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    except Exception as exc:  # a contender that fails is a result, not a crash of the suite
        out["status"] = f"failed: {type(exc).__name__}: {exc}"[:300]
        return out
    if isinstance(first, contenders.TPDE) and not first.options and not removed_after:
        keys = {int(s) for s in out["details"]["keyframes"]}
        deltas = [s for s in range(len(states)) if s not in keys]
        if deltas:
            out["delta_steps"] = deltas
            out["delta_stored_bytes"] = sum(out["details"]["stored_per_step"][str(s)]
                                            for s in deltas)
            out["delta_entropy_bytes"] = entropy_estimate(states, deltas)
    out["raw_bytes"] = raw
    out["kept"] = kept
    return out


# ------------------------------------------------------------------ the suite
def summarize(r: dict) -> dict:
    """Ratio and speeds, for a contender that gave back every step exactly; none otherwise."""
    if r["status"] != "ok" or not r.get("save_s"):
        return r
    # What the plain format holds at the end: every kept checkpoint's torch.save file.
    total = sum(r["raw_bytes"][k] for k in r["kept"])
    s = dict(r)
    s["ratio"] = total / r["stored_bytes"]
    s["save_s_median"] = statistics.median(r["save_s"])
    s["save_mb_s"] = sum(r["raw_bytes"]) / 1e6 / s["save_s_median"]  # every step saved
    for key in ("latest", "worst"):
        t = statistics.median(r[f"restore_{key}_s"])
        step = r["kept"][-1] if key == "latest" else r["worst_step"]
        s[f"restore_{key}_s_median"] = t
        s[f"restore_{key}_mb_s"] = r["raw_bytes"][step] / 1e6 / t
    return s


def run_suite(names: list[str], quick: bool, repeats: int) -> dict:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    count = len(contenders.all_contenders(BEST_LEVEL))
    results: dict[str, Any] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total}"), TimeElapsedColumn(), transient=False) as bar:
        task = bar.add_task("benchmark", total=len(names) * count)
        for name in names:
            workloads.ensure(name, quick)  # train (once) before any timing
            entry: dict[str, Any] = {"contenders": {}}
            for i in range(count):
                bar.update(task, description=f"{name}: contender {i + 1} of {count}")
                cmd = [sys.executable, os.path.abspath(__file__), "--child", name, str(i),
                       "--repeats", str(repeats)] + (["--quick"] if quick else [])
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    last = (done.stderr.strip().splitlines() or [""])[-1]
                    r = {"name": f"contender {i}",
                         "status": f"crashed (exit {done.returncode}): {last}"}
                else:
                    r = json.loads(done.stdout.strip().splitlines()[-1])
                r = summarize(r)
                entry["contenders"][r["name"]] = r
                if "raw_bytes" in r:
                    entry["checkpoints"] = len(r["raw_bytes"])
                    entry["kept"] = len(r["kept"])
                    entry["torch_save_bytes"] = sum(r["raw_bytes"][k] for k in r["kept"])
                bar.advance(task)
            results[name] = entry
            workload_table(name, entry)
    return results


def plot(results: dict, folder: str, tag: str = "") -> list[str]:
    """Ratio per contender per workload; save throughput against ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    cs = list(dict.fromkeys(c for w in results.values() for c in w["contenders"]))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(cs)
    for j, c in enumerate(cs):
        ys = [results[n]["contenders"].get(c, {}).get("ratio", 0) for n in names]
        ax.bar([i + j * width for i in range(len(names))], ys, width, label=c)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.set_ylabel("ratio vs torch.save (higher is better)")
    ax.axhline(1, color="grey", lw=0.6)
    ax.legend(ncol=len(cs), fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    paths = [os.path.join(folder, f"compare_ratio{tag}.png")]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    columns = min(3, len(names))
    rows = -(-len(names) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 4 * rows), squeeze=False)
    colours = {c: f"C{j}" for j, c in enumerate(cs)}
    for ax, n in zip(axes.flat, names):
        for c, r in results[n]["contenders"].items():
            if "ratio" in r:
                ax.scatter(r["save_mb_s"], r["ratio"], s=30, color=colours[c], label=c)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(n, fontsize=9)
        ax.set_xlabel("save MB/s (log scale)")
        ax.set_ylabel("ratio vs torch.save")
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, ncol=len(cs), fontsize=7, loc="upper center")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    paths.append(os.path.join(folder, f"compare_speed_vs_ratio{tag}.png"))
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short chains, a few minutes")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs per contender, medians reported (default 3; 1 with --quick)")
    p.add_argument("--only", default="", help="comma-separated workload letters, e.g. A,C")
    p.add_argument("--json", default=None, help="default: benchmarks/results/compare[_quick].json")
    p.add_argument("--plots", default=os.path.join(HERE, "results"))
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.quick, args.repeats)))
        return
    names = [n for n in workloads.NAMES
             if not args.only or n.split("-")[0] in args.only.split(",")]
    started = time.perf_counter()
    results = run_suite(names, args.quick, args.repeats)
    tag = "_quick" if args.quick else ""
    out = args.json or os.path.join(HERE, "results", f"compare{tag}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:  # before the plots: the figures outlive a plotting error
        json.dump({"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                               "torch": torch.__version__, "platform": platform.platform()},
                   "command": " ".join(["python", "benchmarks/compare.py"] + sys.argv[1:]),
                   "quick": args.quick, "repeats": args.repeats,
                   "minutes": (time.perf_counter() - started) / 60, "workloads": results},
                  f, indent=1)
    os.makedirs(args.plots, exist_ok=True)
    pngs = plot(results, args.plots, tag)
    print(f"\nwrote {out} and {', '.join(pngs)} in {(time.perf_counter() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
