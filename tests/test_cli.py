"""The tpde command line, run in-process through ``main`` and once as a real console script."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tpde
from helpers import assert_same
from tpde.cli import main


def states() -> dict[int, dict]:
    """What the run below saves at each step (recomputed here: the answers restores must give)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=g).bfloat16()
    out = {}
    for step in range(0, 50, 10):
        w.view(-1)[torch.randint(0, w.numel(), (300,), generator=g)] += 1
        out[step] = {"w": w.clone(), "frozen": torch.ones(1000), "step": step}
    return out


@pytest.fixture()
def run(tmp_path) -> str:
    url = str(tmp_path / "run")
    ck = tpde.Checkpointer(url, keyframe_every=3)
    for step, state in states().items():
        ck.save(step, state)
    ck.close()
    return url


def call(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_ls_json_lists_steps_codecs_and_ratio(run, capsys) -> None:
    code, out, _ = call(capsys, "ls", run, "--json")
    data = json.loads(out)
    assert code == 0 and [s["step"] for s in data["steps"]] == [0, 10, 20, 30, 40]
    # Keyframes are per tensor: the frozen tensor is stored once, so no later step is whole.
    assert [s["keyframe"] for s in data["steps"]] == [True, False, False, False, False]
    assert data["steps"][1]["codecs"] == {"sparse": 1, "same": 1}
    assert data["ratio"] > 1 and data["raw_bytes"] == 5 * (256 * 256 * 2 + 4000)
    on_disk = sum(os.path.getsize(p) for p in glob.glob(f"{run}/**/*", recursive=True)
                  if os.path.isfile(p))
    assert data["at_rest"]["total_bytes"] == on_disk
    assert data["at_rest"]["hidden_steps"] == [] and data["at_rest"]["leftover_bytes"] == 0
    code, out, _ = call(capsys, "ls", run)
    assert code == 0 and "delta<-0" in out and "total:" in out and "at rest:" in out


def test_ls_shows_what_hidden_steps_hold_and_why(run, capsys) -> None:
    ck = tpde.Checkpointer(run, keyframe_every=3)
    ck.chain.remove(10)  # hidden by hand, not yet collected: step 20's delta reads from it
    data = json.loads(call(capsys, "ls", run, "--json")[1])
    hidden = data["at_rest"]["hidden_steps"]
    assert [h["step"] for h in hidden] == [10] and hidden[0]["needed_by"] == [20]
    assert hidden[0]["bytes"] == sum(os.path.getsize(p) for p in glob.glob(f"{run}/*/*00010*"))
    assert "hidden step 10" in call(capsys, "ls", run)[1]
    ck.close()
    code, out, _ = call(capsys, "gc", run, "--json")  # re-bases 20 onto 0, frees 10
    assert code == 0 and json.loads(out)["rebased_steps"] == [20]
    data = json.loads(call(capsys, "ls", run, "--json")[1])
    assert data["at_rest"]["hidden_steps"] == [] and [s["step"] for s in data["steps"]] == [
        0, 20, 30, 40]
    assert tpde.Checkpointer(run).verify() == []


def test_info_reports_each_tensor(run, capsys) -> None:
    code, out, _ = call(capsys, "info", run, "--step", "10", "--json")
    tensors = {t["name"]: t for t in json.loads(out)["tensors"]}
    assert code == 0
    assert tensors["w"]["codec"] == "sparse" and 0 < tensors["w"]["density"] < 0.01
    assert tensors["frozen"]["codec"] == "same" and tensors["frozen"]["stored_bytes"] == 0
    code, out, _ = call(capsys, "info", run, "--json")  # no --step: the latest
    assert code == 0 and json.loads(out)["step"] == tpde.Checkpointer(run).latest()
    assert json.loads(out)["at_rest"]["total_bytes"] == sum(
        os.path.getsize(p) for p in glob.glob(f"{run}/**/*", recursive=True) if os.path.isfile(p))
    assert "at rest:" in call(capsys, "info", run)[1]


def test_info_says_what_a_restore_decodes(tmp_path, capsys) -> None:
    """Every delta on the way back to the keyframe, a step saved again adding none; against
    keyframes, one. The bytes are the records' of those steps, as each step's own rows give them."""
    g = torch.Generator().manual_seed(1)
    frozen = torch.ones(500)
    for against, on_way in (("previous", [0, 1, 2, 4]), ("keyframe", [0, 4])):
        url = str(tmp_path / against)
        ck = tpde.Checkpointer(url, keyframe_every=16, deltas_against=against)
        w = torch.randn(20_000, generator=g)
        for step in range(5):
            if step != 3:  # step 3 is step 2 saved again
                w = w + 1e-3 * torch.randn(w.shape, generator=g)
            ck.save(step, {"w": w, "frozen": frozen})
        ck.close()
        stored = {s: sum(t["stored_bytes"] for t in json.loads(
            call(capsys, "info", url, "--step", str(s), "--json")[1])["tensors"]) for s in range(5)}
        code, out, _ = call(capsys, "info", url, "--json")
        reads = json.loads(out)["restore"]
        assert code == 0 and reads["steps"] == on_way
        assert reads["records"] == len(on_way) + 1  # w at each step on the way, frozen at 0
        assert reads["deepest"] == len(on_way) - 1
        assert reads["stored_bytes"] == sum(stored[s] for s in on_way)
        text = call(capsys, "info", url)[1]
        assert f"at most {len(on_way) - 1} delta(s) deep" in text
        # Four dense deltas decode over twice the step's raw bytes; one does not.
        assert ("Deltas against keyframes" in text) == (against == "previous")
    os.remove(glob.glob(f"{tmp_path}/previous/steps/*1.json")[0])
    code, out, _ = call(capsys, "info", str(tmp_path / "previous"), "--step", "4", "--json")
    assert code == 0 and "step 1" in json.loads(out)["restore"]["error"]
    assert "a restore of this step fails" in call(
        capsys, "info", str(tmp_path / "previous"), "--step", "4")[1]


def test_restore_writes_plain_torch_and_safetensors_files(run, tmp_path, capsys) -> None:
    out = tmp_path / "s.pt"
    assert call(capsys, "restore", run, "--step", "20", "--output", str(out))[0] == 0
    assert_same(torch.load(out, weights_only=True), states()[20])
    st = tmp_path / "s.safetensors"
    assert call(capsys, "restore", run, "--output", str(st), "--format", "safetensors")[0] == 0
    from safetensors.torch import load_file

    saved = states()[40]
    tensors = {k: v for k, v in saved.items() if isinstance(v, torch.Tensor)}
    assert_same(dict(sorted(load_file(st).items())), dict(sorted(tensors.items())))  # unordered


def test_verify_exit_status_names_the_damaged_tensor(run, capsys) -> None:
    assert call(capsys, "verify", run)[0] == 0
    blob = sorted(glob.glob(f"{run}/data/*"))[1]  # step 10
    raw = bytearray(open(blob, "rb").read())
    raw[-10] ^= 0xFF
    open(blob, "wb").write(raw)
    code, out, _ = call(capsys, "verify", run, "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"]
    assert {(p["step"], p["tensor"]) for p in report["problems"]} == {(10, "w")}
    code, _, err = call(capsys, "verify", run, "--step", "0")
    assert code == 0  # the keyframe does not depend on step 10


def test_gc_reports_bytes_freed(run, capsys) -> None:
    chain = tpde.Checkpointer(run).chain
    for step in (0, 10, 20):
        chain.remove(step)  # hidden only: what `gc` then re-bases and frees
    code, out, _ = call(capsys, "gc", run, "--json", "--grace", "0")
    report = json.loads(out)
    assert code == 0 and report["purged_steps"] == [0, 10, 20] and report["freed_bytes"] > 0
    # The frozen tensor's keyframe moves to step 30; step 40 then reads it there.
    assert report["rebased_steps"] == [30, 40]
    assert chain.manifest(30).keyframe and tpde.Checkpointer(run).verify() == []


def test_gc_keeps_a_run_with_deltas_against_keyframes_one_delta_deep(tmp_path, capsys) -> None:
    """The run's marker, not the command line, says what a re-base codes against: `gc` re-keys
    the oldest kept step and codes the others against it, as the run's own writer would."""
    url = str(tmp_path / "run")
    g = torch.Generator().manual_seed(1)
    w, expected = torch.randn(4096, generator=g), {}
    with tpde.Checkpointer(url, deltas_against="keyframe") as ck:
        for step in range(5):
            w = w + 1e-3 * torch.randn(w.numel(), generator=g)
            expected[step] = {"w": w.clone()}
            ck.save(step, expected[step])
        ck.chain.remove(0)  # hidden only: left for `gc`
    del expected[0]
    code, out, _ = call(capsys, "ls", url, "--json")
    assert code == 0 and json.loads(out)["deltas_against"] == "keyframe"
    code, out, _ = call(capsys, "gc", url, "--json", "--grace", "0")
    assert code == 0 and json.loads(out)["rebased_steps"] == [1, 2, 3, 4]
    chain = tpde.Checkpointer(url).chain
    assert [r.ref for r in chain.manifest(1).records] == [None]
    assert {r.ref for s in (2, 3, 4) for r in chain.manifest(s).records} == {1}
    for step, state in expected.items():
        assert_same(state, chain.load(step)[0], f"step {step}")


def test_errors_exit_1_and_usage_exits_2(run, tmp_path, capsys) -> None:
    code, _, err = call(capsys, "info", run, "--step", "7")
    assert code == 1 and "step 7" in err
    code, out, _ = call(capsys, "ls", str(tmp_path / "nothing"), "--json")
    assert code == 1 and json.loads(out)["error"] == "NotARunError"
    with pytest.raises(SystemExit) as exc:
        main(["restore", run])  # no --output
    assert exc.value.code == 2


def test_console_script_help_on_every_command() -> None:
    # The script beside this interpreter: a virtual environment need not be on PATH.
    exe = shutil.which("tpde", path=str(Path(sys.executable).parent)) or shutil.which("tpde")
    assert exe, "the tpde console script is not installed"
    for command in ("ls", "info", "restore", "verify", "export", "gc", "repair"):
        done = subprocess.run([exe, command, "--help"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "--json" in done.stdout


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["ls", "--help"]])
def test_help_and_version_import_no_torch(argv) -> None:
    """What makes them answer at once: neither ``import tpde`` nor the CLI's parsing imports
    torch (or any command); a command imports it when it runs."""
    script = ("import sys\nfrom tpde.cli import main\ntry:\n    main(sys.argv[1:])\n"
              "except SystemExit as exc:\n    code = exc.code\n"
              "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('tpde.')))\n")
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    imported = done.stdout.strip().splitlines()[-1]
    # --version also says which C extensions load (they import neither torch nor numpy).
    shown = ["tpde.codec._elias", "tpde.codec._planes", "tpde.codec._rebuild",
             "tpde.codec._zframes"]
    extra = [m for m in shown if m in imported] + ["tpde.codec", "tpde.runtime",
                                                   "tpde.runtime.extensions"] \
        if argv == ["--version"] else []
    expected = sorted(["tpde.cli", "tpde.cli.main", "tpde.errors"] + extra)
    assert imported == str(expected), imported
    assert "tpde" in done.stdout


def test_the_public_names_load_when_used() -> None:
    """``import tpde`` is cheap, and every name of ``__all__`` (and the package's modules) is
    there when asked for; ``tpde.mount`` is the function, however its module was reached."""
    script = ("import importlib, tpde\n"
              "import tpde.mounting.model\n"
              "assert callable(tpde.mount) and tpde.mount.__module__ == 'tpde.mounting.model'\n"
              "assert all(getattr(tpde, n) is not None for n in tpde.__all__)\n"
              "assert tpde.store.store.Store and tpde.dcp.load_full\n"
              "try:\n    tpde.no_such_name\nexcept AttributeError as exc:\n"
              "    print('refused', exc)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "refused module 'tpde' has no attribute 'no_such_name'" in done.stdout


def _trained(tmp_path) -> tuple[str, torch.nn.Module, dict]:
    """A run in attach()'s layout: the model's weights beside the optimizer state."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(8, 16)).sum().backward()
    opt.step()
    state = {"model": net.state_dict(), "optimizer": opt.state_dict(), "step": 3}
    url = str(tmp_path / "run")
    with tpde.Checkpointer(url) as ck:
        ck.save(3, state)
    return url, net, state


def test_safetensors_restore_writes_the_model_weights(tmp_path) -> None:
    from safetensors.torch import load_file

    url, net, state = _trained(tmp_path)
    out = tmp_path / "model.safetensors"
    done = subprocess.run([sys.executable, "-m", "tpde.cli", "restore", url, "--format",
                           "safetensors", "--output", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "leaves out 'optimizer', 'step'" in done.stderr
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    fresh.load_state_dict(load_file(out))  # strict: exactly the keys the model expects
    assert_same(dict(fresh.state_dict()), dict(net.state_dict()))
    # Another part on request, with the same comparison against what was saved.
    part = tmp_path / "optimizer.pt"
    assert main(["restore", url, "--key", "optimizer", "--output", str(part), "-q"]) == 0
    assert_same(torch.load(part, weights_only=True), state["optimizer"])


def test_load_state_dict_decodes_only_the_model(tmp_path, monkeypatch) -> None:
    from tpde.chain.read import Reader

    url, net, _ = _trained(tmp_path)
    decoded: list[str] = []
    materialize = Reader.materialize

    def observed(self, step, names=None, **kwargs):
        decoded.extend(names if names is not None
                       else [r.name for r in self.run.manifest(step).records])
        return materialize(self, step, names, **kwargs)

    monkeypatch.setattr(Reader, "materialize", observed)
    assert_same(tpde.load_state_dict(url), net.state_dict())
    assert decoded and all(name.startswith("model/") for name in decoded), decoded
    decoded.clear()
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    assert_same(dict(tpde.load_state_dict(url, model=fresh)), dict(net.state_dict()))
    assert decoded and all(name.startswith("model/") for name in decoded), decoded
