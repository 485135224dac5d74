"""Reading a manifest back: ``plain`` takes its JSON out of its zstd frame and ``parse`` checks
its digest and every field it claims (counts, sizes, offsets, codecs, formats) before anything
is allocated from it, so that a damaged or hostile manifest is a ``FormatError`` that names
the step and tensor, never a wrong restore or an allocation it asked for."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import re
from typing import Any, Iterator

import torch
import zstandard

from tpde.codec import dtypes, encoder, quant, transform, unframe
from tpde.errors import FormatError
from tpde.manifest.model import (BOUNDED_FORMAT, FORMAT, FRAMED_FORMAT, MAX_ELEMENTS,
                                 MAX_MANIFEST_BYTES, PACKED_FORMAT, PIECES_FORMAT, SHARDED_FORMAT,
                                 XXH3_FORMAT, ZSTD_MAGIC, Manifest, Record, Records, SectionRef,
                                 Unread, canonical, content_hash, written_body)


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


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off, and left as it was found: around a parse,
    around a restore's walk through its tensors' lineages, which builds the records it uses
    (``Records``), and around a whole save, restore and removal (their records, sections and
    tasks). The collector is the process's: a save on a background thread holds it off for
    the training thread too, while the save lasts, and the collections it spares would have
    held the GIL the training thread waits for.

    A parse makes about a thousand containers (the JSON's dicts and lists), and they set off
    collections, now and then a full one, which walks every object torch holds. Records built
    as the walk asks for them, outside any pause, set off more again. Held off for the whole
    call, a save or a restore sets off a few collections instead of dozens
    (``benchmarks/README.md``)."""
    if not gc.isenabled():  # switched off by the program, or by an enclosing pause
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def parse(data: bytes, *, step: int | None = None, lazy: bool = False,
          run: str | None = None) -> Manifest:
    """Parse and check a manifest; anything malformed raises ``FormatError``.

    With ``lazy`` (what a chain's reader asks for) each record is built and checked the first
    time it is used (``Records``): a record that fails its checks raises then, naming ``run``,
    the step and the tensor, before anything is allocated from it."""
    with collector_paused():
        return _parse(data, step, lazy, run)


def _parse(data: bytes, step: int | None, lazy: bool, run: str | None) -> Manifest:
    framed, size = data.startswith(ZSTD_MAGIC), len(data)
    data = plain(data, step=step)
    try:
        outer = json.loads(data)
        body, digest = outer["body"], outer["blake2b"]
        # Hashed as written (``to_bytes`` writes the canonical form) rather than written out
        # again; the canonical form is made only where that fails (a damaged number may parse
        # as infinity, which the canonical form refuses).
        written = written_body(data)
        matched = written is not None and content_hash(written) == digest
        if not matched:
            matched = content_hash(canonical(body)) == digest
    except (ValueError, KeyError, TypeError, RecursionError):
        raise FormatError("manifest is not valid tpde JSON (truncated or damaged)", step=step) from None
    if not matched:
        raise FormatError("manifest digest does not match its content (damaged)", step=step)
    try:
        m = _build(body, step, Unread(data), digest if lazy else None, run)
        if framed and m.format < FRAMED_FORMAT:
            raise FormatError(f"format {m.format} manifest stored as a zstd frame", step=step)
        m.__dict__["_size"] = size
        return m
    except FormatError:
        raise
    except _ILL_TYPED as exc:
        raise _ill_typed(exc, step=step) from None


_ILL_TYPED = (KeyError, TypeError, ValueError, AttributeError)


def _ill_typed(exc: Exception, **where: Any) -> FormatError:
    return FormatError(f"manifest has a missing or ill-typed field ({exc})", **where)


def _int(value: Any, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"expected an integer in [{lo}, {hi}], got {value!r}")
    return value


def _build(b: dict[str, Any], step: int | None, skeleton: Unread, digest: str | None,
           run: str | None) -> Manifest:
    """The manifest of body ``b``; given its ``digest``, read lazily (``Records``)."""
    if _int(b["format"]) > FORMAT:
        raise FormatError(f"manifest format {b['format']} is newer than this tpde ({FORMAT}); "
                          "upgrade tpde to read it", step=step)
    raw, at = b["records"], _int(b["step"])
    if type(raw) is not list:
        raise ValueError("records is not a list")
    index = {str(r["name"]): i for i, r in enumerate(raw)}
    if digest is not None:  # what records' checks read of the body, not all (the skeleton)
        of = {k: b[k] for k in ("format", "step", "blob_size")} | {"shards": b.get("shards")}
        records: list[Record] | Records = Records(
            raw, index, functools.partial(_checked, b=of, step=at, run=run), digest)
    else:
        records = [_record(r, b) for r in raw]
    m = Manifest(
        step=at, keyframe=bool(b["keyframe"]), depth=_int(b["depth"]),
        parent=None if b["parent"] is None else _int(b["parent"]),
        blob=None if b["blob"] is None else str(b["blob"]), blob_size=_int(b["blob_size"]),
        created=float(b["created"]), seconds=float(b["seconds"]), skeleton=skeleton,
        records=records, format=b["format"],
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
    if len(index) != len(raw):
        raise FormatError("manifest names a tensor twice", step=m.step)
    _check_pieces(m, raw)
    return m


def _checked(r: Any, *, b: dict[str, Any], step: int, run: str | None) -> Record:
    """``_record`` for ``Records``: its errors name the run and step, as a parse's do."""
    try:
        return _record(r, b)
    except FormatError as exc:
        raise exc.located(run=run, step=step) from None
    except _ILL_TYPED as exc:
        raise _ill_typed(exc, run=run, step=step,
                         tensor=str(r.get("name")) if isinstance(r, dict) else None) from None


def _check_pieces(m: Manifest, raw: list[Any]) -> None:
    """Pieces of a span follow each other, end to end, with the span's dtype and device. Only
    pieces are built for it (``raw`` is the records' JSON): the others are not pieces."""
    prev: Record | None = None
    for i, item in enumerate(raw):
        if item.get("start") is None:
            prev = None
            continue
        r = m.records[i]
        if m.format < PIECES_FORMAT or not r.name.endswith(f"/{r.start}") or not r.span:
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
        parts=None if r.get("parts") is None else _int(r["parts"], 1, MAX_ELEMENTS),
        sections={k: SectionRef(_int(s["offset"]), _int(s["raw"]), _int(s["chunk"]),
                                _sizes(s["frames"]))
                  for k, s in r["sections"].items()},
    )
    words = rec.numel * dt.words_per_element
    if not _is_device(rec.device):
        raise FormatError(f"record names device {rec.device!r}, which is no device",
                          tensor=rec.name)
    if rec.codec not in encoder.CODECS or rec.residual not in (None, *transform.RESIDUALS):
        raise FormatError(f"unknown codec {rec.codec!r}/{rec.residual!r}", tensor=rec.name)
    if (rec.bound is not None or rec.error is not None) and b["format"] < BOUNDED_FORMAT:
        raise FormatError(f"format {b['format']} manifest holds an error bound", tensor=rec.name)
    if rec.parts is not None and (b["format"] < PACKED_FORMAT or rec.start is not None
                                  or rec.bound is not None):
        raise FormatError(f"format {b['format']} manifest holds a pack, or a pack is a piece or "
                          "error-bounded", tensor=rec.name)
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
        unframe.check_table(sec.raw, sec.chunk, sec.frames, limit=limit)
        if expected[name] is not None and sec.raw != limit:
            raise FormatError(f"section {name!r} holds {sec.raw} bytes, expected {limit}",
                              tensor=rec.name)
        if sec.offset + sec.length > blob_size:
            raise FormatError(f"section {name!r} lies outside the step's blob", tensor=rec.name)
    return rec
