"""Saves and loads through a proxy that makes a real S3 server (moto) flaky.

Every TCP connection from the client to the server passes a proxy on 127.0.0.1 that, with the
given probability, injects one fault: the connection is refused (closed at once), stalls
(nothing answers until the client gives up), is cut in the middle of the exchange (after the
request has reached the server: the reply is lost), or is slowed down. After every save: if
tpde said it was saved, a direct client reads it back bit-exactly; if tpde raised, the error is
a ``StoreError`` and every step committed before is intact; nothing hangs past its deadline.

    python tests/campaigns/flaky_s3.py [--saves 40] [--fault-rate 0.3] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys
import threading
import time
import uuid
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import tpde  # noqa: E402
from campaigns.s3 import moto_server  # noqa: E402
from helpers import assert_same  # noqa: E402
from tpde.store import store  # noqa: E402

FAULTS = ("refuse", "stall", "cut", "slow")


class FlakyProxy:
    """A TCP proxy injecting one fault into a fraction of connections."""

    def __init__(self, upstream: tuple[str, int], rate: float, seed: int, stall_s: float) -> None:
        self.upstream, self.rate, self.stall_s = upstream, rate, stall_s
        self.rng = random.Random(seed)
        self.injected: Counter = Counter()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.sock.accept()
            with self.lock:
                fault = self.rng.choice(FAULTS) if self.rng.random() < self.rate else None
                if fault:
                    self.injected[fault] += 1
            threading.Thread(target=self._serve, args=(client, fault), daemon=True).start()

    def _serve(self, client: socket.socket, fault: str | None) -> None:
        try:
            if fault == "refuse":
                return
            if fault == "stall":
                time.sleep(self.stall_s)
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                return  # the server is gone (the campaign is over)
            done = threading.Event()
            threading.Thread(target=self._pipe, args=(client, server, None, done),
                             daemon=True).start()
            # Replies flow back; "cut" drops the connection once the server has answered.
            self._pipe(server, client, fault, done)
            server.close()
        finally:
            client.close()

    def _pipe(self, src: socket.socket, dst: socket.socket, fault: str | None,
              done: threading.Event) -> None:
        try:
            while not done.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if fault == "cut":
                    return  # the request reached the server; its reply is lost
                if fault == "slow":
                    time.sleep(0.2)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            done.set()


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    base = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=base)
    rows = 8 * (step % 32)
    w[:rows] += torch.randn(rows, 256, generator=g)
    return {"w": w, "b": w[0].bfloat16(), "step": step}


def campaign(saves: int, rate: float, seed: int) -> dict[str, Any]:
    store.OP_TIMEOUT_S = 5.0  # the stall below outlasts it: every stall ends at a deadline
    with moto_server() as direct:
        endpoint = direct["client_kwargs"]["endpoint_url"]
        host, port = endpoint.removeprefix("http://").split(":")
        proxy = FlakyProxy((host, int(port)), rate, seed, stall_s=30.0)
        flaky = {**direct, "client_kwargs": {**direct["client_kwargs"],
                                             "endpoint_url": f"http://127.0.0.1:{proxy.port}"},
                 "config_kwargs": {"connect_timeout": 2, "read_timeout": 4,
                                   "retries": {"max_attempts": 2}}}
        url = f"s3://tpde/flaky-{uuid.uuid4().hex[:8]}"
        outcome: Counter = Counter()
        committed: dict[int, dict[str, Any]] = {}
        ckpt = tpde.Checkpointer(url, storage_options=flaky, keyframe_every=4, takeover=True)
        slowest = 0.0
        for step in range(saves):
            started = time.monotonic()
            try:
                ckpt.save(step, state(step))
                committed[step] = state(step)
                outcome["saved"] += 1
            except tpde.StoreError:
                outcome["failed cleanly"] += 1
            except tpde.TPDEError as exc:
                outcome[f"other error: {type(exc).__name__}"] += 1
            slowest = max(slowest, time.monotonic() - started)
            reader = tpde.Checkpointer(url, storage_options=direct)
            visible = set(reader.steps())
            assert set(committed) <= visible, f"a saved step is gone: {set(committed) - visible}"
            for s in visible:  # steps whose save failed late may exist; all must be right
                assert_same(committed.get(s) or state(s), reader.load(s), f"step {s}")
        assert tpde.Checkpointer(url, storage_options=direct).verify() == []
        return {"saves": saves, **outcome, "faults injected": dict(proxy.injected),
                "slowest save s": round(slowest, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--saves", type=int, default=40)
    p.add_argument("--fault-rate", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(campaign(args.saves, args.fault_rate, args.seed))


if __name__ == "__main__":
    main()
