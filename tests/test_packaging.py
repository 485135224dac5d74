"""The package as users install it: a wheel built from the source tree, not the editable
install the other tests run against (which finds every module in the tree, listed in
``pyproject.toml`` or not).

The wheel must hold every module of ``src/tpde``, ``plugins`` and ``kernels`` where the
package maps them (and the ``py.typed`` marker that lets type checkers read tpde's
annotations), and a fresh interpreter must import all of them from the wheel alone and
save, restore and list a run through them.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Source folders and where ``pyproject.toml`` puts them in the package.
MAPPED = {"src/tpde": "tpde", "plugins": "tpde/plugins", "kernels": "tpde/kernels"}


def _modules_in_tree() -> set[str]:
    return {f"{dest}/{p.relative_to(ROOT / src).as_posix()}"
            for src, dest in MAPPED.items() for p in (ROOT / src).rglob("*.py")
            if "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A wheel built from a copy of the tracked sources (a build leaves its own folders
    behind, in the copy rather than in the tree)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "build")
    for folder in ("src", "plugins", "kernels"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    out = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(out), str(src)], check=True, timeout=600)
    (built,) = out.glob("tpde-*.whl")
    return built


def test_the_wheel_holds_every_module_of_the_tree(wheel: pathlib.Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        scripts = z.read(entry).decode()
    missing = sorted((_modules_in_tree() | {"tpde/py.typed"}) - names)
    assert not missing, f"modules left out of the wheel (add their packages to " \
                        f"pyproject.toml's [tool.setuptools] packages): {missing}"
    assert "tpde = tpde.cli:main" in scripts


def _alone(site: pathlib.Path) -> str:
    """The lines that make a fresh interpreter import tpde from ``site`` only: not through the
    editable install's finder, which maps the tree's own files."""
    return textwrap.dedent(f"""
        import sys
        sys.meta_path = [f for f in sys.meta_path if "editable" not in str(getattr(f, "__module__", ""))]
        sys.path.insert(0, {str(site)!r})
    """)


def test_a_run_is_saved_restored_and_listed_from_the_wheel_alone(wheel: pathlib.Path,
                                                                 tmp_path: pathlib.Path) -> None:
    """Installed by pip where no C compiler is found: a wheel needs none, and its extensions
    are the ones loaded."""
    unpacked = tmp_path / "site"
    bare = tmp_path / "bin"  # a PATH with the interpreter and nothing else: no cc, no gcc
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    env = {"PATH": str(bare), "CC": str(tmp_path / "no-compiler"), "HOME": str(tmp_path)}
    subprocess.run(["python", "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--no-compile", "--target", str(unpacked), str(wheel)],
                   check=True, env=env, timeout=300)
    assert shutil.which("cc", path=str(bare)) is None
    with zipfile.ZipFile(wheel) as z:
        modules = sorted(n[:-3].replace("/", ".").removesuffix(".__init__")
                         for n in z.namelist() if n.startswith("tpde/") and n.endswith(".py"))
    version = subprocess.run([sys.executable, "-c", _alone(unpacked) + "from tpde.cli import "
                              "main; main()", "--version"], capture_output=True, text=True,
                             timeout=300)
    assert version.returncode == 0 and "(C extensions built)" in version.stdout, version
    script = _alone(unpacked) + textwrap.dedent(f"""
        import importlib, json
        import torch
        import tpde
        from tpde.cli import main
        assert tpde.__file__.startswith({str(unpacked)!r}), tpde.__file__
        for name in {modules!r}:
            mod = importlib.import_module(name)
            assert mod.__file__.startswith({str(unpacked)!r}), mod.__file__
        run = {str(tmp_path / "run")!r}
        g = torch.Generator().manual_seed(0)
        w = torch.randn(4096, generator=g)
        ck = tpde.Checkpointer(run)
        ck.save(0, {{"w": w, "step": 0}})
        w1 = w + 1e-3 * torch.randn(4096, generator=g)
        ck.save(1, {{"w": w1, "step": 1}})
        ck.close()
        back = tpde.Checkpointer(run).load(1)
        assert back["step"] == 1 and torch.equal(back["w"], w1)
        sys.exit(main(["ls", run, "--json"]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert [s["step"] for s in listed["steps"]] == [0, 1]


def test_the_wheel_holds_built_stripped_extensions_not_their_sources(wheel: pathlib.Path
                                                                      ) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert not [n for n in names if n.endswith((".c", ".h"))]
        built = [n for n in names if n.endswith(".so")]
        assert built, "no extension was built (is a C compiler here?)"
        for name in built:
            assert b".debug_info" not in z.read(name), f"{name} is not stripped"
        assert any(n.endswith("licenses/LICENSE") for n in names)


def test_an_install_without_its_extensions_says_so_once_and_works(tmp_path: pathlib.Path
                                                                  ) -> None:
    """What an install made where no compiler was found holds: the modules, no extensions."""
    site = tmp_path / "site"
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.c", "*.h")
    for src, dest in MAPPED.items():
        shutil.copytree(ROOT / src, site / dest, ignore=skip)
    alone = _alone(site)
    version = subprocess.run([sys.executable, "-c", alone + "from tpde.cli import main; main()",
                              "--version"], capture_output=True, text=True, timeout=300)
    assert version.returncode == 0, version.stderr
    assert "without the C extensions _elias, _planes, _zframes, _rebuild" in version.stdout
    script = alone + textwrap.dedent(f"""
        import torch, tpde
        with tpde.Checkpointer({str(tmp_path / "run")!r}) as ck:
            ck.save(0, {{"w": torch.arange(4096.0)}})
            ck.save(1, {{"w": torch.arange(4096.0) + (torch.arange(4096) % 7 == 0)}})
        back = tpde.Checkpointer({str(tmp_path / "run")!r}).load(1)
        assert torch.equal(back["w"], torch.arange(4096.0) + (torch.arange(4096) % 7 == 0))
        assert tpde.__file__.startswith({str(site)!r})
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("installed without its C extension") == 1, done.stderr
    built = subprocess.run([sys.executable, "-m", "tpde.cli", "--version"],
                           capture_output=True, text=True, timeout=300)
    assert "C extensions built" in built.stdout, built.stdout
