"""What a manifest holds (its records and sections, by format) and how it is written: the
canonical JSON, its BLAKE2b digest, the zstd frame; and the hashes records keep of their
restored words. ``parse`` reads it back."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import xxhash
import zstandard

from tpde.codec import dtypes
from tpde.errors import FormatError

#: The newest format this tpde reads: format 7 adds packs (records holding many small spans
#: end to end, which the skeleton's tensors view by their ``part``), written by every save
#: that packs any. Format 6 names record hashes by their function (XXH3-128,
#: far faster than BLAKE2b, where a save hashes every byte once and a restore again), and
#: is written by every other new save. Format 5 adds sharded steps (records in several blobs,
#: one per rank that wrote them, and the ``torch.distributed.checkpoint`` metadata), written
#: only by sharded saves. Format 4 adds error-bounded records (the opt-in lossy mode), and is
#: written only by steps that hold a tensor saved under a bound, so that chains saved without
#: one stay readable by tpde releases that know format 3. Format 3: zstd-framed manifests that
#: may name an origin blob (re-based steps) and hold pieces. Formats 1 and 2 (plain JSON; 2
#: with pieces) are read as before.
FORMAT = 7
PIECES_FORMAT = 2
FRAMED_FORMAT = 3
BOUNDED_FORMAT = 4
SHARDED_FORMAT = 5
XXH3_FORMAT = 6
PACKED_FORMAT = 7
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
    at memory speed (BLAKE2b runs at a small fraction of it) and catches damage as surely; the manifest itself keeps its BLAKE2b digest."""
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


@dataclass(frozen=True)
class Record:
    """One stored span: what it is, how it was coded, where its bytes are. Frozen: its JSON
    is written once (``_record_json``) however many manifests carry it (a re-base rewrites a
    step's manifest, and those of the steps after it, with most records as they were)."""

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
    #: Format 7: a pack, and how many small spans of the checkpoint it holds end to end.
    parts: int | None = None

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


class Records(Sequence[Record]):
    """A read manifest's records, each built from its JSON and checked the first time it is
    asked for (``parse(..., lazy=True)``, as a chain's reader reads), then kept.

    A restore reads the manifest of every step its tensors' lineages pass through and uses a
    fraction of their records; parsed whole, the manifests took a large share of a Lightning
    chain's restore, most of it building and checking records (``benchmarks/README.md``).
    The manifest's digest still covers every byte of it when it is read, so only a record that
    no reader asks for goes unchecked.
    """

    __slots__ = ("_raw", "_index", "_build", "_built", "_digest")

    def __init__(self, raw: list[Any], index: dict[str, int], build: Callable[[Any], Record],
                 digest: str) -> None:
        #: Each record's JSON until it is built (then None: a long-lived chain keeps one copy).
        self._raw: list[Any] = raw
        self._index, self._build, self._digest = index, build, digest
        self._built: list[Record | None] = [None] * len(raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self._raw)))]
        rec = self._built[i]
        if rec is None:
            raw = self._raw[i]
            if raw is None:  # built by another thread since (a mount's prefetch)
                return self._built[i]
            rec = self._built[i] = self._build(raw)
            self._raw[i] = None  # after the record is there, for a thread reading both
        return rec

    def __iter__(self) -> Iterator[Record]:
        for i in range(len(self._raw)):
            yield self[i]

    def get(self, name: str) -> Record | None:
        """The record named ``name``, built alone (``Manifest.record``)."""
        i = self._index.get(name)
        return None if i is None else self[i]

    def named(self, names: Iterable[str]) -> list[Record]:
        """The records of ``names`` held here, in their order, each built alone."""
        return [self[i] for i in sorted({self._index[n] for n in names if n in self._index})]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Records):  # the same digest, the same manifest
            return self._digest == other._digest
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # compared as the list it stands for

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return list, (list(self),)  # pickled and copied as a list: the builder stays here


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
    records: list[Record] | Records
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
        """Summed once per list of records: a save asked it of the run's visible steps up to
        nine times."""
        held = self.__dict__.get("_raw_bytes")
        if held is None or held[0] is not self.records:
            held = self.__dict__["_raw_bytes"] = (self.records,
                                                  sum(r.raw_bytes for r in self.records))
        return held[1]

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

    def records_named(self, names: Iterable[str]) -> list[Record]:
        """The step's records of ``names`` (those it holds), in its order, found by name: a
        mount decodes a module's few records out of the step's hundreds, once a forward each,
        and going through all of them took a tenth of a small module's decode."""
        if isinstance(self.records, Records):
            return self.records.named(names)
        keep = set(names)
        return [r for r in self.records if r.name in keep]

    def _by_name(self) -> dict[str, Record] | Records:
        if isinstance(self.records, Records):
            return self.records  # looked up by name without building the others
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
        # What canonical(body) writes, each record's JSON written once (``_record_json``):
        # re-bases spent a large share of their time under the GIL writing records' JSON
        # again.
        canon = ("{" + ",".join(
            json.dumps(k) + ":" + ("[" + ",".join(map(_record_json, v)) + "]" if k == "records"
                                   else _json(v))
            for k, v in body.items()) + "}").encode()
        # What canonical({"body": body, "blake2b": digest}) writes, without a second pass.
        text = _BODY + canon + _DIGEST + content_hash(canon).encode() + b'"}'
        if self.format < FRAMED_FORMAT:
            return text
        return zstandard.ZstdCompressor(level=3, write_content_size=True).compress(text)


_BODY, _DIGEST = b'{"body":', b',"blake2b":"'  # a written manifest: _BODY body _DIGEST hex "}


def written_body(text: bytes) -> bytes | None:
    """The body's bytes as ``to_bytes`` wrote them (None: not laid out that way)."""
    end = len(text) - 2 * DIGEST_SIZE - 2
    if text.startswith(_BODY) and text.endswith(b'"}') \
            and text[end - len(_DIGEST) : end] == _DIGEST:
        return text[len(_BODY) : end - len(_DIGEST)]
    return None


class Unread:
    """A parsed manifest's skeleton not yet taken out of its checked JSON."""

    __slots__ = ("text",)

    def __init__(self, text: bytes) -> None:
        self.text = text


class _Skeleton:
    """``Manifest.skeleton``, read from the manifest's JSON when first asked for. A restore
    reads every manifest of its steps' lineages but the skeleton of one: kept parsed, the
    others' lists and dicts were half the objects the lineage's manifests held, each walked by
    every full collection of Python's garbage collector while they lived."""

    def __get__(self, m: Manifest | None, owner: type | None = None) -> Any:
        if m is None:
            return self
        value = m.__dict__["_skeleton"]
        if type(value) is Unread:  # the text was checked against the digest when parsed
            value = m.__dict__["_skeleton"] = json.loads(value.text)["body"]["skeleton"]
        return value

    def __set__(self, m: Manifest, value: Any) -> None:
        m.__dict__["_skeleton"] = value


Manifest.skeleton = _Skeleton()  # type: ignore[assignment]  # after @dataclass made __init__
_MANIFEST_FIELDS = fields(Manifest)
_RECORD_FIELDS = fields(Record)
_SECTION_FIELDS = fields(SectionRef)
_OPTIONAL = frozenset(("start", "grid", "scale", "bound", "error", "shard", "parts"))


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


def _record_json(r: Record) -> str:
    """A record's JSON (its ``_record_body``), written the first time it is asked for and kept
    with the (frozen) record."""
    text = r.__dict__.get("_json")
    if text is None:
        text = r.__dict__["_json"] = _record_text(r)
    return text


_STR = json.encoder.encode_basestring_ascii  # what json.dumps writes a str as
_OPTIONAL_IN_ORDER = tuple(f.name for f in _RECORD_FIELDS if f.name in _OPTIONAL)


def _record_text(r: Record) -> str:
    """``_json(_record_body(r))``, written field by field where every field has the plain type
    the writers give it. A save writes every record of its step anew, and a re-base every
    record it rewrites, several times faster so than through a dict and ``json.dumps``. (A
    field added to ``Record`` is added here too: ``test_manifest.py`` compares the two for any
    record.)"""
    if not (type(r.name) is type(r.dtype) is type(r.device) is type(r.codec) is type(r.hash)
            is str and type(r.numel) is type(r.count) is int
            and (r.ref is None or type(r.ref) is int)
            and (r.residual is None or type(r.residual) is str)
            and all(type(s.offset) is type(s.raw) is type(s.chunk) is int
                    and type(s.frames) is tuple and all(type(f) is int for f in s.frames)
                    for s in r.sections.values())):
        return _json(_record_body(r))
    sections = ",".join(
        f'{_STR(k)}:{{"offset":{s.offset},"raw":{s.raw},"chunk":{s.chunk},"frames":'
        f'[{",".join(map(str, s.frames))}]}}' for k, s in r.sections.items())
    text = (f'{{"name":{_STR(r.name)},"dtype":{_STR(r.dtype)},"numel":{r.numel},'
            f'"device":{_STR(r.device)},"codec":{_STR(r.codec)},"hash":{_STR(r.hash)},'
            f'"ref":{"null" if r.ref is None else r.ref},'
            f'"residual":{"null" if r.residual is None else _STR(r.residual)},'
            f'"count":{r.count},"sections":{{{sections}}}')
    for name in _OPTIONAL_IN_ORDER:
        value = getattr(r, name)
        if value is not None:
            text += f',"{name}":{_json(value)}'
    return text + "}"


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


def format_for(records: list[Record], sharded: bool = False) -> int:
    """The format a manifest of ``records`` is written in: the oldest that holds them (a
    re-base of an older step keeps its records' hashes, and so its format)."""
    if any(r.parts is not None for r in records):
        return PACKED_FORMAT
    if any(r.hash.startswith(XXH3) for r in records):
        return XXH3_FORMAT
    if sharded or any(r.shard is not None for r in records):
        return SHARDED_FORMAT
    return BOUNDED_FORMAT if any(r.bound is not None for r in records) else FRAMED_FORMAT


def canonical(obj: Any) -> bytes:
    return _json(obj).encode()
