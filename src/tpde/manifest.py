"""The step manifest: the small JSON object whose appearance commits a step.

It is compact JSON (keys in insertion order, which the checkpoint's own dicts need) carrying a
BLAKE2b digest of its own body, so a flipped bit anywhere in it is detected; tensor bytes are
covered by each record's hash of the restored words. From format 3 it is stored as one zstd
frame: its record lists repeat the same keys for every tensor and compress about tenfold, and a
run holds one manifest per step. ``parse`` validates every field before anything is allocated
from it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard

from . import codec, dtypes, frames, quant, transform
from .errors import FormatError

#: The newest format this tpde reads: format 6 names record hashes by their function (XXH3-128,
#: 34x faster than BLAKE2b here, where a save hashed every byte once and a restore again), and
#: is written by every new save. Format 5 adds sharded steps (records in several blobs,
#: one per rank that wrote them, and the ``torch.distributed.checkpoint`` metadata), written
#: only by sharded saves. Format 4 adds error-bounded records (the opt-in lossy mode), and is
#: written only by steps that hold a tensor saved under a bound, so that chains saved without
#: one stay readable by tpde releases that know format 3. Format 3: zstd-framed manifests that
#: may name an origin blob (re-based steps) and hold pieces. Formats 1 and 2 (plain JSON; 2
#: with pieces) are read as before.
FORMAT = 6
PIECES_FORMAT = 2
FRAMED_FORMAT = 3
BOUNDED_FORMAT = 4
SHARDED_FORMAT = 5
XXH3_FORMAT = 6
#: A format 6 record hash: this prefix and the canonical hex of the restored bytes' XXH3-128.
XXH3 = "xxh3:"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_ELEMENTS = 1 << 48
DIGEST_SIZE = 16


def content_hash(data: memoryview | bytes) -> str:
    """BLAKE2b-128: the manifest's own digest, and records' hashes before format 6."""
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).hexdigest()


def record_hash(data: memoryview | bytes | np.ndarray) -> str:
    """The hash a new record stores of its restored bytes (format 6): XXH3-128, which runs at
    memory speed (32 GB/s against BLAKE2b's 0.94 GB/s on one core here) and catches damage as
    surely; the manifest itself keeps its BLAKE2b digest."""
    return XXH3 + xxhash.xxh3_128_hexdigest(data)


def hash_matches(data: memoryview | bytes | np.ndarray, stored: str) -> bool:
    """Whether restored bytes are what a record's hash says, with the function it names."""
    if stored.startswith(XXH3):
        return record_hash(data) == stored
    return content_hash(data) == stored


@dataclass
class SectionRef:
    offset: int  # in the step's blob
    raw: int
    chunk: int
    frames: tuple[int, ...]  # compressed size of every frame

    @property
    def length(self) -> int:
        return sum(self.frames)


@dataclass
class Record:
    """One stored span: what it is, how it was coded, where its bytes are."""

    name: str
    dtype: str
    numel: int
    device: str
    codec: str
    hash: str
    ref: int | None = None
    residual: str | None = None
    count: int = 0
    sections: dict[str, SectionRef] = field(default_factory=dict)
    #: Where this piece of a large span starts, in elements; None for a whole span.
    start: int | None = None
    #: ``quant`` records: the grid (``ulp`` or ``abs``) and its scale.
    grid: str | None = None
    scale: float | None = None
    #: Format 4: the error bound the tensor was saved under (``{"abs": a, "rel": r}``, either
    #: or both), and, where the restored words differ from the saved ones, the largest errors
    #: (``{"abs": ..., "rel": ...}``) measured at the save.
    bound: dict[str, float] | None = None
    error: dict[str, float] | None = None
    #: Format 5: the index in ``Manifest.shards`` of the blob holding this record's sections
    #: (None: the manifest's own blob).
    shard: int | None = None

    @property
    def lossy(self) -> bool:
        """Whether this step restores other values than were saved (within ``bound``)."""
        return self.error is not None

    @property
    def span(self) -> str:
        """The name of the span this record stores (a piece's name is ``<span>/<start>``)."""
        return self.name if self.start is None else self.name[: -len(f"/{self.start}")]

    @property
    def raw_bytes(self) -> int:
        return self.numel * dtypes.by_name(self.dtype).itemsize

    @property
    def stored_bytes(self) -> int:
        return sum(s.length for s in self.sections.values())

    @property
    def density(self) -> float:
        """Fraction of words that changed against the reference (1 for a keyframe record)."""
        if self.ref is None:
            return 1.0
        words = self.numel * dtypes.by_name(self.dtype).words_per_element
        return self.count / words if words else 0.0


@dataclass
class Manifest:
    step: int
    keyframe: bool
    depth: int  # delta steps since the keyframe this step builds on
    parent: int | None  # the reference step of the deltas, if any
    blob: str | None
    blob_size: int
    created: float
    seconds: float
    skeleton: Any
    records: list[Record]
    format: int = FRAMED_FORMAT
    #: The blob the step was first written with: what checkpoint entries name the step by.
    #: Set when a re-base moved the step into a new blob; None means ``blob``.
    origin: str | None = None
    #: Format 5, sharded steps: the blobs the ranks wrote (``{"blob", "size"}``), which
    #: records name by index, and the ``torch.distributed.checkpoint`` metadata (§12).
    shards: list[dict[str, Any]] = field(default_factory=list)
    dcp: dict[str, Any] | None = None

    @property
    def id(self) -> str | None:
        """What names this step for good, across re-bases (a reused step number differs)."""
        return self.origin or self.blob or (self.shards[0]["blob"] if self.shards else None)

    def blob_of(self, r: Record) -> str:
        """The blob holding ``r``'s sections."""
        if r.shard is not None:
            return self.shards[r.shard]["blob"]
        if self.blob is None:
            raise FormatError("record has data but the step has no blob", step=self.step,
                              tensor=r.name)
        return self.blob

    def blobs(self) -> dict[str, int]:
        """Every blob the step's records are stored in, with its size."""
        out = {s["blob"]: s["size"] for s in self.shards}
        if self.blob:
            out[self.blob] = self.blob_size
        return out

    @property
    def raw_bytes(self) -> int:
        return sum(r.raw_bytes for r in self.records)

    @property
    def stored_bytes(self) -> int:
        """The blobs plus the manifest itself: everything the step costs in the store."""
        return sum(self.blobs().values()) + self.__dict__.get("_size", 0)

    def spans(self) -> list[list[Record]]:
        """The records of each span (one, or its pieces in order); the skeleton's ``$t`` indexes
        this list."""
        out: list[list[Record]] = []
        for r in self.records:
            if r.start:
                out[-1].append(r)
            else:
                out.append([r])
        return out

    @property
    def lossy(self) -> bool:
        return any(r.lossy for r in self.records)

    def refs(self) -> set[int]:
        return {r.ref for r in self.records if r.ref is not None}

    def record(self, name: str) -> Record | None:
        return self._by_name().get(name)

    def _by_name(self) -> dict[str, Record]:
        cache = self.__dict__.get("_names")
        if cache is None:
            cache = self.__dict__["_names"] = {r.name: r for r in self.records}
        return cache

    def to_bytes(self) -> bytes:
        # Field by field rather than ``asdict``, whose deep copy of every record was a tenth of
        # a small-tensor save; the JSON is the same.
        body = {f.name: getattr(self, f.name) for f in _MANIFEST_FIELDS}
        for key in ("origin", "dcp", "shards"):
            if not body[key]:
                del body[key]
        body["records"] = [_record_body(r) for r in self.records]
        canon = _canonical(body)
        # What _canonical({"body": body, "blake2b": digest}) writes, without a second pass.
        text = _BODY + canon + _DIGEST + content_hash(canon).encode() + b'"}'
        if self.format < FRAMED_FORMAT:
            return text
        return zstandard.ZstdCompressor(level=3, write_content_size=True).compress(text)


_BODY, _DIGEST = b'{"body":', b',"blake2b":"'  # a written manifest: _BODY body _DIGEST hex "}


def _written_body(text: bytes) -> bytes | None:
    """The body's bytes as ``to_bytes`` wrote them (None: not laid out that way)."""
    end = len(text) - 2 * DIGEST_SIZE - 2
    if text.startswith(_BODY) and text.endswith(b'"}') \
            and text[end - len(_DIGEST) : end] == _DIGEST:
        return text[len(_BODY) : end - len(_DIGEST)]
    return None


class _Unread:
    """A parsed manifest's skeleton not yet taken out of its checked JSON."""

    __slots__ = ("text",)

    def __init__(self, text: bytes) -> None:
        self.text = text


class _Skeleton:
    """``Manifest.skeleton``, read from the manifest's JSON when first asked for. A restore
    reads every manifest of its steps' lineages but the skeleton of one: kept parsed, the
    others' lists and dicts were half the objects the lineage's manifests held, each walked by
    every full collection of Python's garbage collector while they lived (0.5 of them per
    restore of E's latest step, 42 ms each)."""

    def __get__(self, m: Manifest | None, owner: type | None = None) -> Any:
        if m is None:
            return self
        value = m.__dict__["_skeleton"]
        if type(value) is _Unread:  # the text was checked against the digest when parsed
            value = m.__dict__["_skeleton"] = json.loads(value.text)["body"]["skeleton"]
        return value

    def __set__(self, m: Manifest, value: Any) -> None:
        m.__dict__["_skeleton"] = value


Manifest.skeleton = _Skeleton()  # type: ignore[assignment]  # after @dataclass made __init__
_MANIFEST_FIELDS = fields(Manifest)
_RECORD_FIELDS = fields(Record)
_SECTION_FIELDS = fields(SectionRef)
_OPTIONAL = frozenset(("start", "grid", "scale", "bound", "error", "shard"))


def _record_body(r: Record) -> dict[str, Any]:
    """A record's JSON object: its fields in order, unset optional ones left out."""
    body: dict[str, Any] = {}
    for f in _RECORD_FIELDS:
        value = getattr(r, f.name)
        if f.name == "sections":
            value = {k: {g.name: getattr(s, g.name) for g in _SECTION_FIELDS}
                     for k, s in value.items()}
        elif value is None and f.name in _OPTIONAL:
            continue
        body[f.name] = value
    return body


def format_for(records: list[Record], sharded: bool = False) -> int:
    """The format a manifest of ``records`` is written in: the oldest that holds them (a
    re-base of an older step keeps its records' hashes, and so its format)."""
    if any(r.hash.startswith(XXH3) for r in records):
        return XXH3_FORMAT
    if sharded or any(r.shard is not None for r in records):
        return SHARDED_FORMAT
    return BOUNDED_FORMAT if any(r.bound is not None for r in records) else FRAMED_FORMAT


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def plain(data: bytes, *, step: int | None = None) -> bytes:
    """A manifest's JSON: ``data`` itself, or what its zstd frame holds (format 3 on), bounded
    by the size cap before anything is allocated."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise FormatError(f"manifest is {len(data)} bytes, above the {MAX_MANIFEST_BYTES} cap",
                          step=step)
    if not data.startswith(ZSTD_MAGIC):
        return data
    try:
        size = zstandard.get_frame_parameters(data).content_size
        if not 0 < size <= MAX_MANIFEST_BYTES:
            raise FormatError(f"manifest frame declares {size} bytes, outside the "
                              f"{MAX_MANIFEST_BYTES} cap", step=step)
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise FormatError(f"manifest frame cannot be decoded ({exc}; damaged)", step=step) from None
    if len(out) != size:
        raise FormatError("manifest frame decoded to another size than it declares", step=step)
    return out


def parse(data: bytes, *, step: int | None = None) -> Manifest:
    """Parse and check a manifest; anything malformed raises ``FormatError``."""
    framed, size = data.startswith(ZSTD_MAGIC), len(data)
    data = plain(data, step=step)
    try:
        outer = json.loads(data)
        body, digest = outer["body"], outer["blake2b"]
        # Hashed as written (``to_bytes`` writes the canonical form) rather than written out
        # again; the canonical form is made only where that fails (a damaged number may parse
        # as infinity, which the canonical form refuses).
        written = _written_body(data)
        matched = written is not None and content_hash(written) == digest
        if not matched:
            matched = content_hash(_canonical(body)) == digest
    except (ValueError, KeyError, TypeError, RecursionError):
        raise FormatError("manifest is not valid tpde JSON (truncated or damaged)", step=step) from None
    if not matched:
        raise FormatError("manifest digest does not match its content (damaged)", step=step)
    try:
        m = _build(body, step, _Unread(data))
        if framed and m.format < FRAMED_FORMAT:
            raise FormatError(f"format {m.format} manifest stored as a zstd frame", step=step)
        m.__dict__["_size"] = size
        return m
    except FormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FormatError(f"manifest has a missing or ill-typed field ({exc})", step=step) from None


def _int(value: Any, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"expected an integer in [{lo}, {hi}], got {value!r}")
    return value


def _build(b: dict[str, Any], step: int | None, skeleton: _Unread) -> Manifest:
    if _int(b["format"]) > FORMAT:
        raise FormatError(f"manifest format {b['format']} is newer than this tpde ({FORMAT}); "
                          "upgrade tpde to read it", step=step)
    m = Manifest(
        step=_int(b["step"]), keyframe=bool(b["keyframe"]), depth=_int(b["depth"]),
        parent=None if b["parent"] is None else _int(b["parent"]),
        blob=None if b["blob"] is None else str(b["blob"]), blob_size=_int(b["blob_size"]),
        created=float(b["created"]), seconds=float(b["seconds"]), skeleton=skeleton,
        records=[_record(r, b) for r in b["records"]], format=b["format"],
        origin=None if b.get("origin") is None else str(b["origin"]),
        shards=_shards(b.get("shards", [])),
        dcp=None if b.get("dcp") is None else dict(b["dcp"]),
    )
    if m.origin is not None and m.format < FRAMED_FORMAT:
        raise FormatError(f"format {m.format} manifest names an origin blob", step=step)
    if (m.shards or m.dcp is not None) and m.format < SHARDED_FORMAT:
        raise FormatError(f"format {m.format} manifest is sharded", step=step)
    if step is not None and m.step != step:
        raise FormatError(f"manifest says step {m.step} but is stored as step {step}", step=step)
    if len({r.name for r in m.records}) != len(m.records):
        raise FormatError("manifest names a tensor twice", step=m.step)
    _check_pieces(m)
    return m


def _check_pieces(m: Manifest) -> None:
    """Pieces of a span follow each other, end to end, with the span's dtype and device."""
    prev: Record | None = None
    for r in m.records:
        if r.start is not None and (m.format < PIECES_FORMAT
                                    or not r.name.endswith(f"/{r.start}") or not r.span):
            raise FormatError("not a valid piece of a span", step=m.step, tensor=r.name)
        if r.start:
            if prev is None or prev.start is None or r.start != prev.start + prev.numel \
                    or (r.span, r.dtype, r.device) != (prev.span, prev.dtype, prev.device):
                raise FormatError("piece does not continue the span before it", step=m.step,
                                  tensor=r.name)
            if r.start + r.numel > MAX_ELEMENTS:
                raise FormatError("span is larger than 2^48 elements", step=m.step,
                                  tensor=r.name)
        prev = r


def _shards(items: Any) -> list[dict[str, Any]]:
    if not isinstance(items, list):
        raise ValueError("shards is not a list")
    return [{"blob": str(s["blob"]), "size": _int(s["size"])} for s in items]


def _bound(d: Any) -> dict[str, float]:
    return quant.Bound.from_dict(d).as_dict()


def _errors(d: Any) -> dict[str, float]:
    if not isinstance(d, dict) or set(d) != {"abs", "rel"}:
        raise ValueError(f"not a record's errors: {d!r}")
    out = {k: float(v) for k, v in d.items()}
    if not all(0.0 <= v < float("inf") for v in out.values()):
        raise ValueError(f"errors out of range: {d!r}")
    return out


def _check_quant(rec: Record) -> None:
    if rec.dtype not in quant.FLOATS or rec.bound is None:
        raise FormatError(f"quant record of dtype {rec.dtype} or without a bound",
                          tensor=rec.name)
    ok = rec.scale is not None and 0.0 < rec.scale < float("inf")
    if rec.grid == "ulp":
        ok = ok and rec.scale == int(rec.scale) and 3 <= rec.scale < 2.0 ** 62
    elif rec.grid != "abs":
        ok = False
    if not ok or rec.residual is not None:
        raise FormatError(f"quant record with grid {rec.grid!r}, scale {rec.scale!r}",
                          tensor=rec.name)
    if ("fixes" in rec.sections) != ("exact" in rec.sections):
        raise FormatError("quant record has fixes without exact words, or the reverse",
                          tensor=rec.name)


_LEGACY_HASH, _XXH3_HASH = re.compile(r"[0-9a-f]{32}"), re.compile(r"xxh3:[0-9a-f]{32}")


@functools.lru_cache(maxsize=64)
def _is_device(name: str) -> bool:
    """Whether torch reads ``name`` as a device: asked once per name, not once per record."""
    try:
        torch.device(name)
    except (RuntimeError, ValueError):
        return False
    return True


def _sizes(values: Any) -> tuple[int, ...]:
    """A chunk table: positive integers, checked in C-level passes over the list rather than a
    call per entry (the tables were a tenth of a manifest's parse)."""
    if type(values) is not list or not set(map(type, values)) <= {int} \
            or values and not (1 <= min(values) and max(values) <= 1 << 62):
        raise ValueError(f"not a chunk table: {str(values)[:80]}")
    return tuple(values)


def _record(r: dict[str, Any], b: dict[str, Any]) -> Record:
    dt = dtypes.by_name(r["dtype"])
    rec = Record(
        name=str(r["name"]), dtype=dt.name, numel=_int(r["numel"], 0, MAX_ELEMENTS),
        device=str(r["device"]), codec=str(r["codec"]), hash=str(r["hash"]),
        ref=None if r["ref"] is None else _int(r["ref"]),
        residual=None if r["residual"] is None else str(r["residual"]),
        count=_int(r["count"], 0, MAX_ELEMENTS),
        start=None if r.get("start") is None else _int(r["start"], 0, MAX_ELEMENTS),
        grid=None if r.get("grid") is None else str(r["grid"]),
        scale=None if r.get("scale") is None else float(r["scale"]),
        bound=None if r.get("bound") is None else _bound(r["bound"]),
        error=None if r.get("error") is None else _errors(r["error"]),
        shard=None if r.get("shard") is None else _int(r["shard"]),
        sections={k: SectionRef(_int(s["offset"]), _int(s["raw"]), _int(s["chunk"]),
                                _sizes(s["frames"]))
                  for k, s in r["sections"].items()},
    )
    words = rec.numel * dt.words_per_element
    if not _is_device(rec.device):
        raise FormatError(f"record names device {rec.device!r}, which is no device",
                          tensor=rec.name)
    if rec.codec not in codec.CODECS or rec.residual not in (None, *transform.RESIDUALS):
        raise FormatError(f"unknown codec {rec.codec!r}/{rec.residual!r}", tensor=rec.name)
    if (rec.bound is not None or rec.error is not None) and b["format"] < BOUNDED_FORMAT:
        raise FormatError(f"format {b['format']} manifest holds an error bound", tensor=rec.name)
    if rec.error is not None and rec.bound is None:
        raise FormatError("record has errors but no bound", tensor=rec.name)
    legacy = _LEGACY_HASH.fullmatch(rec.hash) is not None
    if not legacy and (_XXH3_HASH.fullmatch(rec.hash) is None or b["format"] < XXH3_FORMAT):
        raise FormatError(f"record hash {rec.hash[:48]!r} is not one format {b['format']} "
                          "names", tensor=rec.name)
    shards = b.get("shards") or []
    if rec.shard is not None and (b["format"] < SHARDED_FORMAT or rec.shard >= len(shards)):
        raise FormatError(f"record names shard {rec.shard}, which the step does not have",
                          tensor=rec.name)
    blob_size = b["blob_size"] if rec.shard is None else shards[rec.shard]["size"]
    if rec.codec == "quant":
        _check_quant(rec)
    elif rec.grid is not None or rec.scale is not None:
        raise FormatError(f"{rec.codec} record names a grid", tensor=rec.name)
    keyed = rec.codec == "key" or (rec.codec == "quant" and rec.ref is None)
    if (rec.ref is None) != keyed or (rec.ref is not None and rec.ref >= b["step"]):
        raise FormatError("record's reference step is missing or not earlier", tensor=rec.name)
    if rec.count > words:
        raise FormatError("record claims more changed words than it has", tensor=rec.name)
    if rec.codec == "quant":
        expected = {"values": rec.count if "positions" in rec.sections else words}
        expected.update({k: None for k in ("positions", "fixes") if k in rec.sections})
        if "fixes" in rec.sections:
            expected["exact"] = rec.sections["exact"].raw // dt.word_bytes \
                if "exact" in rec.sections else 0
    elif rec.codec in ("key", "dense"):
        expected = {"values": words}
    else:
        expected = {"values": rec.count, "positions": None} if rec.codec == "sparse" else {}
    if set(rec.sections) != set(expected):
        raise FormatError(f"{rec.codec} record has sections {sorted(rec.sections)}",
                          tensor=rec.name)
    for name, sec in rec.sections.items():
        if name == "exact" and (expected[name] > words or sec.raw % dt.word_bytes):
            raise FormatError("exact words of a quant record are not whole words, or too many",
                              tensor=rec.name)
        limit = expected[name] * dt.word_bytes if expected[name] is not None \
            else 64 + 32 * (rec.count if name == "positions" else expected["exact"])
        frames.check_table(sec.raw, sec.chunk, sec.frames, limit=limit)
        if expected[name] is not None and sec.raw != limit:
            raise FormatError(f"section {name!r} holds {sec.raw} bytes, expected {limit}",
                              tensor=rec.name)
        if sec.offset + sec.length > blob_size:
            raise FormatError(f"section {name!r} lies outside the step's blob", tensor=rec.name)
    return rec
