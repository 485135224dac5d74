"""The GPU decoder: ``tpde.codec.decoder.decode``'s backend, nvCOMP for zstd and Triton for the
rest.

The values of a step's records are decompressed by nvCOMP in one batch straight into device
memory (``add_values``); position streams are decompressed on the host, where their header and
sync table are checked, and decoded on the device block by block. Unshuffle, residuals and the
sparse scatter run in the Triton kernels. Without nvCOMP, zstd runs on the CPU and the planes
are copied over.
Everything runs on a stream of the backend's own (after the work the caller had queued), so
each piece is ordered after the one it reads without waiting for the device; ``done`` waits
for it and hands the words over to the caller's stream.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from tpde.codec import decoder
from tpde.errors import FormatError, TPDEError, UnsupportedError
from tpde.kernels import nvcomp, triton_kernels
from tpde.kernels.nvcomp import Stream


_streams: dict[tuple[torch.device, int], torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def _stream_beside(caller: torch.cuda.Stream) -> torch.cuda.Stream:
    """The same decode stream for every call from one caller's stream: nvCOMP's codecs and
    configs are built per stream, once."""
    with _streams_lock:
        key = (caller.device, caller.cuda_stream)
        if key not in _streams:
            _streams[key] = torch.cuda.Stream(caller.device)
        return _streams[key]


class Kernels(decoder.CPU):
    """Decodes records on ``device``: their words never pass through host memory."""

    def __init__(self, device: torch.device) -> None:
        if not triton_kernels.available():
            raise UnsupportedError("decoding with the GPU kernels needs triton (it ships with "
                                   "the CUDA builds of torch)")
        self.device = device
        self.nvcomp = device.type == "cuda" and nvcomp.available()
        self.stream = self.caller = None
        if device.type == "cuda":
            self.caller = torch.cuda.current_stream(device)
            self.stream = _stream_beside(self.caller)
            self.stream.wait_stream(self.caller)  # the reference words the caller wrote

    def done(self, words: Sequence[torch.Tensor]) -> None:
        """Wait for the device to finish ``words``; they may then be read, and freed, on the
        caller's stream (and copied to the host from any thread)."""
        if self.stream is None:
            return
        self.stream.synchronize()
        for w in words:
            w.record_stream(self.caller)

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self.stream is None:
            yield
        else:
            with torch.cuda.stream(self.stream):
                yield

    def add_values(self, sections: list[dict[str, Any] | TPDEError],
                   values: Sequence[Stream | None]) -> None:
        """Decode the records' values with nvCOMP, in one batch, into their ``sections``; a
        record whose values cannot be decoded gets the error instead."""
        todo = [i for i, v in enumerate(values) if v is not None and isinstance(sections[i], dict)]
        if not todo:
            return
        with self._on_stream():
            try:
                decoded = nvcomp.decompress_many([values[i] for i in todo], self.device)
            except TPDEError:
                decoded = []  # find which records are at fault: each alone
                for i in todo:
                    try:
                        decoded.append(nvcomp.decompress_many([values[i]], self.device)[0])
                    except TPDEError as exc:
                        decoded.append(exc)
        for i, d in zip(todo, decoded):
            if isinstance(d, TPDEError):
                sections[i] = d
            else:
                sections[i]["values"] = d  # type: ignore[index]

    def words(self, sections: dict[str, Any], name: str, word_dtype: torch.dtype) -> torch.Tensor:
        if name not in sections:
            raise FormatError(f"record lacks its {name!r} section")
        data = sections[name]
        if not isinstance(data, torch.Tensor):
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else \
                torch.empty(0, dtype=torch.uint8)
        with self._on_stream():
            return triton_kernels.unshuffle(data.to(self.device), word_dtype)

    def dense(self, ref: torch.Tensor, r: torch.Tensor, how: str, kind: str) -> torch.Tensor:
        with self._on_stream():
            return triton_kernels.apply_residual_(ref, r, how, kind)

    def positions(self, stream: bytes | bytearray, n: int, decoded: np.ndarray | None,
                  device: torch.device) -> torch.Tensor:
        with self._on_stream():
            if decoded is not None:
                return torch.from_numpy(decoded).to(device)
            return triton_kernels.decode_positions(stream, device, limit=n)

    def sparse(self, ref: torch.Tensor, pos: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        with self._on_stream():
            return triton_kernels.apply_sparse_xor_(ref, pos, r)

    def quant(self, *args: Any) -> torch.Tensor:
        """Error-bounded records: torch's own kernels, in the integer and float64 arithmetic
        that rebuilds the same bits on every device."""
        with self._on_stream():
            return super().quant(*args)
