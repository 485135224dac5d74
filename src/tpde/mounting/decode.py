"""A mounted step's modules, decoded: each module's records rebuilt (natively where it can be,
its packs once a forward), checked once where their compressed bytes are held, and viewed as
the module's tensors in the dtype and on the device the model asks for."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from tpde.chain import Chain, native, sharded, span_words
from tpde.errors import CorruptionError
from tpde.mounting import slots
from tpde.runtime import heap
from tpde.store.resident import ResidentStore

#: Free heap a mount at budget 0 lets build up beyond what it held after its last trim, looked
#: at once for every as many bytes of words rebuilt (``heap.Trims``). The Python path's trims
#: (``heap.freed``) ran several times a forward and handed back the rebuilds' buffers that
#: the next module faulted in again; at this size a mount trims about once, at its first
#: forward, and peaks lower (``benchmarks/mount_memory.py``).
KEEP_FREE_BYTES = 4 << 20


@dataclass
class MountStats:
    """What a mount decoded and held (bytes of decoded weights). ``decode_seconds`` is the wall
    time forwards spent getting their modules' weights, decoding them on the forward's thread
    or waiting for the worker's (on a CUDA device, until the kernels were queued): the part of
    the forwards that was not their compute, so that a mount's decode speed can be set beside
    the restore path's. Decodes the worker finished while a module computed cost nothing
    there. ``decoded_ahead`` counts the modules whose weights were decoded before their
    forward asked for them (``prefetch``)."""

    decodes: int = 0
    decoded_ahead: int = 0
    decoded_bytes: int = 0
    decode_seconds: float = 0.0
    hits: int = 0
    resident_bytes: int = 0
    held_compressed_bytes: int = 0
    modules: int = 0
    largest_module_bytes: int = 0
    order: list[str] = field(default_factory=list)


class ModuleDecoder:
    """Decodes the modules of a mounted step (``slots.layout``'s units).

    Args:
        chain: the run; with ``held`` its store is replaced by one holding every compressed
            section the units need.
        step: the mounted step.
        mounted: which records each unit needs, and how its tensors view them.
        on: where the kernels rebuild words (None: on the CPU).
        budget: the mount's budget (0: every module decoded on every forward, from an arena).
        held: read the compressed bytes once, now, instead of on every decode.
        stats: counted into.
    """

    def __init__(self, chain: Chain, step: int, mounted: slots.Layout, *,
                 on: torch.device | None, budget: int | None, held: bool,
                 stats: MountStats) -> None:
        self.chain, self.step, self.units, self.on, self.budget = \
            chain, step, mounted.units, on, budget
        self.stats, self.lock = stats, threading.Lock()
        self.sizes = {n: sum(s.nbytes for *_, s in v) for n, v in self.units.items()}
        largest = max(self.sizes.values(), default=0)
        #: At budget 0 every module is decoded on every forward: its words come from an arena
        #: whose pages stay faulted in, sized for the module in use and one decoded ahead
        #: within the largest module's room.
        self.arena = heap.Arena(2 * largest) \
            if budget == 0 and on is None and heap.ARENAS else None
        self._alloc = slots.in_arena(self.arena) if self.arena is not None else slots.in_heap
        self._trims = heap.Trims(every=KEEP_FREE_BYTES)
        #: Packs (small tensors stored together, ``tree.pack``): decoded once a forward, for
        #: every module with a tensor in them, not once for each (``pack_words``).
        self._pack_names = mounted.packs
        self._packs: dict[str, torch.Tensor] = {}
        self._packs_lock = threading.Lock()
        #: Each module's lineages that ``native.rebuild`` rebuilds in one call, worked out on
        #: its first decode (host words only).
        self.native: dict[str, dict[str, native.Lineage]] | None = \
            {} if on is None and native.available() else None
        self.held = held
        self._checked: set[str] = set()
        # Read-only, a module's records read by range (or from memory, where held).
        chain.read_through(ResidentStore(chain.store, self._hold() if held else {}))

    def _hold(self) -> dict[str, dict[tuple[int, int], bytes]]:
        """Read every compressed section the mounted tensors need, once, into memory."""
        wanted: dict[str, set[tuple[int, int]]] = {}
        steps: dict[str, int] = {}
        for owned in self.units.values():
            for name in {n for *_, slot in owned for n in slot.records}:
                for at, rec in self.chain.lineage(name, self.step):
                    if not rec.sections:
                        continue
                    blob = self.chain.manifest(at).blob_of(rec)
                    steps[blob] = at
                    for s in rec.sections.values():
                        wanted.setdefault(blob, set()).add((s.offset, s.offset + s.length))
        held: dict[str, dict[tuple[int, int], bytes]] = {}
        for blob, ranges in wanted.items():
            order = sorted(ranges)
            try:
                held[blob] = dict(zip(order, self.chain.store.read_ranges(blob, order)))
            except FileNotFoundError:
                raise CorruptionError(f"blob {blob} is missing", run=self.chain.url,
                                      step=steps[blob]) from None
            self.stats.held_compressed_bytes += sum(b - a for a, b in order)
        return held

    def decode(self, name: str, device: torch.device, cast: dict[torch.dtype, torch.dtype], *,
               team: bool = True, kept: bool = False) -> dict[str, torch.Tensor]:
        """``name``'s tensors on ``device``, each stored dtype as ``cast`` says; ``team``: on
        the forward's thread, whose OpenMP threads (torch's) may share a native rebuild (not
        on the worker's); ``kept``: handed out, so from the heap rather than the arena a
        forward's decodes take again and again."""
        owned = self.units[name]
        spans, into = ({}, {}) if self.on is not None else \
            slots.span_buffers(self.chain, self.step, owned,
                               slots.in_heap if kept else self._alloc)
        words = self._words(name, into, team, kept)
        out: dict[str, torch.Tensor] = {}
        for *_, s in owned:
            if s.records not in spans:  # tied tensors view one span: put it together once
                spans[s.records] = span_words(s.records, words) if s.dcp is None else \
                    sharded.assemble(self.chain.manifest(self.step), s.dcp, words)
            base = spans[s.records].view(torch.uint8).view(s.dtype)
            t = base.as_strided(s.shape, s.stride, s.offset)
            want = cast.get(s.dtype, s.dtype)
            out[s.key] = t.to(device, want) if device.type != "cpu" or want != s.dtype else t
        with self.lock:
            self.stats.decodes += 1
            self.stats.decoded_bytes += self.sizes[name]
        return out

    def _words(self, name: str, into: dict[str, torch.Tensor], team: bool, kept: bool
               ) -> dict[str, torch.Tensor]:
        """The words of ``name``'s records: natively where the host can, the rest (and what
        the native rebuild failed, which says where the chain is damaged) step by step."""
        alloc = slots.in_heap if kept else self._alloc
        # Held compressed bytes decode to what was checked the first time: check once.
        check = not (self.held and name in self._checked)
        names = {n for *_, s in self.units[name] for n in s.records}
        rest = names - self._pack_names
        words: dict[str, torch.Tensor] = {}
        if self.native is not None and rest:
            planned = self.native.get(name)
            if planned is None:
                planned = self.native[name] = native.lineages(self.chain, self.step, rest)
            words = native.rebuild(self.chain, planned, check=check, into=into,
                                   threads=torch.get_num_threads() if team else 1,
                                   alloc=alloc)
            if self.arena is not None and not kept:  # freed beside the arena's words
                self._trims.after(KEEP_FREE_BYTES, sum(planned[n].word_bytes for n in words))
            if len(words) < len(planned):  # worked out again on the next decode
                self.native.pop(name, None)
            rest = rest - words.keys()
        if rest:
            # At budget 0 memory comes first: one batch of a step at a time, not the next one
            # decompressed beside it.
            words.update(self.chain.materialize(self.step, rest, check=check, on=self.on,
                                                look_ahead=self.budget != 0, into=into,
                                                native=False))
        words.update(self.pack_words(names & self._pack_names, check))
        self._checked.add(name)
        return words

    def pack_words(self, names: set[str], check: bool) -> dict[str, torch.Tensor]:
        """The words of packs ``names``, decoded the first time a forward needs them and kept
        until it ends (``forget_packs``): a small model's biases and norms are one pack that
        most of its modules view."""
        with self._packs_lock:
            todo = names - self._packs.keys()
            if todo:
                self._packs.update(self.chain.materialize(self.step, todo, check=check,
                                                          on=self.on, look_ahead=False,
                                                          native=False))
            return {n: self._packs[n] for n in names}

    def forget_packs(self) -> None:
        """Let go of the packs' words (the modules that keep theirs view them)."""
        with self._packs_lock:
            self._packs.clear()
