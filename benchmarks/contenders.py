"""The checkpoint formats a user would pick instead of tpde, each behind one small interface.

Every contender writes each step of a chain into its own folder and reads any step back into a
fresh object, using the library the way its documentation does.  Libraries that store tensors
only (safetensors, ZipNN, Blosc2) get the non-tensor rest of the checkpoint as tpde's own JSON
skeleton, and tensors that share storage (tied weights) once, as ``torch.save`` and tpde do, so
no contender pays for duplicates the others avoid.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import warnings
from typing import Any, Callable

import torch
import zstandard

import tpde
from tpde.state import tree


class Contender:
    """Saves the steps of one chain in order, then restores any step."""

    name = ""
    needs = ""  # the module it imports; missing means "not installed"

    def save(self, folder: str, step: int, state: Any) -> None:
        raise NotImplementedError

    def close(self, folder: str) -> None:
        """Called after the last save."""

    def load(self, folder: str, step: int) -> Any:
        raise NotImplementedError

    def remove(self, folder: str, step: int) -> None:
        """Free a step that is no longer kept (a retention policy removed it)."""
        for name in os.listdir(folder):
            if name.startswith(f"step-{step:06d}"):
                path = os.path.join(folder, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)

    def worst_step(self, folder: str, steps: list[int]) -> int:
        """The kept step that is slowest to restore: the latest unless steps depend on others."""
        return steps[-1]

    def details(self, folder: str) -> dict:
        return {}


def _path(folder: str, step: int, suffix: str) -> str:
    return os.path.join(folder, f"step-{step:06d}{suffix}")


class TorchSave(Contender):
    name = "torch.save"

    def save(self, folder: str, step: int, state: Any) -> None:
        torch.save(state, _path(folder, step, ".pt"))

    def load(self, folder: str, step: int) -> Any:
        return torch.load(_path(folder, step, ".pt"), weights_only=False)


class TorchSaveZstd(Contender):
    """The whole ``torch.save`` file through zstd at its default level (3)."""

    name = "torch.save+zstd"

    def save(self, folder: str, step: int, state: Any) -> None:
        buf = io.BytesIO()
        torch.save(state, buf)
        with open(_path(folder, step, ".pt.zst"), "wb") as f:
            f.write(zstandard.ZstdCompressor(level=3).compress(buf.getbuffer()))

    def load(self, folder: str, step: int) -> Any:
        with open(_path(folder, step, ".pt.zst"), "rb") as f:
            raw = zstandard.ZstdDecompressor().decompress(f.read())
        return torch.load(io.BytesIO(raw), weights_only=False)


class Safetensors(Contender):
    name = "safetensors"
    needs = "safetensors"

    def save(self, folder: str, step: int, state: Any) -> None:
        from safetensors.torch import save_file

        flat = tree.flatten(state)
        save_file({str(i): s.tensor.contiguous() for i, s in enumerate(flat.spans)},
                  _path(folder, step, ".safetensors"),
                  metadata={"skeleton": json.dumps(flat.skeleton)})

    def load(self, folder: str, step: int) -> Any:
        from safetensors import safe_open

        with safe_open(_path(folder, step, ".safetensors"), framework="pt") as f:
            skeleton = json.loads(f.metadata()["skeleton"])
            spans = [f.get_tensor(str(i)) for i in range(len(f.keys()))]
        return tree.unflatten(skeleton, spans, trusted=True)


class PerTensor(Contender):
    """One file per step: a JSON header (skeleton, span dtypes and sizes) and compressed spans."""

    suffix = ""

    def encode(self, name: str, span: torch.Tensor) -> tuple[bytes, str]:
        raise NotImplementedError

    def decode(self, name: str, blob: bytes, how: str, nbytes: int) -> bytes:
        raise NotImplementedError

    def save(self, folder: str, step: int, state: Any) -> None:
        flat = tree.flatten(state)
        blobs, spans = [], []
        for s in flat.spans:
            blob, how = self.encode(s.name, s.tensor.contiguous())
            blobs.append(blob)
            spans.append({"name": s.name, "dtype": str(s.tensor.dtype).removeprefix("torch."),
                          "numel": s.tensor.numel(), "how": how, "size": len(blob)})
        header = json.dumps({"skeleton": flat.skeleton, "spans": spans}).encode()
        with open(_path(folder, step, self.suffix), "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            for blob in blobs:
                f.write(blob)

    def load(self, folder: str, step: int) -> Any:
        with open(_path(folder, step, self.suffix), "rb") as f:
            data = f.read()
        (n,) = struct.unpack_from("<Q", data)
        header = json.loads(data[8 : 8 + n])
        at, spans = 8 + n, []
        for s in header["spans"]:
            dtype = getattr(torch, s["dtype"])
            nbytes = s["numel"] * dtype.itemsize
            raw = self.decode(s["name"], data[at : at + s["size"]], s["how"], nbytes)
            at += s["size"]
            spans.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
                         if nbytes else torch.empty(0, dtype=dtype))
        return tree.unflatten(header["skeleton"], spans, trusted=True)


def _bytes(t: torch.Tensor) -> bytearray:
    return bytearray(t.reshape(-1).view(torch.uint8).numpy().tobytes())


class ZipNN(PerTensor):
    """ZipNN's byte grouping + zstd per tensor (a copy is handed over: it reorders in place)."""

    name = "ZipNN"
    needs = "zipnn"
    suffix = ".znn"
    FLOATS = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

    def __init__(self) -> None:
        self.coders: dict[tuple[str, bool], Any] = {}

    def coder(self, dtype_name: str, delta: bool = False) -> Any:
        from zipnn import ZipNN as Z

        key = (dtype_name, delta)
        if key not in self.coders:
            self.coders[key] = Z(input_format="byte", bytearray_dtype=dtype_name,
                                 delta_compressed_type="byte" if delta else 0)
        return self.coders[key]

    def grouping(self, t: torch.Tensor) -> str | None:
        """The element type ZipNN groups bytes by; None stores raw (ZipNN crashes on 2 bytes)."""
        if t.dtype in self.FLOATS:
            return self.FLOATS[t.dtype] if t.nbytes >= 64 else None
        return "float32" if t.nbytes >= 64 and t.nbytes % 4 == 0 else None

    def encode(self, name: str, span: torch.Tensor) -> tuple[bytes, str]:
        group = self.grouping(span)
        if group is None:
            return bytes(_bytes(span)), "raw"
        return bytes(self.coder(group).compress(_bytes(span))), group

    def decode(self, name: str, blob: bytes, how: str, nbytes: int) -> bytes:
        return blob if how == "raw" else bytes(self.coder(how).decompress(blob))


class ZipNNDelta(ZipNN):
    """ZipNN's delta mode: each tensor XORed with the same tensor of the previous step."""

    name = "ZipNN delta"
    suffix = ".znnd"

    def __init__(self) -> None:
        super().__init__()
        self.previous: dict[str, bytearray] = {}
        self.current: dict[str, bytearray] = {}
        self.reading: dict[str, bytes] = {}

    def save(self, folder: str, step: int, state: Any) -> None:
        self.current = {}
        super().save(folder, step, state)
        self.previous = self.current

    def encode(self, name: str, span: torch.Tensor) -> tuple[bytes, str]:
        data = _bytes(span)
        self.current[name] = bytearray(data)
        group, ref = self.grouping(span), self.previous.get(name)
        if group is None or ref is None or len(ref) != len(data):
            return super().encode(name, span)
        return bytes(self.coder(group, True).compress(data, delta_second_data=ref)), "d" + group

    def decode(self, name: str, blob: bytes, how: str, nbytes: int) -> bytes:
        if how.startswith("d"):
            raw = bytes(self.coder(how[1:], True).decompress(blob,
                                                             delta_second_data=self.reading[name]))
        else:
            raw = super().decode(name, blob, how, nbytes)
        self.reading[name] = raw
        return raw

    def remove(self, folder: str, step: int) -> None:
        """Nothing is freed: every later step is a delta against this one (no re-basing)."""

    def load(self, folder: str, step: int) -> Any:
        """Every step from the first, since each is a delta against the one before."""
        self.reading = {}
        for earlier in range(step):
            super().load(folder, earlier)
        return super().load(folder, step)


class Blosc2(PerTensor):
    """Blosc2 with bitshuffle + zstd (its default level 5 and threads) per tensor."""

    name = "Blosc2"
    needs = "blosc2"
    suffix = ".b2"

    def encode(self, name: str, span: torch.Tensor) -> tuple[bytes, str]:
        import blosc2

        return blosc2.compress2(span.reshape(-1).view(torch.uint8).numpy(),
                                typesize=span.element_size(), codec=blosc2.Codec.ZSTD,
                                filter=blosc2.Filter.BITSHUFFLE), "b2"

    def decode(self, name: str, blob: bytes, how: str, nbytes: int) -> bytes:
        import blosc2

        return blosc2.decompress2(blob)


class DCP(Contender):
    """torch.distributed.checkpoint in one process; loading needs the state's structure."""

    name = "torch DCP"

    def __init__(self) -> None:
        self.templates: dict[int, Any] = {}

    def save(self, folder: str, step: int, state: Any) -> None:
        import torch.distributed.checkpoint as dcp

        self.templates[step] = _template(state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=_path(folder, step, ".dcp"))

    def load(self, folder: str, step: int) -> Any:
        import torch.distributed.checkpoint as dcp

        state = _template(self.templates[step])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=_path(folder, step, ".dcp"))
        return state


def _template(x: Any, tied: dict | None = None) -> Any:
    """What a DCP user loads into: the same structure, tensors allocated (tied ones once, as a
    model with tied weights gives them), other values unset."""
    tied = {} if tied is None else tied
    if isinstance(x, torch.Tensor):
        view = (x.untyped_storage().data_ptr(), x.storage_offset(), x.shape, x.stride())
        if view not in tied:
            tied[view] = torch.empty_like(x)
        return tied[view]
    if isinstance(x, dict):
        out = type(x)((k, _template(v, tied)) for k, v in x.items())
        if hasattr(x, "_metadata"):
            out._metadata = x._metadata  # as in a module's own state_dict()
        return out
    if isinstance(x, list):
        return [_template(v, tied) for v in x]
    return None


class TPDE(Contender):
    def __init__(self, **options: Any) -> None:
        self.options = options
        self.writer: tpde.Checkpointer | None = None
        self.name = "tpde" + "".join(f" {k}={v}" for k, v in options.items())

    def save(self, folder: str, step: int, state: Any) -> None:
        if self.writer is None:
            self.writer = tpde.Checkpointer(os.path.join(folder, "run"), **self.options)
        self.writer.save(step, state)

    def close(self, folder: str) -> None:
        if self.writer is not None:
            self.writer.close()

    def load(self, folder: str, step: int) -> Any:
        # trusted, as the torch.save contenders load with weights_only=False
        return tpde.Checkpointer(os.path.join(folder, "run")).load(step, trusted=True)

    def remove(self, folder: str, step: int) -> None:
        assert self.writer is not None
        # As the Lightning plugin removes: hidden at once, freed (the kept steps that read it
        # re-based) once the run would hold more than the plain files, or at close.
        self.writer.remove(step, defer=True)

    def worst_step(self, folder: str, steps: list[int]) -> int:
        """The kept step with the most deltas to apply since a keyframe (the latest such)."""
        chain = tpde.Checkpointer(os.path.join(folder, "run")).chain
        return max(steps, key=lambda s: (chain.manifest(s).depth, s))

    def details(self, folder: str) -> dict:
        reader = tpde.Checkpointer(os.path.join(folder, "run"))
        manifests = [reader.chain.manifest(step) for step in reader.steps()]
        return {"codecs": codec_mix(manifests),
                "stored_per_step": {str(m.step): m.stored_bytes for m in manifests},
                "keyframes": [m.step for m in manifests if m.keyframe]}


def codec_mix(manifests: list) -> dict[str, int]:
    """How many records of each codec (and residual) the given steps hold."""
    mix: dict[str, int] = {}
    for m in manifests:
        for r in m.records:
            key = f"{r.codec}/{r.residual}" if r.residual else r.codec
            mix[key] = mix.get(key, 0) + 1
    return mix


def all_contenders(best_level: int) -> list[Callable[[], Contender]]:
    return [TorchSave, TorchSaveZstd, Safetensors, ZipNN, ZipNNDelta, Blosc2, DCP,
            lambda: TPDE(), lambda: TPDE(level=best_level),
            lambda: TPDE(deltas_against="keyframe")]
