"""Mount one step of a chain as a read-only model whose weights are decoded just in time.

Each module that owns stored tensors gets a forward pre-hook that decodes them (only the
records it needs, from their keyframe through the deltas up to the step) and a forward hook
that gives them back unless they fit in ``budget`` (the first modules of the execution order
stay; the others are released after use). With ``prefetch`` the next modules in execution
order are decoded on a worker thread (on a CUDA device, on a stream of its own) while the
current one is decoded and computes, within the budget plus the largest module. On a CUDA
device the words are rebuilt there: nvCOMP decompresses and Triton kernels do the rest
(``tpde.kernels.backend``). Nothing is ever written to the store. Which records each
module needs, and how its tensors view them, is worked out once, by ``tpde.mounting.slots``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tpde.chain import Chain, native, sharded, span_words, whole
from tpde.entries import entry as entries
from tpde.errors import CorruptionError, TPDEError
from tpde.mounting import slots
from tpde.runtime import frame_threads, heap
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


class Mount:
    """The controller behind a mounted model (``model.tpde_mount``)."""

    def __init__(self, chain: Chain, step: int, model: torch.nn.Module, *,
                 device: torch.device, budget: int | None, prefetch: int,
                 resident: str, units: tuple[type, ...] = (), decoder: str = "auto") -> None:
        if budget is not None and (not whole(budget) or budget < 0):
            raise ValueError(f"budget must be None or bytes >= 0, got {budget!r}")
        if not whole(prefetch) or prefetch < 0:
            raise ValueError(f"prefetch must be a number of modules >= 0, got {prefetch!r}")
        if decoder not in ("auto", "cpu", "kernels"):
            raise ValueError('decoder must be "auto", "cpu" or "kernels"')
        kernels = decoder == "kernels" or (decoder == "auto" and device.type == "cuda")
        if kernels:  # only then: importing triton costs a CPU-only mount much memory
            from tpde.kernels import triton_kernels

            if decoder == "kernels" and not triton_kernels.available():
                raise TPDEError("decoder='kernels' needs triton (it ships with CUDA builds of "
                                "torch)")
            kernels = triton_kernels.available()
        #: Where words are rebuilt by the kernels (None: on the CPU, by tpde.codec.encoder).
        self.on = device if kernels else None
        if resident not in ("auto", "host", "store"):
            raise ValueError('resident must be "auto", "host" or "store"')
        if resident == "auto":
            # At budget 0 memory comes first: compressed bytes held in memory would outweigh
            # the weights (a keyframe and its deltas), and a local run's are in the page cache.
            resident = "store" if budget == 0 and chain.store.local else "host"
        self.chain, self.step, self.model, self.device = chain, step, model, device
        self.budget, self.prefetch = budget, prefetch
        self.stats = MountStats()
        mounted = slots.plan(chain, step, model, units)
        #: Packs (small tensors stored together, ``tree.pack``): decoded once a forward, for
        #: every module with a tensor in them, not once for each (``_pack_words``).
        self._pack_names = mounted.packs
        self._packs: dict[str, torch.Tensor] = {}
        self._packs_lock = threading.Lock()
        self.units = mounted.units
        # What the chain does not hold (non-persistent buffers such as position ids) moves to
        # the device as it is.
        for key, buf in list(model.named_buffers()):
            if key not in mounted.stored and buf.device.type != "meta":
                owner, _, attr = key.rpartition(".")
                model.get_submodule(owner)._buffers[attr] = buf.to(device)
        self.names = list(self.units)
        self.sizes = {n: sum(s.nbytes for *_, s in v) for n, v in self.units.items()}
        self.stats.modules = len(self.names)
        self.stats.largest_module_bytes = max(self.sizes.values(), default=0)
        #: At budget 0 every module is decoded on every forward: its words come from an arena
        #: whose pages stay faulted in, sized for the module in use and one decoded ahead
        #: within the largest module's room.
        self._arena = heap.Arena(2 * self.stats.largest_module_bytes) \
            if budget == 0 and self.on is None and heap.ARENAS else None
        self._alloc = slots.in_arena(self._arena) if self._arena is not None else slots.in_heap
        self._trims = heap.Trims(every=KEEP_FREE_BYTES)
        self.held = resident == "host"
        self._checked: set[str] = set()
        if self.held:
            self._hold()
        else:
            self.chain.store.whole_blob_reads = False  # a module's records, by range
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tpde-mount") if prefetch else None
        #: Prefetching on a CUDA device decodes on its own stream, beside the forward's.
        self._side = torch.cuda.Stream(device) if prefetch and device.type == "cuda" else None
        self._order: list[str] = list(self.names)
        self._learning: list[str] | None = []
        #: Each module's lineages that ``native.rebuild`` rebuilds in one call, worked out on
        #: its first decode (host words only).
        self._native: dict[str, dict[str, native.Lineage]] | None = \
            {} if self.on is None and native.available() else None
        self._active: list[str] = []
        self._pinned: set[str] = set()
        # Each unit's forward is wrapped rather than hooked: PyTorch's fused fast paths
        # (nn.TransformerEncoderLayer's) switch themselves off when a module has hooks, and a
        # mounted model must compute exactly as the dense one does.
        self._wrapped: list[tuple[torch.nn.Module, Any]] = []
        #: Each owner's module, and each tensor's placeholder, looked up and made once: every
        #: forward at budget 0 assigns and releases every tensor.
        self._modules = {owner: model.get_submodule(owner)
                         for owned in self.units.values() for owner, *_ in owned}
        self._ghosts: dict[str, torch.Tensor] = {}
        #: Each stored dtype's dtype in the model (``model.to(torch.bfloat16)``, ``.half()``).
        self._cast: dict[torch.dtype, torch.dtype] = {}
        #: Each stored tensor's version counter as the mount left it: a write in place since
        #: is refused at the next forward (``_unchanged``).
        self._versions: dict[str, int] = {}
        self._hooks: list[Any] = []
        for name in self.names:
            self._release(name)
            unit = model.get_submodule(name)
            self._wrap(unit, self._pre(name), self._post(name))
            # ``state_dict()`` hands out the weights, decoded for it where none are held.
            self._hooks += [unit.register_state_dict_pre_hook(self._before_state_dict(name)),
                            unit.register_state_dict_post_hook(self._after_state_dict(name)),
                            unit.register_load_state_dict_pre_hook(self._refuse_load)]
        # A local run's blobs are opened once a forward on its thread, not once a module.
        self._wrap(model, None, self._learned, around=self.chain.store.kept_open)
        model._apply = self._apply

    # ------------------------------------------------------------------ decoding
    def _hold(self) -> None:
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
        self.chain.store = ResidentStore(self.chain.store, held)

    def _decode_ahead(self, name: str) -> dict[str, torch.Tensor]:
        """``_decode`` on the worker thread: on the side stream, done when it returns."""
        if self._side is None:
            return self._decode(name, team=False)
        with torch.cuda.stream(self._side):
            out = self._decode(name, team=False)
        self._side.synchronize()
        return out

    def _decode(self, name: str, team: bool = True, kept: bool = False
                ) -> dict[str, torch.Tensor]:
        """``name``'s tensors; ``team``: on the forward's thread, whose OpenMP threads (torch's)
        may share a native rebuild (not on the worker's); ``kept``: handed out, so from the
        heap rather than the arena a forward's decodes take again and again."""
        owned = self.units[name]
        alloc = slots.in_heap if kept else self._alloc
        # Held compressed bytes decode to what was checked the first time: check once.
        check = not (self.held and name in self._checked)
        spans, into = ({}, {}) if self.on is not None else \
            slots.span_buffers(self.chain, self.step, owned, alloc)
        names = {n for *_, s in owned for n in s.records}
        rest = names - self._pack_names
        words: dict[str, torch.Tensor] = {}
        if self._native is not None and rest:
            planned = self._native.get(name)
            if planned is None:
                planned = self._native[name] = native.plan(self.chain, self.step, rest)
            words = native.rebuild(self.chain, planned, check=check, into=into,
                                   threads=torch.get_num_threads() if team else 1,
                                   alloc=alloc)
            if self._arena is not None and not kept:  # what the rebuild freed beside the arena's words
                self._trims.after(KEEP_FREE_BYTES, sum(planned[n].word_bytes for n in words))
            if len(words) < len(planned):  # worked out again on the next decode
                self._native.pop(name, None)
            rest = rest - words.keys()
        if rest:
            # At budget 0 memory comes first: one batch of a step at a time, not the next one
            # decompressed beside it. A tensor the native rebuild failed is rebuilt here,
            # which says where the chain is damaged.
            words.update(self.chain.materialize(self.step, rest, check=check, on=self.on,
                                                look_ahead=self.budget != 0, into=into,
                                                native=False))
        words.update(self._pack_words(names & self._pack_names, check))
        self._checked.add(name)
        out: dict[str, torch.Tensor] = {}
        for *_, s in owned:
            if s.records not in spans:  # tied tensors view one span: put it together once
                spans[s.records] = span_words(s.records, words) if s.dcp is None else \
                    sharded.assemble(self.chain.manifest(self.step), s.dcp, words)
            base = spans[s.records].view(torch.uint8).view(s.dtype)
            t = base.as_strided(s.shape, s.stride, s.offset)
            want = self._cast.get(s.dtype, s.dtype)
            out[s.key] = t.to(self.device, want) if self.device.type != "cpu" or \
                want != s.dtype else t
        with self._lock:
            self.stats.decodes += 1
            self.stats.decoded_bytes += self.sizes[name]
        return out

    def _take(self, name: str, ahead: Future | None) -> dict[str, torch.Tensor]:
        """``name``'s weights, decoded here unless the worker has started on them. While it
        works on them, this thread decodes the modules queued after it that the worker has not
        reached, so that at budget 0 both threads decode."""
        if ahead is None or ahead.cancel():
            return self._decode(name)
        while not ahead.done():
            queued = next((n for n, f in self._pending.items() if f.cancel()), None)
            if queued is None:
                break
            here: Future = Future()
            here.set_result(self._decode(queued))
            self._pending[queued] = here
        self.stats.decoded_ahead += 1
        return ahead.result()

    def _pack_words(self, names: set[str], check: bool) -> dict[str, torch.Tensor]:
        """The words of packs ``names``, decoded the first time a forward needs them and kept
        until it ends (``_learned``): MiniLM's 58 biases and norms are one 91 KB pack that 45 of
        its modules view."""
        with self._packs_lock:
            todo = names - self._packs.keys()
            if todo:
                self._packs.update(self.chain.materialize(self.step, todo, check=check,
                                                          on=self.on, look_ahead=False,
                                                          native=False))
            return {n: self._packs[n] for n in names}

    def _assign(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        for owner, attr, is_param, s in self.units[name]:
            module, t = self._modules[owner], tensors[s.key]
            if self._side is not None:  # made on the side stream, read on this one
                t.record_stream(torch.cuda.current_stream(self.device))
            if is_param:
                t = module._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
            else:
                module._buffers[attr] = t
            self._versions[s.key] = t._version

    def _release(self, name: str) -> None:
        """Put shape-and-dtype placeholders (meta tensors, made once) back; the weights are
        freed."""
        for owner, attr, is_param, s in self.units[name]:
            ghost = self._ghosts.get(s.key)
            if ghost is None:
                ghost = torch.empty(s.shape, dtype=self._cast.get(s.dtype, s.dtype),
                                    device="meta")
                if is_param:
                    ghost = torch.nn.Parameter(ghost, requires_grad=False)
                self._ghosts[s.key] = ghost
            if is_param:
                self._modules[owner]._parameters[attr] = ghost
            else:
                self._modules[owner]._buffers[attr] = ghost
            self._versions[s.key] = ghost._version

    def _unchanged(self, name: str) -> None:
        """Refuse to compute with weights written in place since the mount set them: held
        ones would give outputs of weights the step does not hold, and placeholders' writes
        are lost at the next decode."""
        for owner, attr, is_param, s in self.units[name]:
            held = self._modules[owner]._parameters if is_param else self._modules[owner]._buffers
            t = held.get(attr)
            if t is None or t._version != self._versions.get(s.key):
                raise TPDEError(
                    f"the mounted weights are read-only, and {s.key!r} was changed in place "
                    "(or replaced): for weights of your own, load the step with "
                    "tpde.load_state_dict(run, step, model=...) instead of mounting it",
                    run=self.chain.url, step=self.step, tensor=s.key)

    def _resident(self) -> int:
        return sum(self.sizes[n] for n in self._lru) + sum(self.sizes[n] for n in self._pending)

    # ------------------------------------------------------------------ around forward
    def _wrap(self, module: torch.nn.Module, before: Callable[[], None] | None,
              after: Callable[[], None],
              around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
              ) -> None:
        """Run ``before`` and ``after`` around every call of ``module``'s forward, all of it
        within ``around()``."""
        inner = module.forward
        self._wrapped.append((module, module.__dict__.get("forward")))

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with around():
                try:  # ``after`` also when ``before`` fails: the module is no longer running
                    if before is not None:
                        before()
                    return inner(*args, **kwargs)
                finally:
                    after()

        module.forward = forward

    def _pre(self, name: str) -> Callable[[], None]:
        def hook() -> None:
            self._unchanged(name)
            self._active.append(name)
            if self._learning is not None and name not in self._learning:
                self._learning.append(name)
            if name in self._lru:
                self._lru.move_to_end(name)
                self.stats.hits += 1
                self._ahead(name)
            else:
                started = time.perf_counter()
                ahead = self._pending.pop(name, None)
                self._ahead(name, using=self.sizes[name])  # the worker goes on meanwhile
                tensors = self._take(name, ahead)
                with self._lock:
                    self.stats.decode_seconds += time.perf_counter() - started
                self._assign(name, tensors)
                self._lru[name] = None
            self.stats.resident_bytes = self._resident()
        return hook

    def _post(self, name: str) -> Callable[[], None]:
        def hook() -> None:
            if name in self._active:
                self._active.remove(name)
            self._evict()
        return hook

    def _learned(self) -> None:
        """After the first whole forward, prefetch in the order modules actually ran; after
        every forward, let go of the packs' words (the modules that keep theirs view them)."""
        with self._packs_lock:
            self._packs.clear()
        if self._learning is not None:
            seen = self._learning
            self._order = seen + [n for n in self.names if n not in seen]
            self.stats.order = list(self._order)
            self._learning = None
            # Every forward walks the modules in the same order, where least-recently-used
            # would evict exactly the module needed next: pin the first ones that fit instead.
            room = self.budget if self.budget is not None else 0
            for n in self._order:
                if self.sizes[n] <= room:
                    self._pinned.add(n)
                    room -= self.sizes[n]

    def _evict(self) -> None:
        if self.budget is None:
            return
        # Modules still running (the ancestors of the one that just finished) keep theirs;
        # pinned modules go last.
        idle = [n for n in self._lru if n not in self._active]
        released = 0
        for victim in [n for n in idle if n not in self._pinned] + \
                [n for n in idle if n in self._pinned]:
            if self._resident() <= self.budget:
                break
            del self._lru[victim]
            self._release(victim)
            released += self.sizes[victim]
        if released and self.on is None and self._arena is None:
            # Decodes free large buffers that glibc would otherwise keep: given back now and
            # then, so that a small budget bounds the process, not only the weights it holds.
            heap.freed(released)

    def _ahead(self, name: str, using: int = 0) -> None:
        """Queue the modules after ``name`` for the worker. Weights held, in use (``using``:
        ``name``'s, not yet held) and ahead stay within the budget plus the largest module,
        the bound a forward reaches anyway. On the CPU only when torch's intra-op threads
        leave the worker a CPU: where they take every one, those that wait for their next
        region spin on the worker's CPU, and a forward at budget 0 was slower with decodes
        ahead than without. The CPUs are counted each time: a process may
        be bound to its cores after its model was mounted."""
        if self._pool is None or (self.device.type == "cpu" and
                                  torch.get_num_threads() >= frame_threads.usable_cpus()):
            return
        room = None if self.budget is None else self.budget + self.stats.largest_module_bytes
        i = self._order.index(name) if name in self._order else -1
        for nxt in self._order[i + 1 : i + 1 + self.prefetch]:
            if nxt in self._lru or nxt in self._pending:
                continue
            if room is not None and self._resident() + using + self.sizes[nxt] > room:
                break
            self._pending[nxt] = self._pool.submit(self._decode_ahead, nxt)

    def _before_state_dict(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
            self._unchanged(name)
            if name not in self._lru:
                self._assign(name, self._decode(name, kept=True))
        return hook

    def _after_state_dict(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, state: dict, prefix: str, meta: dict) -> None:
            if name not in self._lru:  # the caller holds the weights now, not the mount
                self._release(name)
        return hook

    def _refuse_load(self, module: torch.nn.Module, *_: Any) -> None:
        raise TPDEError("a mounted model's weights are read-only: load_state_dict() would "
                        "write into them; build the model and load the state dict into it, or "
                        "mount the step holding those weights", run=self.chain.url,
                        step=self.step)

    def _settle(self) -> None:
        """Let go of every decoded weight and of the worker's queue."""
        for f in self._pending.values():
            if not f.cancel():
                with contextlib.suppress(Exception):
                    f.result()
        self._pending.clear()
        for name in list(self._lru):
            self._release(name)
        self._lru.clear()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
               ) -> torch.nn.Module:
        """``model.to(dtype)``, ``.half()``, ``.to(device)`` and the like on a mounted model:
        what ``fn`` makes of each stored dtype is what the weights are decoded to from then
        on; the tensors the chain does not hold are converted as torch would."""
        stored = {s.dtype for owned in self.units.values() for *_, s in owned}
        probes = {d: fn(torch.empty(0, dtype=d, device=self.device)) for d in stored}
        devices = {p.device for p in probes.values()}
        if len(devices) > 1:
            raise TPDEError("a mounted model's weights go to one device",
                            run=self.chain.url, step=self.step)
        device = devices.pop() if devices else self.device
        if self.on is not None and device != self.device:
            raise TPDEError(f"this mount rebuilds its weights on {self.device} with the "
                            f"kernels: mount again with device={str(device)!r}",
                            run=self.chain.url, step=self.step)
        self._settle()
        self._cast = {d: p.dtype for d, p in probes.items() if p.dtype != d}
        self.device = device
        self._ghosts.clear()
        for name in self.names:
            self._release(name)
        managed = {id(g) for g in self._ghosts.values()}
        for module in self.model.modules():
            for table in (module._parameters, module._buffers):
                for attr, t in table.items():
                    if t is not None and id(t) not in managed and t.device.type != "meta":
                        moved = fn(t)
                        table[attr] = torch.nn.Parameter(moved, t.requires_grad) \
                            if isinstance(t, torch.nn.Parameter) else moved
        return self.model

    def close(self) -> None:
        """Unwrap the forwards and free every decoded and held byte; the model keeps
        placeholders."""
        for module, own in reversed(self._wrapped):
            if own is None:
                del module.forward
            else:
                module.forward = own
        self._wrapped.clear()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.model.__dict__.pop("_apply", None)
        self._settle()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def mount(run: str, step: int | None = None,
          model: torch.nn.Module | Callable[[], torch.nn.Module] | None = None, *,
          device: str | torch.device | None = None, budget: int | None = None,
          prefetch: int = 4, resident: str = "auto", units: tuple[type, ...] = (),
          decoder: str = "auto", storage_options: dict[str, Any] | None = None
          ) -> torch.nn.Module:
    """``model`` with the weights of ``step``, each module's decoded just in time.

    ``step`` defaults to the entry's step when ``run`` is an entry, else the latest.

    ``run`` is a chain, a Lightning checkpoint folder or one of its entries. ``model`` (or a
    factory; a model built on the meta device works) must have the stored state dict's names,
    possibly under a prefix (``model.``) or container (``state_dict``). ``budget``: bytes of
    decoded weights kept between calls (None: all, 0: none). ``resident="host"`` reads the
    compressed bytes once at mount; ``"store"`` range-reads them on every decode; ``"auto"``
    is ``"store"`` for a local run at budget 0 and ``"host"`` otherwise. The model is
    for inference: parameters do not require grad, and the weights are read-only
    (``load_state_dict`` is refused, and a forward after a write in place raises).
    ``model.to(torch.bfloat16)``, ``.half()`` and ``.to(device)`` set what the weights are
    decoded to from then on. ``state_dict()`` holds every weight at any budget (those not
    held are decoded for it). ``model.tpde_mount`` has the stats and ``close()``.

    A module's weights are decoded when its own forward runs. Modules whose forward uses their
    children's weights directly are decoded whole: ``slots.UNITS`` (attention and transformer layers)
    plus the types in ``units`` (add yours, or the module that reuses a tied weight).

    ``prefetch``: how many modules ahead, in the order the first forward ran them, a worker
    thread decodes while the forward's thread decodes and computes the current one; with the
    weights in use they stay within ``budget`` plus the largest module. On the CPU it runs
    only where torch's intra-op threads leave a CPU free (``torch.set_num_threads``).

    ``decoder="auto"`` rebuilds the words on a CUDA device when triton is there (zstd by
    nvCOMP when the ``gpu`` extra is installed, the rest by Triton kernels), else on the CPU;
    ``"kernels"`` forces the kernels (on the CPU they need ``TRITON_INTERPRET=1`` and
    ``prefetch=0``, which is how they are tested without a GPU); ``"cpu"`` never uses them.

    Args:
        run: a chain, a Lightning checkpoint folder or one of its entries (path or URL).
        step: the step to mount; None is the entry's step, or the latest.
        model: the model, a factory of it, or one built on the meta device.
        device: where the weights are decoded and used; None is the model's own.
        budget: bytes of decoded weights kept between calls (None: all, 0: none).
        prefetch: modules decoded ahead by a worker thread.
        resident: ``"host"``, ``"store"`` or ``"auto"``: where the compressed bytes are read.
        units: module types decoded whole, beside ``slots.UNITS``.
        decoder: ``"auto"``, ``"kernels"`` or ``"cpu"``.
        storage_options: fsspec's options for the run's store.

    Returns:
        ``model``, mounted; ``model.tpde_mount`` is its ``Mount``.

    Example:
        >>> model = tpde.mount("runs/exp1", model=MyModel(), budget=200 << 20)
        >>> logits = model(batch)
        >>> model.tpde_mount.close()
    """
    if model is None:
        raise TypeError("mount needs the model (or a factory) whose weights the chain holds")
    module = model() if callable(model) and not isinstance(model, torch.nn.Module) else model
    chain, step = entries.open_step(run, step, storage_options)
    dev = torch.device(device if device is not None else
                       ("cuda" if torch.cuda.is_available() else "cpu"))
    module.eval()
    module.tpde_mount = Mount(chain, step, module, device=dev, budget=budget,
                              prefetch=prefetch, resident=resident, units=units, decoder=decoder)
    return module
