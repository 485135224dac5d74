"""A plugin's account of what its saves and removals did: each save's report, the bytes its
removals freed, and what each folder holds at rest beside what ``TorchCheckpointIO`` would
hold for the same checkpoints, logged as it changes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tpde.api import StepInfo
from tpde.chain import Chain, GcReport

log = logging.getLogger("tpde.lightning")


@dataclass(frozen=True)
class SaveReport:
    """What one checkpoint cost: bytes, and how long the training loop waited for it."""

    path: str
    step: int
    keyframe: bool
    raw_bytes: int
    stored_bytes: int
    stall_ms: float  # the training thread: waiting for room, then the snapshot
    write_seconds: float  # the background: encode, upload, commit, entry
    codecs: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.raw_bytes / max(1, self.stored_bytes)


class Ledger:
    """The saves, freed bytes and bytes at rest of one plugin's runs."""

    def __init__(self) -> None:
        self.reports: list[SaveReport] = []
        self.freed_bytes = 0
        # Each run's visible steps (raw bytes, count) as last counted, kept up by its saves:
        # counting lists the run's steps, which made each save's log line O(steps).
        self._kept: dict[str, tuple[int, int]] = {}

    def saved(self, path: str, name: str, info: StepInfo, stall_ms: float,
              write_seconds: float) -> None:
        """Report the save of ``path`` (its entry ``name``) as step ``info.step``."""
        report = SaveReport(path, info.step, info.keyframe, info.raw_bytes, info.stored_bytes,
                            stall_ms, write_seconds, info.codecs)
        self.reports.append(report)
        log.info("tpde: %s -> step %d (%s): %.1f MB raw, %.1f MB stored (%.2fx); "
                 "training waited %.0f ms, written in %.2f s", name, info.step, "keyframe" if info.keyframe else "delta", info.raw_bytes / 1e6,
                 info.stored_bytes / 1e6, report.ratio, stall_ms, write_seconds)

    def collected(self, name: str, hidden: list[int], report: GcReport) -> None:
        """Report what the removal or replacement of the entry ``name`` hid and freed."""
        self.freed_bytes += report.freed_bytes
        log.info("tpde: %s replaced or removed; hid steps %s, re-based %s in %.2f s, "
                 "purged %s", name, hidden or "none", report.rebased_steps or "none",
                 report.rebase_seconds, report.purged_steps or "none (within the plain "
                 "format's bytes: freed when needed)")

    def at_rest(self, chain: Chain, held: int, added: int | None = None) -> None:
        """Log the run's ``held`` bytes at rest beside the tensor bytes that
        ``TorchCheckpointIO`` would hold for the same checkpoints (a lower bound of its files:
        pickling adds a little). ``added``: the raw bytes of a step just saved, where no other
        step changed."""
        kept = self._kept.get(chain.url) if added is not None else None
        if kept is None:
            steps = chain.steps()
            kept = (sum(chain.manifest(s).raw_bytes for s in steps), len(steps))
        else:
            kept = (kept[0] + added, kept[1] + 1)
        self._kept[chain.url] = kept
        plain, count = kept
        log.info("tpde: %s holds %.1f MB at rest for %d checkpoints; TorchCheckpointIO would "
                 "hold at least %.1f MB (%.2fx)", chain.url, held / 1e6, count,
                 plain / 1e6, plain / max(1, held))
