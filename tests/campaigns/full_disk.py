"""A real full disk: saves into a small tmpfs until it runs out of space, at many fill levels.

The filesystem is a tmpfs mounted in a private user and mount namespace (``unshare -rm``), so
no privileges are needed and nothing outside the process sees it.  At each fill level a filler
file leaves a different amount of free space, so the disk fills during a different operation
(blob data, its fsync, the manifest, the lease).  Each time: the failing save raises a
``StoreError`` that says the disk is full and what to do, leaves no partial files, every
committed step restores bit-exactly and verifies; after the filler is deleted the same writer
saves the failed step, and a new writer continues the chain.

    python tests/campaigns/full_disk.py [--levels 40] [--size-mb 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

STEPS = 12


def _free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def one_level(root: str, leave: int) -> dict:
    """Fill ``root`` to leave ``leave`` bytes free, then save until the disk is full."""
    import torch

    import tpde
    from campaigns.common import state_at

    filler = os.path.join(root, "filler")
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, _free(root) - leave))
    url = os.path.join(root, "run")
    ck = tpde.Checkpointer(url, keyframe_every=4, chunk_bytes=4096)
    committed, failed, message = [], None, ""
    for step in range(STEPS):
        try:
            ck.save(step, state_at(step))
            committed.append(step)
        except tpde.StoreError as exc:
            failed, message = step, str(exc)
            break
    where = next((kind for kind, part in (("lease", "lease.json"), ("marker", "tpde.json"),
                                          ("manifest", "/steps/"), ("blob", "/data/"))
                  if part in message), "other")
    out = {"leave": leave, "committed": len(committed), "failed_step": failed,
           "where": where if failed is not None else None, "message": message[:400],
           "problems": []}
    reader = tpde.Checkpointer(url)
    if reader.steps() != committed:
        out["problems"].append(f"visible steps {reader.steps()} != committed {committed}")
    for step in committed:
        got = reader.load(step)
        if not all(torch.equal(got[k], v) for k, v in state_at(step).items() if k != "meta"):
            out["problems"].append(f"step {step} does not restore bit-exactly")
    bad = reader.verify()
    if bad:
        out["problems"].append(f"verify: {bad[:2]}")
    leftovers = [n for d, _, fs in os.walk(url) for n in fs if n.endswith(".tmp")]
    blobs = set(os.listdir(os.path.join(url, "data"))) if os.path.isdir(
        os.path.join(url, "data")) else set()
    used = {os.path.basename(reader.chain.manifest(s).blob) for s in committed}
    if leftovers or blobs - used:
        out["problems"].append(f"left behind: {sorted(leftovers + sorted(blobs - used))}")
    if failed is not None:
        if "free space" not in message or "No space left" not in message:
            out["problems"].append(f"the error does not say the disk is full: {message}")
        os.remove(filler)
        ck.save(failed, state_at(failed))  # the same writer, once there is room again
        ck.close()
        nxt = tpde.Checkpointer(url)
        nxt.load()
        nxt.save(failed + 1, state_at(failed + 1))
        nxt.close()
        after = tpde.Checkpointer(url)
        for step in (failed, failed + 1):
            got = after.load(step)
            if not torch.equal(got["w"], state_at(step)["w"]):
                out["problems"].append(f"step {step} saved after freeing space is wrong")
        if after.verify():
            out["problems"].append("verify failed after freeing space")
    else:
        ck.close()
    return out


def inside(root: str, levels: int) -> list[dict]:
    """Runs in the namespace with ``root`` a fresh tmpfs."""
    top = _free(root)
    results = []
    for i in range(levels):
        for name in os.listdir(root):
            path = os.path.join(root, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        # From nothing free to about a whole chain's worth (~215 kB; tmpfs counts whole pages),
        # unevenly spaced so the disk fills during different operations.
        results.append(one_level(root, min(top, (i * 7919 * 37) % (240 * 1024))))
    return results


def available() -> bool:
    """Whether a tmpfs can be mounted in a private namespace here."""
    probe = tempfile.mkdtemp(prefix="tpde-fulldisk-probe-")
    try:
        done = subprocess.run(["unshare", "-rm", "sh", "-c",
                               f"mount -t tmpfs -o size=1m tmpfs {probe}"],
                              capture_output=True, timeout=30)
        return done.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        os.rmdir(probe)


def campaign(levels: int, size_mb: int = 4) -> list[dict]:
    mount = tempfile.mkdtemp(prefix="tpde-fulldisk-")
    try:
        script = (f"mount -t tmpfs -o size={size_mb}m tmpfs {mount} && exec {sys.executable} "
                  f"{os.path.abspath(__file__)} --inside {mount} --levels {levels}")
        done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True,
                              text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"full-disk campaign failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        os.rmdir(mount)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", type=int, default=40)
    p.add_argument("--size-mb", type=int, default=4)
    p.add_argument("--inside", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.inside:
        print(json.dumps(inside(args.inside, args.levels)))
        return
    results = campaign(args.levels, args.size_mb)
    full = [r for r in results if r["failed_step"] is not None]
    bad = [r for r in results if r["problems"]]
    kinds = ", ".join(f"{k} {sum(r['where'] == k for r in full)}"
                      for k in sorted({r["where"] for r in full}))
    print(f"{len(results)} fill levels: the disk filled during {len(full)} runs "
          f"(after 0-{max((r['committed'] for r in full), default=0)} committed steps, writing "
          f"{kinds}); "
          f"{len(bad)} with problems")
    for r in bad:
        print(r)
    for r in full[:3]:
        print(f"after {r['committed']} steps: {r['message']}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
