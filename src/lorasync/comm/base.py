"""The contract between the trainer (or a user's loop) and a sync strategy.

A strategy owns how adapter gradients (or adapter weights) travel between
ranks.  Per-step strategies register a DDP comm hook, so their collectives run
inside DDP's buckets and overlap with the rest of the backward pass; periodic
strategies (local SGD, DiLoCo) do their work in ``after_step``.

Accounting rules every strategy follows (tests assert them):

* ``wire_bytes`` counts the bytes of every tensor this rank hands to a
  collective, at the dtype it is sent in (payload, not ring traffic: an
  all-reduce of P bytes moves about 2(n-1)/n * P per rank on a ring).  Every
  collective goes through the strategy's :class:`~lorasync.comm.wire.Wire`,
  which counts them as it hands them to torch.distributed.
* ``fp32_bytes`` is what plain fp32 all-reduce would have handed over for the
  same gradients, so ``fp32_bytes / wire_bytes`` is the compression ratio.
* ``comm_s`` is exposed waiting the trainer cannot see by itself: time
  waited inside ``after_step`` (periodic strategies, checkpoints) plus time a
  two-phase hook blocked *before* the last bucket became ready.  The time
  after that (waiting on the hook futures at the end of backward) is measured
  by the trainer from ``last_ready_time`` (perf_counter at entry of the last
  bucket hook, i.e. when local compute ended), so exposed sync time of a step
  = delta ``comm_s`` + (end of backward - ``last_ready_time``).
* ``encode_s`` is time spent compressing and decompressing, wherever it ran
  (hook, future callback or ``after_step``).

Collectives are only ever issued from the thread that runs the hooks (the
backward pass) or from ``after_step``, never from a future callback: two ranks
must issue collectives in the same order, and a callback runs whenever its
collective happens to finish.  (torch's PowerSGD hook issues and waits on its
second all-reduce inside a ``.then()`` callback and hangs on gloo when batch
shapes differ between ranks.)  Two-phase hooks therefore defer the second
phase of bucket i to the hook of bucket i+1, and finish the last bucket's
phases inside its own hook; see :class:`HookSync`.

State is kept per parameter (canonical order = ``ddp.module.parameters()``
that require grad), never per bucket: DDP rebuilds its buckets after the
first iteration (and a resumed run starts with the first-iteration layout
again), so nothing may depend on which bucket a gradient travels in.

Writing a strategy: add its entry (options, kind, byte formula) to
:mod:`lorasync.catalog`, then subclass :class:`HookSync` (gradients every
step) or :class:`Sync` (anything else) under the same ``name``, decorated
with :func:`register`.  What a subclass overrides is public and documented
on the two classes (``validate``, ``install``, ``setup``, ``encode_bucket``,
``phase1``, ``on_bucket``, ``in_warmup``, and the public API); what it shares
with the other strategies is public here too: :class:`Layout` (a bucket's
parameters and their offsets, with per-layout plans), :class:`Residual`
(error feedback kept per element), :data:`HOST`, :func:`to_device`,
:func:`completed` and :func:`comm_hook`.  The accounting helpers
(``_count``, ``_add_comm``, ``_add_encode``, ``_would_send_fp32``,
``_ready``) and the flat views (``_flat_params``, ``_set_flat_params``) are
called by a subclass on itself, never from outside.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from lorasync import catalog
from lorasync.comm.wire import Wire

__all__ = ["Sync", "HookSync", "register", "strategy_names", "get_strategy", "Layout",
           "Residual", "HOST", "to_device", "completed", "comm_hook"]

_REGISTRY: dict[str, type["Sync"]] = {}


def register(cls: type["Sync"]) -> type["Sync"]:
    """Class decorator: make a strategy available under ``cls.name``; its
    options, kind and byte formula are the catalog entry of that name."""
    cls.spec = catalog.spec(cls.name)
    _REGISTRY[cls.name] = cls
    return cls


def strategy_names() -> list[str]:
    return sorted(_REGISTRY)


def get_strategy(name: str) -> type["Sync"]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"strategy: unknown name {name!r}; choose one of {', '.join(strategy_names())}"
        ) from None


class Sync:
    """Base class of all strategies.

    Subclasses set ``name`` (their entry in :mod:`lorasync.catalog`, which
    holds their options, with defaults, ranges and help) and override:

    * :meth:`validate` (optional): checks the options alone cannot make;
    * :meth:`install` (required): register the DDP hook, or prepare the
      state a periodic strategy syncs in ``after_step``;
    * the public API as the strategy needs it: :meth:`after_step` (call
      ``super().after_step()`` first: it counts the step), :meth:`settle`,
      :meth:`finish`, :meth:`stats` (the accounting rules of the module
      docstring), :meth:`state_dict` / :meth:`load_state_dict` (extend the
      base's dict: it carries the checks a resume relies on), and
      ``in_flight``, ``in_flight_next_step``, ``replicas_may_differ`` where
      a sync outlives its step.

    ``attach()`` is the public way to build one.
    """

    name = "base"
    #: the catalog entry (set by ``register``)
    spec: catalog.Spec
    #: whether this strategy's group spans nodes (``attach`` sets it from the
    #: topology): its bytes count as inter-node bytes, else as intra-node ones
    spans_nodes = True
    #: "flat": collectives over all ranks of the group (Hierarchical: "hierarchical")
    layout = "flat"

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel,
                 process_group: dist.ProcessGroup | None = None, *,
                 _register_hook: bool = True, _wire=None, **options: Any):
        #: the validated options (the catalog's dataclass); ValueError naming
        #: ``STRATEGY.OPTION`` for an unknown option or a bad value
        self.options = catalog.parse_options(self.name, options)
        self.ddp = ddp
        self.group = process_group
        #: every collective goes through it (``_wire``: a LoopbackWire, to
        #: time the hooks alone; see lorasync.comm.loopback)
        self.wire = _wire if _wire is not None else Wire(process_group, self._count)
        self.world_size = self.wire.size
        self.rank = self.wire.rank
        self._given = frozenset(options)  # options the caller set explicitly
        self.params = [p for p in ddp.module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"{self.name}: the DDP module has no parameter that requires grad")
        # state and temporaries live where the gradients are (DDP's buckets)
        self.device = self.params[0].device
        self.fp32_param_bytes = sum(p.numel() for p in self.params) * 4
        # canonical flat layout of the trainable parameters (state lives here)
        self._pindex = {id(p): i for i, p in enumerate(self.params)}
        self._numels = [p.numel() for p in self.params]
        self._offsets = [0]
        for m in self._numels:
            self._offsets.append(self._offsets[-1] + m)
        self.numel = self._offsets[-1]
        # cumulative counters since attach; callbacks update them under the lock
        self._lock = threading.Lock()
        self._wire_bytes = 0
        self._fp32_bytes = 0
        self._comm_s = 0.0
        self._encode_s = 0.0
        self._steps = 0
        self._syncs = 0
        self.last_ready_time: float | None = None
        # False: a per-step strategy prepares its state but leaves the DDP hook
        # to its caller; ``auto`` (lorasync.comm.auto) builds its strategies so,
        # since DDP takes one comm hook per model, and hands each bucket to
        # the current one's ``on_bucket`` from its own hook
        self._register_hook = _register_hook
        self.validate()
        self.install()

    @property
    def per_step(self) -> bool:
        """Whether gradients travel every step through a DDP hook."""
        return self.spec.per_step

    @property
    def lossless(self) -> bool:
        """Whether replicas stay bit-identical after every optimizer step."""
        return self.spec.lossless

    @property
    def in_flight(self) -> bool:
        """Whether a sync launched in one ``after_step`` is still to be applied
        in a later one (a streamed outer sync); the same answer on every rank."""
        return False

    @property
    def in_flight_next_step(self) -> bool:
        """Whether one will still (or again) be in flight once the next step
        has ended, by the options' schedule; the same answer on every rank."""
        return False

    @property
    def grads_hold_momentum(self) -> bool:
        """Whether this step's backward left in ``.grad`` an averaged momentum
        that the strategy's own optimizer step consumes (1-bit Adam), not a
        gradient: a trainer must not clip or scale it."""
        return False

    @property
    def replicas_may_differ(self) -> bool:
        """Whether the ranks' adapters may differ now (local steps taken since
        the last sync: local SGD, DiLoCo); the same answer on every rank."""
        return False

    # -- hooks for subclasses -------------------------------------------------
    def validate(self) -> None:
        """What the options alone cannot tell (relations to the optimizer,
        the backend); raise ValueError.  Runs once, in the constructor,
        before :meth:`install`."""

    def install(self) -> None:
        """Set the strategy up, once, in the constructor: register a DDP
        comm hook (only when ``self._register_hook``: ``auto`` and
        ``Hierarchical`` call :meth:`HookSync.on_bucket` from their own
        hook) and allocate state.  :class:`HookSync` implements it."""
        raise NotImplementedError

    def _check_dtype(self, dtype: torch.dtype, option: str) -> None:
        """Fail early, with a ValueError, if the backend cannot all-reduce ``dtype``.

        One 1-element all-reduce at attach time (not counted in wire_bytes);
        every rank calls attach, so every rank takes part.
        """
        try:
            self.wire.all_reduce(torch.zeros(1, dtype=dtype, device=self.collective_device()),
                                 count=False)
        except (RuntimeError, ValueError, TypeError) as e:
            backend = self.wire.backend
            raise ValueError(
                f"{self.name}: {option}: backend {backend!r} cannot all-reduce {dtype} "
                f"({str(e).splitlines()[0][:120]}); use allreduce or int8 instead"
            ) from None

    def collective_device(self) -> torch.device:
        """Device for the collectives a strategy issues outside DDP's buckets
        (attach-time probes, averages, auto's measurements): the gradients'
        (what the collectives will carry), but NCCL takes CUDA tensors only."""
        if self.device.type == "cpu" and self.wire.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return self.device

    # -- accounting helpers ---------------------------------------------------
    def _count(self, nbytes: int) -> None:
        """What the wire handed to a collective (callbacks count too: locked)."""
        with self._lock:
            self._wire_bytes += nbytes

    def _would_send_fp32(self, numel: int) -> None:
        with self._lock:
            self._fp32_bytes += numel * 4

    def _add_encode(self, seconds: float) -> None:
        with self._lock:
            self._encode_s += seconds

    def _add_comm(self, seconds: float) -> None:
        with self._lock:
            self._comm_s += seconds

    def _ready(self) -> None:
        """Called at the entry of every bucket hook: marks when compute ended."""
        self.last_ready_time = time.perf_counter()

    # -- flat views of the trainable parameters -------------------------------
    def _flat_params(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    def _set_flat_params(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for p, a, b in zip(self.params, self._offsets, self._offsets[1:]):
                p.copy_(flat[a:b].view_as(p))

    # -- public API -----------------------------------------------------------
    def after_step(self) -> None:
        """Call once after every ``optimizer.step()``."""
        self._steps += 1

    def settle(self) -> None:
        """Wait until nothing this strategy sent is still in flight (counted
        in ``comm_s``), without applying anything early: what a trainer calls
        before work that is not training (an evaluation), so that a streamed
        sync does not get link time for free.  No-op for per-step strategies
        (their collectives end with the backward pass)."""

    def finish(self) -> None:
        """Make all replicas identical (end of training); no-op for per-step sync."""

    def stats(self) -> dict[str, float]:
        """Cumulative counters since attach."""
        with self._lock:
            return {
                "strategy": self.name,
                "wire_bytes": self._wire_bytes,
                "intra_bytes": 0 if self.spans_nodes else self._wire_bytes,
                "inter_bytes": self._wire_bytes if self.spans_nodes else 0,
                "fp32_bytes": self._fp32_bytes,
                "comm_s": self._comm_s,
                "encode_s": self._encode_s,
                "steps": self._steps,
                "syncs": self._syncs,
            }

    def state_dict(self) -> dict[str, Any]:
        """Per-rank state that must survive a restart (error feedback, outer optimizer)."""
        return {"name": self.name, "steps": self._steps, "world_size": self.world_size,
                "rank": self.rank, "numel": self.numel}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(
                f"state_dict: saved by strategy {state.get('name')!r}, "
                f"cannot load into {self.name!r}"
            )
        for key, mine in (("world_size", self.world_size), ("numel", self.numel)):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"state_dict: saved with {key}={state[key]}, this run has {key}={mine}; "
                    f"per-rank sync state cannot be re-mapped (start {self.name} fresh)"
                )
        self._steps = int(state.get("steps", 0))


class Layout:
    """One bucket layout: which parameters, at which offsets of the buffer."""

    __slots__ = ("id", "pids", "offsets", "numel", "cache")

    def __init__(self, lid: int, pids: tuple[int, ...], numels: list[int]):
        self.id = lid
        self.pids = pids
        self.offsets = [0]
        for i in pids:
            self.offsets.append(self.offsets[-1] + numels[i])
        self.numel = self.offsets[-1]
        self.cache: dict[Any, Any] = {}  # per-strategy precomputed indices, per device

    def plan(self, key: str, device: torch.device, build: Callable[[], Any]) -> Any:
        """A strategy's precomputed index tensors for this layout on ``device``:
        ``build()`` makes them on the host, once (cheap there, and no device
        syncs); each device gets its own copy, once."""
        plan = self.cache.get((key, device))
        if plan is None:
            plan = self.cache.get((key, HOST))
            if plan is None:
                plan = build()
            plan = self.cache[(key, device)] = to_device(plan, device)
        return plan


HOST = torch.device("cpu")


def to_device(v: Any, device: torch.device) -> Any:
    """``v`` with every tensor in it (nested in dicts, lists, tuples) on ``device``."""
    if isinstance(v, torch.Tensor):
        return v.to(device)
    if isinstance(v, dict):
        return {k: to_device(x, device) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(to_device(x, device) for x in v)
    return v


class Residual:
    """A per-element residual (error feedback) over the canonical flat
    parameters, kept in a bucket layout's own element order while in use.

    Hooks read and update the rows of their layout every step with no gather
    or scatter; the values move back to canonical order only when DDP changes
    layout (after its first iteration, after a resume) or for ``state``.  The
    canonical vector has one extra dump slot (index ``numel``) that padding
    maps to and that stays zero.

    It lives on the device of the ``cpos`` it is used with (``device`` at
    first; moved, once, if a layout on another device asks for rows);
    ``state`` returns a CPU copy and ``load`` takes values on any device.
    """

    def __init__(self, numel: int, nparams: int, device: torch.device | str = "cpu"):
        self.canon = torch.zeros(numel + 1, device=device)
        self._holder: list[int | None] = [None] * nparams   # layout id holding each param
        self._rows: dict[int, tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] = {}

    def rows(self, lay: "Layout", cpos: torch.Tensor) -> torch.Tensor:
        """The residual for ``lay`` in row order (``cpos``: canonical position
        of every row element, ``numel`` for padding); update it in place."""
        if cpos.device != self.canon.device:
            self._flush_all()  # back to canonical order, then move
            self.canon = self.canon.to(cpos.device)
        entry = self._rows.get(lay.id)
        if entry is not None:
            return entry[2]
        for other in {self._holder[i] for i in lay.pids} - {None}:
            self._flush(other)
        t = self.canon.index_select(0, cpos)
        self._rows[lay.id] = (lay.pids, cpos, t)
        for i in lay.pids:
            self._holder[i] = lay.id
        return t

    def _flush(self, lid: int) -> None:
        pids, cpos, t = self._rows.pop(lid)
        self.canon.index_copy_(0, cpos, t)
        self.canon[-1] = 0
        for i in pids:
            self._holder[i] = None

    def _flush_all(self) -> None:
        for lid in list(self._rows):
            self._flush(lid)

    def state(self) -> torch.Tensor:
        self._flush_all()
        return self.canon[:-1].to("cpu", copy=True)

    def load(self, values: torch.Tensor) -> None:
        self._rows.clear()
        self._holder = [None] * len(self._holder)
        self.canon[:-1].copy_(values.reshape(-1))
        self.canon[-1] = 0


class HookSync(Sync):
    """A strategy that sends gradients every step through a DDP comm hook.

    :meth:`install` is done here: it calls :meth:`setup` and registers
    :func:`comm_hook`.  A subclass overrides:

    * :meth:`setup` (optional): allocate its state (residuals, buffers);
    * one of the two ways a bucket travels:

      - :meth:`encode_bucket` (one collective, or several issued at once):
        return a future of the bucket's reduced (mean) gradient;
      - for a second collective that needs the first one's result, set
        ``two_phase = True`` and implement :meth:`phase1` instead;

    * :meth:`in_warmup` (optional): when a bucket goes as plain fp32
      (default: the first ``warmup_steps`` optimizer steps);
    * :meth:`on_bucket` only to wrap it (count or rewrite the bucket before
      the hook runs, then call ``super().on_bucket(bucket)``).

    ``communicates = False`` marks a hook that only notes readiness (the
    periodic strategies), so that a step without a sync is not counted as one.
    """

    two_phase = False
    #: False for hooks that only mark readiness (none, local, diloco)
    communicates = True

    def install(self) -> None:
        self._layouts: dict[tuple[int, ...], Layout] = {}
        self._bucket_numels: list[int] = []
        self._pending: tuple[Any, Callable[[], torch.futures.Future], torch.futures.Future] | None = None
        self.setup()
        if self._register_hook:
            self.ddp.register_comm_hook(self, comm_hook)

    def setup(self) -> None:
        """Allocate strategy state (after :meth:`validate`, before the hook
        is registered)."""

    @property
    def bucket_sizes(self) -> list[int]:
        """Numel of each bucket in the latest iteration (DDP's current layout)."""
        return list(self._bucket_numels)

    def bucket_layout(self, bucket: dist.GradBucket) -> Layout:
        """The :class:`Layout` of ``bucket`` (made once per layout), noting
        its size for :attr:`bucket_sizes`; call it once per bucket per step."""
        key = tuple(self._pindex[id(p)] for p in bucket.parameters())
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = Layout(len(self._layouts), key, self._numels)
        i = bucket.index()
        del self._bucket_numels[i:]
        self._bucket_numels.append(lay.numel)
        return lay

    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """What DDP's hook does with ``bucket``: mark when compute ended,
        count, and hand it to :meth:`encode_bucket` or :meth:`phase1`
        (``auto`` and ``Hierarchical`` call it from their own hook)."""
        self._ready()
        lay = self.bucket_layout(bucket)
        self._would_send_fp32(lay.numel)
        if bucket.is_last() and self.communicates:
            with self._lock:
                self._syncs += 1
        if self.in_warmup(bucket):
            return self._fp32_allreduce(bucket)
        if not self.two_phase:
            return self.encode_bucket(bucket, lay)
        if bucket.index() == 0 and self._pending is not None:
            # left over from a backward pass that never reached its last bucket
            self._pending[2].set_exception(RuntimeError("backward pass was abandoned"))
            self._pending = None
        # in the last bucket's hook this wait comes after last_ready_time, so
        # the trainer sees it already (end of backward - last_ready_time):
        # counting it in comm_s too would count it twice
        self._drain(last=bucket.is_last())
        out: torch.futures.Future = torch.futures.Future()
        fut, cont = self.phase1(bucket, lay)
        self._pending = (fut, cont, out)
        if bucket.is_last():
            self._drain(last=True)
        return out

    def _drain(self, last: bool) -> None:
        """Finish phase 1 of the pending bucket and launch its phase 2."""
        if self._pending is None:
            return
        fut, cont, out = self._pending
        self._pending = None
        try:
            t0 = time.perf_counter()
            fut.wait()
            if not last:
                # blocked before the last bucket was ready: the trainer cannot see it
                self._add_comm(time.perf_counter() - t0)
            fut2 = cont()
        except Exception as e:  # never leave DDP waiting on a future nobody completes
            out.set_exception(e)
            raise

        def _done(f: torch.futures.Future) -> None:
            try:
                out.set_result(f.value())
            except Exception as e:  # noqa: BLE001 - forwarded to DDP
                out.set_exception(e)

        fut2.then(_done)

    def in_warmup(self, bucket: dist.GradBucket) -> bool:
        """Whether this bucket goes as plain fp32 (``warmup_steps``)."""
        return self._steps < getattr(self.options, "warmup_steps", 0)

    def _fp32_allreduce(self, bucket: dist.GradBucket) -> torch.futures.Future:
        buf = bucket.buffer()
        # DDP's own reducer multiplies by 1/n (not divides by n): same bits as no hook
        buf.mul_(1.0 / self.world_size)
        fut = self.wire.all_reduce(buf, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    def encode_bucket(self, bucket: dist.GradBucket, lay: Layout) -> torch.futures.Future:
        """Send ``bucket`` (its parameters are ``lay``'s) and return a future
        of the averaged gradient buffer, the same bits on every rank.

        Runs on the hook thread: issue every collective here, through
        ``self.wire``; a future callback may decode but never issue or wait
        on a collective (module docstring).  State is per parameter
        (``lay.pids``, ``lay.offsets``), never per bucket."""
        raise NotImplementedError

    def phase1(self, bucket: dist.GradBucket, lay: Layout):
        """Two-phase schemes (``two_phase = True``): issue the first
        collective of ``bucket`` and return ``(future, continue_fn)``.

        ``continue_fn()`` runs on the hook thread once ``future`` is done (in
        the next bucket's hook, or in this one's when it is the last): it
        issues the second collective and returns a future of the averaged
        buffer.  The same rules as :meth:`encode_bucket` apply."""
        raise NotImplementedError

    def finish(self) -> None:
        if self._pending is not None:  # only after an abandoned backward
            self._pending[2].set_exception(RuntimeError("sync finished"))
            self._pending = None


def comm_hook(sync, bucket):
    """The DDP comm hook of every strategy: ``sync.on_bucket(bucket)``."""
    # No annotations: DDP compares them with dist.GradBucket / Future, and
    # ``from __future__ import annotations`` would turn them into strings.
    return sync.on_bucket(bucket)


def completed(value: Any) -> torch.futures.Future:
    """A future that is already done (for buckets that need no collective)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


HookFn = Callable[[Any, dist.GradBucket], torch.futures.Future]
