"""Two processes starting a save into one run at the same moment: one gets through, the other is
refused, nothing is lost or mixed. The quick version of ``campaigns/races.py`` (200 trials)."""

from __future__ import annotations

import os
import uuid

import pytest

import tpde
from campaigns.races import KINDS, campaign, state
from helpers import assert_same


def outcomes(seen, kind: str) -> dict[str, int]:
    return {said: n for (k, said), n in seen.items() if k == kind}


def test_racing_writers_on_local_disk(tmp_path) -> None:
    seen = campaign(lambda: (str(tmp_path / uuid.uuid4().hex[:10]), None), trials=6)
    for kind in KINDS:  # the campaign checked each trial; every kind ran them all
        assert sum(outcomes(seen, kind).values()) == 12 and outcomes(seen, kind)["ok"] == 6


@pytest.mark.s3
def test_racing_writers_on_s3(s3_server) -> None:
    seen = campaign(lambda: (f"s3://tpde/race-{uuid.uuid4().hex[:10]}", s3_server["options"]),
                    trials=2)
    for kind in KINDS:
        assert outcomes(seen, kind)["ok"] == 2


def test_a_commit_is_refused_where_another_writer_committed_the_step_meanwhile(tmp_path) -> None:
    """The interleaving a race can give, made certain: writer B commits step 1 after writer A
    checked that the step is free and before A commits it. A's save is refused and leaves no
    blob; the step is B's."""
    run = str(tmp_path / "run")
    with tpde.Checkpointer(run) as ck:
        ck.save(0, state(9, 0))
    a = tpde.Checkpointer(run, takeover=True)
    b = tpde.Checkpointer(run, takeover=True)
    commit = a.chain.writer.commit

    def late(m, *, new):
        b.save(1, state(1, 1))
        return commit(m, new=new)

    a.chain.writer.commit = late
    with pytest.raises(tpde.StepExistsError, match="committed by another writer"):
        a.save(1, state(0, 1))
    b.close()
    reader = tpde.Checkpointer(run)
    assert reader.steps() == [0, 1]
    assert_same(reader.load(1), state(1, 1))
    blobs = {reader.chain.manifest(s).blob for s in reader.steps()}
    assert set(os.listdir(tmp_path / "run" / "data")) == {b.rsplit("/", 1)[-1] for b in blobs}
