"""What a user meets on common mistakes and on damage: the ``tpde`` command run as a real
subprocess, one case per mistake. Exit status 1 for an error, 2 for wrong usage."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

import tpde
from forked import run_module


def tpde_cli(*argv: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    """``python -m tpde.cli ARGV...``, forked from a server that imported tpde once."""
    return run_module("tpde.cli", *argv, cwd=cwd)


@pytest.fixture()
def run(tmp_path) -> str:
    url = str(tmp_path / "run")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 128, generator=g)
    with tpde.Checkpointer(url, keyframe_every=8) as ck:
        for step in range(0, 50, 10):
            w[step // 10] += 1
            ck.save(step, {"model": {"w": w.clone()}, "step": step})
    return url


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_restore_to_a_folder_that_does_not_exist_fails_before_decoding(run, fmt) -> None:
    done = tpde_cli("restore", run, "--output", "/nonexistent/dir/x.pt", "--format", fmt)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "the folder '/nonexistent/dir' does not exist" in done.stderr


def test_a_malformed_storage_option_is_wrong_usage(run) -> None:
    done = tpde_cli("ls", run, "-o", "endpoint")
    assert done.returncode == 2 and "'endpoint' is not KEY=VALUE" in done.stderr


def test_gc_on_a_mistyped_path_writes_nothing(tmp_path) -> None:
    typo = tmp_path / "runn"
    done = tpde_cli("gc", str(typo))
    assert done.returncode == 1 and "no tpde chain here" in done.stderr
    assert not typo.exists()


@pytest.mark.s3
def test_gc_on_a_mistyped_s3_path_writes_nothing(s3_server) -> None:
    import s3fs

    options = s3_server["options"]
    endpoint = options["client_kwargs"]["endpoint_url"]
    typo = f"tpde/typo-{uuid.uuid4().hex[:8]}"
    done = tpde_cli("gc", f"s3://{typo}", "-o", f"client_kwargs.endpoint_url={endpoint}",
                    "-o", "key=testing", "-o", "secret=testing")
    assert done.returncode == 1 and "no tpde chain here" in done.stderr
    fs = s3fs.S3FileSystem(**options)
    assert not fs.find(typo)  # no lease.json written (and deleted) there


@pytest.mark.s3
def test_saving_into_a_bucket_that_does_not_exist_says_so(s3_server, tmp_path) -> None:
    options = s3_server["options"]
    with pytest.raises(tpde.StoreError, match=r"s3://no-such-bucket/run.*bucket does not "
                                              r"exist.*Create the bucket"):
        tpde.Checkpointer("s3://no-such-bucket/run", storage_options=options).save(
            0, {"w": torch.ones(4)})
    endpoint = options["client_kwargs"]["endpoint_url"]
    local = str(tmp_path / "run")
    with tpde.Checkpointer(local) as ck:
        ck.save(0, {"w": torch.ones(4)})
    done = tpde_cli("export", local, "--step", "0", "--to", "s3://no-such-bucket/copy",
                    "-o", f"client_kwargs.endpoint_url={endpoint}", "-o", "key=testing",
                    "-o", "secret=testing")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "Create the bucket" in done.stderr


def test_a_store_that_does_not_answer_is_named_as_typed(free_port) -> None:
    url = "s3://tpde/my-run"
    done = tpde_cli("ls", url, "-o", f"client_kwargs.endpoint_url=http://127.0.0.1:{free_port}",
                    "-o", "key=testing", "-o", "secret=testing")
    assert done.returncode == 1
    assert f"cannot open '{url}': nothing answers at its store" in done.stderr
    assert "client_kwargs.endpoint_url" in done.stderr


class Custom:
    """A class outside torch's weights-only allowlist, importable from this test module."""


def test_an_object_outside_the_allowlist_is_named(tmp_path) -> None:
    url = str(tmp_path / "run")
    with tpde.Checkpointer(url) as ck:
        ck.save(0, {"w": torch.ones(3), "extra": Custom()})
    done = tpde_cli("restore", url, "--output", str(tmp_path / "x.pt"))
    assert done.returncode == 1 and "\x1b[" not in done.stderr
    assert "test_cli_errors.Custom" in done.stderr and "add_safe_globals" in done.stderr
    assert "--trusted" in done.stderr


def test_trusted_restore_of_a_class_from_a_training_script_names_it(tmp_path) -> None:
    url = str(tmp_path / "run")
    script = (f"import torch, tpde\nclass Config: pass\n"
              f"with tpde.Checkpointer({url!r}) as ck:\n"
              f"    ck.save(0, {{'w': torch.ones(3), 'config': Config()}})\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    done = tpde_cli("restore", url, "--output", str(tmp_path / "x.pt"), "--trusted")
    assert done.returncode == 1 and "cannot be read (damaged?)" not in done.stderr
    assert "class Config from module '__main__'" in done.stderr


def test_a_damaged_run_is_listed_and_verified_with_a_summary(run) -> None:
    blobs = sorted(glob.glob(f"{run}/data/*"))
    raw = bytearray(open(blobs[1], "rb").read())  # step 10's data
    raw[-20] ^= 0xFF
    open(blobs[1], "wb").write(raw)
    open(sorted(glob.glob(f"{run}/steps/*"))[3], "wb").write(b"garbage")  # step 30's manifest

    listed = tpde_cli("ls", run, "--json")
    data = json.loads(listed.stdout)
    assert listed.returncode == 1
    assert [s["step"] for s in data["steps"]] == [0, 10, 20, 40]  # every readable step
    assert [d["step"] for d in data["damaged_steps"]] == [30]
    assert "DAMAGED" in tpde_cli("ls", run).stdout

    verified = tpde_cli("verify", run)
    assert verified.returncode == 1
    out = verified.stderr
    assert "fine: 1 (0)" in out and "damaged: 2 (10, 30)" in out
    assert "depend on a damaged step: 2 (20, 40)" in out
    assert f"tpde restore {run} --step 0" in out and "tpde export" in out
    assert len(out.splitlines()) < 20
    report = json.loads(tpde_cli("verify", run, "--json").stdout)
    assert (report["fine"], report["damaged"], report["depend_on_damaged"]) == (
        [0], [10, 30], [20, 40])
    assert len(tpde_cli("verify", run, "-v").stderr.splitlines()) > len(out.splitlines())


def test_a_message_names_its_location_once(run) -> None:
    blob = sorted(glob.glob(f"{run}/data/*"))[1]
    raw = bytearray(open(blob, "rb").read())
    raw[-20] ^= 0xFF
    open(blob, "wb").write(raw)
    done = tpde_cli("restore", run, "--step", "20", "--output", os.devnull + ".pt")
    assert done.returncode == 1 and done.stderr.count(f"run '{run}'") == 1, done.stderr
    assert "step 10" in done.stderr and "tensor 'model/w'" in done.stderr


def test_lightning_checkpoint_files_are_listed_and_taken_as_steps(tmp_path) -> None:
    pytest.importorskip("lightning", reason="needs Lightning: pip install 'tpde[dev]'")
    folder = tmp_path / "ckpts"
    plugin = tpde.TPDECheckpointIO()
    states = {}
    for i, global_step in enumerate((5, 10, 15)):
        states[global_step] = {"state_dict": {"w": torch.full((4,), float(i))},
                               "epoch": i, "global_step": global_step}
        plugin.save_checkpoint(states[global_step], str(folder / f"epoch={i}.ckpt"))
    plugin.remove_checkpoint(str(folder / "epoch=0.ckpt"))
    plugin.teardown()
    listed = json.loads(tpde_cli("ls", str(folder), "--json").stdout)
    assert [(e["name"], e["epoch"], e["global_step"]) for e in listed["entries"]] == [
        ("epoch=1.ckpt", 1, 10), ("epoch=2.ckpt", 2, 15)]
    out = tmp_path / "x.pt"
    assert tpde_cli("restore", str(folder), "--step", "epoch=2.ckpt", "--output",
                    str(out)).returncode == 0
    assert torch.load(out, weights_only=True)["global_step"] == 15
    missing = tpde_cli("info", str(folder), "--step", "epoch=0.ckpt")
    assert missing.returncode == 1 and "epoch=1.ckpt, epoch=2.ckpt" in missing.stderr
    # An entry given as the run restores its own step, not the run's latest.
    assert tpde_cli("restore", str(folder / "epoch=1.ckpt"), "--output",
                    str(out)).returncode == 0
    assert torch.load(out, weights_only=True)["global_step"] == 10


@pytest.mark.parametrize("command", ["ls", "info"])
def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path, command) -> None:
    url = str(tmp_path / "long")
    with tpde.Checkpointer(url) as ck:
        for step in range(30):  # 30 steps for ls, 40 tensors above the pack size for info
            ck.save(step, {f"t{i}": torch.full((2048,), float(step + i)) for i in range(40)})
    shell = (f"{sys.executable} -m tpde.cli {command} {url} | head -3; "
             'echo "status=${PIPESTATUS[0]}" >&2')
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr
    assert "status=0" in done.stderr and len(done.stdout.splitlines()) == 3


def test_verify_of_a_step_that_does_not_exist_says_so(run) -> None:
    done = tpde_cli("verify", run, "--step", "7")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "no step 7 in this run" in done.stderr and "damaged" not in done.stderr
    assert "tpde ls" in done.stderr


def test_load_with_a_step_that_is_not_a_number_is_refused(run) -> None:
    with pytest.raises(TypeError, match=r"step must be an int, not '10' \(str\)"):
        tpde.Checkpointer(run).load("10")


def test_tpde_dcp_is_there_after_import_tpde() -> None:
    done = subprocess.run([sys.executable, "-c", "import tpde; print(tpde.dcp.load_full)"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "function load_full" in done.stdout, done.stderr


def test_export_onto_a_step_the_target_holds_says_what_to_do_before_decoding(run,
                                                                            tmp_path) -> None:
    to = str(tmp_path / "exported")
    assert tpde_cli("export", run, "--step", "40", "--to", to).returncode == 0
    again = tpde_cli("export", run, "--step", "40", "--to", to)
    assert again.returncode == 1 and "Traceback" not in again.stderr
    assert f"{to} already holds a step 40" in again.stderr and "new --to folder" in again.stderr
    assert "remove()" not in again.stderr and "exporting" not in again.stderr
    assert tpde.Checkpointer(to).steps() == [40]
