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
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from tpde.chain import Chain, whole
from tpde.entries import entry as entries
from tpde.errors import TPDEError
from tpde.mounting import slots
from tpde.mounting.decode import ModuleDecoder, MountStats
from tpde.mounting.weights import Weights
from tpde.runtime import frame_threads, heap

def _checked_settings(device: torch.device, budget: int | None, prefetch: int, resident: str,
                      decoder: str) -> torch.device | None:
    """A mount's settings checked; where the kernels rebuild its words (None: on the CPU)."""
    if budget is not None and (not whole(budget) or budget < 0):
        raise ValueError(f"budget must be None or bytes >= 0, got {budget!r}")
    if not whole(prefetch) or prefetch < 0:
        raise ValueError(f"prefetch must be a number of modules >= 0, got {prefetch!r}")
    if decoder not in ("auto", "cpu", "kernels"):
        raise ValueError('decoder must be "auto", "cpu" or "kernels"')
    if resident not in ("auto", "host", "store"):
        raise ValueError('resident must be "auto", "host" or "store"')
    kernels = decoder == "kernels" or (decoder == "auto" and device.type == "cuda")
    if kernels:  # only then: importing triton costs a CPU-only mount much memory
        from tpde.kernels import triton_kernels

        if decoder == "kernels" and not triton_kernels.available():
            raise TPDEError("decoder='kernels' needs triton (it ships with CUDA builds of "
                            "torch)")
        kernels = triton_kernels.available()
    return device if kernels else None


class Mount:
    """The controller behind a mounted model (``model.tpde_mount``)."""

    def __init__(self, chain: Chain, step: int, model: torch.nn.Module, *,
                 device: torch.device, budget: int | None, prefetch: int,
                 resident: str, units: tuple[type, ...] = (), decoder: str = "auto") -> None:
        #: Where words are rebuilt by the kernels (None: on the CPU, by tpde.codec.encoder).
        self.on = _checked_settings(device, budget, prefetch, resident, decoder)
        if resident == "auto":
            # At budget 0 memory comes first: compressed bytes held in memory would outweigh
            # the weights (a keyframe and its deltas), and a local run's are in the page cache.
            resident = "store" if budget == 0 and chain.store.local else "host"
        self.chain, self.step, self.model, self.device = chain, step, model, device
        self.budget, self.prefetch = budget, prefetch
        self.stats = MountStats()
        mounted = slots.layout(chain, step, model, units)
        self.units = mounted.units
        # What the chain does not hold (non-persistent buffers such as position ids) moves to
        # the device as it is.
        for key, buf in list(model.named_buffers()):
            if key not in mounted.stored and buf.device.type != "meta":
                owner, _, attr = key.rpartition(".")
                model.get_submodule(owner)._buffers[attr] = buf.to(device)
        self.names = list(self.units)
        self.decoder = ModuleDecoder(chain, step, mounted, on=self.on, budget=budget,
                                     held=resident == "host", stats=self.stats)
        self.sizes = self.decoder.sizes
        self.stats.modules = len(self.names)
        self.stats.largest_module_bytes = max(self.sizes.values(), default=0)
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._pending: dict[str, Future] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tpde-mount") if prefetch else None
        #: Prefetching on a CUDA device decodes on its own stream, beside the forward's.
        self._side = torch.cuda.Stream(device) if prefetch and device.type == "cuda" else None
        self.weights = Weights(chain.url, step, model, self.units, side=self._side)
        self._order: list[str] = list(self.names)
        self._learning: list[str] | None = []
        self._active: list[str] = []
        self._pinned: set[str] = set()
        # Each unit's forward is wrapped rather than hooked: PyTorch's fused fast paths
        # (nn.TransformerEncoderLayer's) switch themselves off when a module has hooks, and a
        # mounted model must compute exactly as the dense one does.
        self._wrapped: list[tuple[torch.nn.Module, Any]] = []
        self._hooks: list[Any] = []
        for name in self.names:
            self.weights.release(name)
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
        return self.decoder.decode(name, self.device, self.weights.cast, team=team, kept=kept)

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
            self.weights.unchanged(name)
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
                with self.decoder.lock:
                    self.stats.decode_seconds += time.perf_counter() - started
                self.weights.assign(name, tensors, self.device)
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
        self.decoder.forget_packs()
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
            self.weights.release(victim)
            released += self.sizes[victim]
        if released and self.on is None and self.decoder.arena is None:
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
            self.weights.unchanged(name)
            if name not in self._lru:
                self.weights.assign(name, self._decode(name, kept=True), self.device)
        return hook

    def _after_state_dict(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, state: dict, prefix: str, meta: dict) -> None:
            if name not in self._lru:  # the caller holds the weights now, not the mount
                self.weights.release(name)
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
            self.weights.release(name)
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
        self.weights.cast = {d: p.dtype for d, p in probes.items() if p.dtype != d}
        self.device = device
        self.weights.ghosts.clear()
        for name in self.names:
            self.weights.release(name)
        managed = {id(g) for g in self.weights.ghosts.values()}
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
