"""The package's layers, read from the code's own imports: no module imports one of a layer
above its own, anywhere in the module (an import inside a function counts as much as one at
the top), and every module belongs to a layer, so a new one has to be placed.

From the bottom: what the process provides; the codec (pure, no I/O); the GPU kernels, which
plug into the codec; a state's structure; manifests; the store (all I/O); the chain; the front
ends (the API, entries, mounts) and, above them, the CLI and the framework adapters.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Source folders and the packages they are.
SOURCES = {"src/tpde": "tpde", "plugins": "tpde.plugins", "kernels": "tpde.kernels"}
#: Bottom first; a module may import from its own layer and those below.
LAYERS = [
    ("tpde.errors", "tpde.runtime"),
    ("tpde.codec",),
    ("tpde.kernels",),
    ("tpde.state",),
    ("tpde.manifest",),
    ("tpde.store",),
    ("tpde.chain",),
    ("tpde.api", "tpde.entries", "tpde.mounting"),
    ("tpde.cli", "tpde.plugins", "tpde.dcp", "tpde"),
]


def layer_of(module: str) -> int | None:
    """The layer of ``module``: that of the longest layer name it is, or lies under."""
    found: tuple[int, int] | None = None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and \
                    (found is None or len(name) > found[1]):
                found = (i, len(name))
    return None if found is None else found[0]


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for folder, package in SOURCES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts
                     if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def imports(path: pathlib.Path, module: str) -> list[tuple[str, int]]:
    """Every tpde module ``path`` imports, relative imports resolved, with its line."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # ``from tpde.codec import elias`` imports the module tpde.codec.elias
            found += [(base, node.lineno)] + [(f"{base}.{a.name}", node.lineno)
                                               for a in node.names]
    return [(m, line) for m, line in found if m == "tpde" or m.startswith("tpde.")]


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in modules() if layer_of(m) is None)
    assert not unplaced, f"place these modules in a layer of LAYERS: {unplaced}"


@pytest.mark.parametrize("module", sorted(modules()))
def test_no_import_runs_upward(module: str) -> None:
    path = modules()[module]
    mine = layer_of(module)
    upward = [f"{path.relative_to(ROOT)}:{line} imports {target}"
              for target, line in imports(path, module)
              if (theirs := layer_of(target)) is not None and mine is not None and theirs > mine]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("module", sorted(modules()))
def test_no_private_name_is_imported_from_another_module(module: str) -> None:
    """What a module keeps to itself (a leading underscore) stays there: other code, in its
    folder or not, reaches it only through names it offers."""
    path = modules()[module]
    private = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("tpde"):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    private.append(f"{path.relative_to(ROOT)}:{node.lineno} imports "
                                   f"{a.name} from {node.module}")
    assert not private, "\n".join(private)


def test_the_check_sees_an_upward_import(tmp_path: pathlib.Path) -> None:
    """The walk over imports finds one inside a function, and a relative one."""
    path = tmp_path / "encoder.py"
    path.write_text("def f():\n    from tpde.kernels import nvcomp\n\nfrom ..chain import plan\n")
    found = imports(path, "tpde.codec.encoder")
    assert ("tpde.kernels.nvcomp", 2) in found and ("tpde.chain.plan", 4) in found
    assert layer_of("tpde.kernels.nvcomp") > layer_of("tpde.codec.encoder")
    assert layer_of("tpde.chain.plan") > layer_of("tpde.codec.encoder")


def chain_imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """What ``path`` takes from the chain: a submodule it names (``tpde.chain.write``), or a
    name it imports from ``tpde.chain``, with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names
                      if a.name.startswith("tpde.chain.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("tpde.chain."):
                found.append((node.module, node.lineno))
            elif node.module == "tpde.chain":
                found += [(a.name, node.lineno) for a in node.names]
    return found


@pytest.mark.parametrize("module", sorted(m for m in modules()
                                          if layer_of(m) > layer_of("tpde.chain")))
def test_front_ends_use_only_what_the_chain_offers(module: str) -> None:
    """The API, entries, mounts, the CLI and the plugins reach the chain through the names in
    ``tpde.chain.__all__`` alone, never one of its modules' insides (the DCP writer once
    coded pieces with the chain writer's own functions)."""
    import tpde.chain

    path = modules()[module]
    inside = [f"{path.relative_to(ROOT)}:{line} imports {name}"
              for name, line in chain_imports(path) if name not in tpde.chain.__all__]
    assert not inside, "\n".join(inside)


def test_the_check_sees_a_chain_internal(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "dcp.py"
    path.write_text("from tpde.chain.write import put_sections\nfrom tpde.chain import Chain, "
                    "plan\nimport tpde.chain.save\n")
    import tpde.chain

    found = chain_imports(path)
    assert ("tpde.chain.write", 1) in found and ("tpde.chain.save", 3) in found
    assert [n for n, _ in found if n not in tpde.chain.__all__] == [
        "tpde.chain.write", "plan", "tpde.chain.save"]


@pytest.mark.parametrize("module", sorted(m for m in modules()
                                          if not m.startswith("tpde.store")))
def test_bytes_go_through_the_store_alone(module: str) -> None:
    """Only ``tpde.store`` reaches a filesystem: nothing else imports fsspec or uses a
    store's filesystem (``store.fs``), so every read and write has its retries and
    deadlines."""
    path = modules()[module]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {a.name}"
                      for a in node.names if a.name.split(".")[0] == "fsspec"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fsspec":
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}")
        elif isinstance(node, ast.Attribute) and node.attr == "fs" and \
                isinstance(node.value, ast.Attribute) and node.value.attr == "store":
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses a store's filesystem")
    assert not found, "\n".join(found)


def test_both_stores_implement_the_protocol_themselves() -> None:
    """``Store`` and a mount's ``ResidentStore`` each define every member of ``ByteStore``
    (no forwarding of whatever is asked for), and a mount's store refuses writes."""
    from tpde.errors import TPDEError
    from tpde.store.protocol import ByteStore
    from tpde.store.resident import ResidentStore
    from tpde.store.store import Store

    members = {n for n in dir(ByteStore) if not n.startswith("_")} | \
        set(ByteStore.__annotations__)
    store = Store("memory://tpde-protocol/run")
    resident = ResidentStore(store, {"b": {(0, 3): b"abc"}})
    for impl, obj in ((Store, store), (ResidentStore, resident)):
        assert isinstance(obj, ByteStore)
        assert "__getattr__" not in vars(impl)
        missing = [m for m in members if not hasattr(obj, m)]
        assert not missing, f"{impl.__name__} lacks {missing}"
    assert bytes(resident.read_range("b", 1, 3)) == b"bc"
    with pytest.raises(TPDEError, match="read-only"):
        resident.put_atomic("x", b"1")
    assert not store.exists("x")


def test_each_folder_says_what_it_may_import() -> None:
    """Every folder's ``__init__`` docstring ends with the packages its modules may import,
    and they are those of its layer and the layers below."""
    wrong = []
    for module, path in modules().items():
        if path.name != "__init__.py" or module == "tpde":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        said = doc.rpartition("May import:")[2].replace("\n", " ")
        named = {n.strip(" `.") for n in said.split(",")} if "May import:" in doc else None
        mine = layer_of(module)
        allowed = {n for names in LAYERS[: mine + 1] for n in names} - {module, "tpde"}
        if named != allowed:
            wrong.append(f"{path.relative_to(ROOT)} says {sorted(named or [])}, "
                         f"its layer allows {sorted(allowed)}")
    assert not wrong, "\n".join(wrong)
