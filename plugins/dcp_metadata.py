"""DCP's metadata as the JSON of a sharded step's manifest, and back (``docs/format.md`` §12):
record names of chunks, the skeleton rebuilt from the planner's key paths, and
``torch.distributed.checkpoint.metadata.Metadata`` from and to plain JSON, so that a reader
unpickles nothing."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)

from tpde.codec import dtypes
from tpde.errors import FormatError, UnsupportedError


def chunk_name(fqn: str, offsets: Any, sizes: Any) -> str:
    """A chunk's record name: its tensor and the slice it covers, so that a chunk of another
    layout (another world size, another placement) is another record, coded as a keyframe."""
    return f"{fqn}[{','.join(f'{o}:{o + s}' for o, s in zip(offsets, sizes))}]"


def skeleton(md: Metadata) -> Any:
    """The nested layout the save planner flattened (its key paths), with each item a
    ``$dcp`` leaf: what lets every front end load a sharded step as a checkpoint."""
    paths = md.planner_data if isinstance(md.planner_data, dict) else {}
    root: dict[Any, Any] = {}
    for fqn, meta in md.state_dict_metadata.items():
        leaf: dict[str, Any] = {"$dcp": fqn}
        if isinstance(meta, TensorStorageMetadata):
            leaf["shape"] = list(meta.size)
        path = list(paths.get(fqn, (fqn,)))
        node: Any = root
        for key, nxt in zip(path, path[1:]):  # as DCP's set_element: ints make lists
            empty: Any = {} if isinstance(nxt, str) else []
            if isinstance(node, list):
                node.extend([None] * (key + 1 - len(node)))
                node[key] = node[key] if node[key] is not None else empty
            else:
                node.setdefault(key, empty)
            node = node[key]
        if isinstance(node, list):
            node.extend([None] * (path[-1] + 1 - len(node)))
        node[path[-1]] = leaf
    return _json(root)


def _json(node: Any) -> Any:
    """A nested layout in skeleton JSON: dicts with a key tpde's tags could take are tagged."""
    if isinstance(node, list):
        return [_json(v) for v in node]
    if isinstance(node, dict) and "$dcp" not in node:
        if any(str(k).startswith("$") for k in node):
            return {"$dict": [[k, _json(v)] for k, v in node.items()]}
        return {k: _json(v) for k, v in node.items()}
    return node


def to_json(md: Metadata, storage: dict[tuple[str, tuple[int, ...] | None], list[str]],
                   world_size: int) -> dict[str, Any]:
    """DCP's metadata in the manifest: tensors (dtype, size, chunks and the records of each),
    byte items, and the planner's key paths, so that a reader needs nothing pickled."""
    tensors, blobs = {}, {}
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, BytesStorageMetadata):
            blobs[fqn] = {"records": storage[(fqn, None)]}
            continue
        tensors[fqn] = {
            "dtype": dtypes.BY_TORCH[meta.properties.dtype].name,
            "size": list(meta.size), "requires_grad": bool(meta.properties.requires_grad),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes),
                        "records": storage[(fqn, tuple(c.offsets))]} for c in meta.chunks]}
    paths = md.planner_data
    if paths is not None:
        if not isinstance(paths, dict) or not all(
                isinstance(p, (tuple, list)) and all(isinstance(k, (str, int)) for k in p)
                for p in paths.values()):
            raise UnsupportedError("the save planner's planner_data is not a mapping of keys "
                                   "to key paths (DefaultSavePlanner's); tpde stores it as JSON")
        paths = {k: list(v) for k, v in paths.items()}
    return {"version": md.version, "world_size": world_size, "tensors": tensors,
            "bytes": blobs, "paths": paths,
            "modules": list(md.storage_meta.modules) if md.storage_meta else []}


def from_json(d: dict[str, Any], *, run: str, step: int) -> tuple[Metadata, dict[Any, list[str]]]:
    """DCP's ``Metadata`` back from the manifest, and the records of every stored item."""
    try:
        sd: dict[str, Any] = {}
        storage: dict[Any, list[str]] = {}
        for fqn, t in d["tensors"].items():
            chunks = []
            for c in t["chunks"]:
                chunks.append(ChunkStorageMetadata(torch.Size(c["offsets"]),
                                                   torch.Size(c["sizes"])))
                storage[MetadataIndex(fqn, c["offsets"])] = list(c["records"])
            sd[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=dtypes.by_name(t["dtype"]).torch_dtype,
                                 requires_grad=bool(t["requires_grad"])),
                torch.Size(t["size"]), chunks)
        for fqn, b in d["bytes"].items():
            sd[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = list(b["records"])
        paths = d["paths"]
        planner_data = None if paths is None else {k: tuple(v) for k, v in paths.items()}
        meta = Metadata(state_dict_metadata=sd, planner_data=planner_data,
                        storage_data=storage, version=d.get("version"),
                        storage_meta=StorageMeta(checkpoint_id=run,
                                                 modules=list(d.get("modules", []))))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FormatError(f"the step's DCP metadata is malformed ({exc})", run=run,
                          step=step) from None
    return meta, storage
