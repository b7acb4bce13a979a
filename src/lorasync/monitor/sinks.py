"""Live metric sinks the trainer feeds every step: TensorBoard and Prometheus.

The trainer calls::

    sinks = open_sinks(run_dir, rank=rank, world_size=world, tensorboard=True,
                       metrics_port=9400, store=dist.distributed_c10d._get_default_store())
    try:
        for step ...:
            sinks.write(record)      # every rank, once per step, its metrics record
    finally:
        sinks.close()

TensorBoard (``tensorboard=True``): rank 0 writes event files under
``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR/tensorboard``).
Its scalars are rank 0's; ``throughput/samples_per_s`` is rank 0's samples
x world size / rank 0's step time, which is the global rate because every
rank waits for the others at each sync.  Strategy switches appear as the
``comm/strategy_switch`` scalar (1 at the step that ran the new strategy) and
as text under ``strategy``.  On resume, events from steps at or after the
first step written are hidden (SummaryWriter's ``purge_step``), so re-run
steps do not show twice.

Prometheus (``metrics_port > 0``): rank 0 serves ``/metrics`` on
``metrics_host:metrics_port``.  The default host is 127.0.0.1, reachable only
from the machine itself (safe on a shared node: the endpoint has no
authentication); pass ``metrics_host="0.0.0.0"`` for a Prometheus server
scraping from elsewhere.  Values are aggregated over ranks: each rank puts
its latest record in the c10d store the trainer passes in (key
``lorasync/metrics/{rank}``, from a background thread over the store's own
connection, so a slow link never delays a step), and rank 0 reads them when
scraped.  Exposed (``{rank}`` means one series per rank):

    lorasync_step                     rank 0's latest step
    lorasync_rank_step{rank}          each rank's latest step (a lagging or dead rank shows)
    lorasync_ranks_reporting          ranks whose record was found
    lorasync_loss{rank}               training loss of the latest step
    lorasync_samples_per_second       global: sum of samples / slowest step time
    lorasync_sync_share               global: exposed sync time / step time, all ranks
    lorasync_compute_seconds{rank}    compute time of the latest step
    lorasync_comm_seconds{rank}       exposed sync time of the latest step
    lorasync_step_seconds{rank}       wall time of the latest step
    lorasync_wire_bytes_total{rank}   counter: bytes handed to collectives
    lorasync_samples_total{rank}      counter: examples processed
    lorasync_learning_rate            rank 0's
    lorasync_strategy_info{strategy}  1 for the strategy rank 0 runs now
    lorasync_strategy_switches_total  counter: strategy changes seen by rank 0

Counters start at 0 in each process (Prometheus' ``rate()`` handles the reset
of a resumed run).  With ``store=None`` (one process) only rank 0's own
record is exposed.
"""

from __future__ import annotations

import errno
import json
import math
import os
import socket
import threading
import warnings

from lorasync.errors import LorasyncError

__all__ = ["open_sinks", "Sinks", "STORE_PREFIX"]

STORE_PREFIX = "lorasync/metrics/"


def open_sinks(run_dir: str, *, rank: int, world_size: int, tensorboard: bool,
               metrics_port: int, store=None, metrics_host: str = "127.0.0.1") -> "Sinks":
    """Open the sinks this rank needs; raises ``LorasyncError`` (missing
    package, port in use) before training starts."""
    if metrics_port < 0 or metrics_port > 65535:
        raise LorasyncError(f"metrics_port: invalid value {metrics_port!r}: use 1-65535, or 0 "
                            "for no Prometheus endpoint")
    sinks = Sinks(rank, world_size)
    try:
        if tensorboard and rank == 0:
            sinks._tb = _TensorBoard(os.path.join(run_dir, "tensorboard"), world_size)
        if metrics_port:
            if rank == 0:
                sinks._server = _PrometheusServer(sinks, store, world_size, metrics_host,
                                                  metrics_port)
            elif store is not None:
                sinks._publisher = _Publisher(store, f"{STORE_PREFIX}{rank}")
    except BaseException:
        sinks.close()
        raise
    return sinks


class Sinks:
    """The sinks of one rank; ``write`` once per step, ``close`` in ``finally``."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self._tb: _TensorBoard | None = None
        self._server: _PrometheusServer | None = None
        self._publisher: _Publisher | None = None
        self._lock = threading.Lock()
        self._latest: dict | None = None
        self._wire_total = 0
        self._samples_total = 0
        self._switches = 0
        self._strategy = None

    def write(self, record: dict) -> None:
        """Hand this rank's step record to the sinks (never blocks on the network)."""
        if "eval_loss" in record and "rank" not in record:  # an evals.jsonl record
            if self._tb is not None:
                self._tb.write_eval(record)
            return
        strategy = record.get("strategy")
        if record.get("switch") or (self._strategy is not None and strategy is not None
                                    and strategy != self._strategy):
            self._switches += 1
        if strategy is not None:
            self._strategy = strategy
        self._wire_total += int(record.get("wire_bytes") or 0)
        self._samples_total += int(record.get("samples") or 0)
        latest = dict(record, wire_bytes_total=self._wire_total,
                      samples_total=self._samples_total, switches_total=self._switches)
        with self._lock:
            self._latest = latest
        if self._publisher is not None:
            self._publisher.offer(json.dumps(latest))
        if self._tb is not None:
            self._tb.write(record)

    def latest(self) -> dict | None:
        with self._lock:
            return self._latest

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the latest record is in the store and on disk (tests, shutdown)."""
        ok = True
        if self._publisher is not None:
            ok = self._publisher.flush(timeout)
        if self._tb is not None:
            self._tb.flush()
        return ok

    def close(self) -> None:
        """Flush and stop everything; frees the port. Safe to call twice."""
        pub, tb, server = self._publisher, self._tb, self._server
        self._publisher = self._tb = self._server = None
        try:
            if pub is not None:
                pub.close()
            if tb is not None:
                tb.close()
        finally:
            if server is not None:
                server.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------- TensorBoard


class _TensorBoard:
    def __init__(self, log_dir: str, world_size: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise LorasyncError("--tensorboard needs the tensorboard package, which is not "
                                "installed: pip install tensorboard (or run without "
                                "--tensorboard)") from None
        self._cls = SummaryWriter
        self.log_dir, self.world_size = log_dir, world_size
        self._w = None
        self._prev = None

    def _writer(self, step: int):
        if self._w is None:
            # created on the first record so that a resumed run hides the steps it re-runs
            self._w = self._cls(log_dir=self.log_dir, purge_step=step, flush_secs=10)
        return self._w

    def write(self, r: dict) -> None:
        step = int(r["step"])
        w = self._writer(step)

        def scalar(tag, value):
            if value is not None and math.isfinite(float(value)):
                w.add_scalar(tag, float(value), step)

        step_s = r.get("step_s") or 0.0
        scalar("train/loss", r.get("loss"))
        scalar("train/lr", r.get("lr"))
        scalar("train/grad_norm", r.get("grad_norm"))
        scalar("train/grad_accum", r.get("grad_accum"))
        if step_s > 0:
            scalar("throughput/samples_per_s", r.get("samples", 0) * self.world_size / step_s)
            scalar("time/sync_share", r.get("comm_s", 0.0) / step_s)
        scalar("time/compute_s", r.get("compute_s"))
        scalar("time/comm_s", r.get("comm_s"))
        scalar("time/step_s", r.get("step_s"))
        scalar("comm/wire_bytes", r.get("wire_bytes"))
        scalar("comm/fp32_bytes", r.get("fp32_bytes"))
        strategy = r.get("strategy")
        sw = r.get("switch")
        switched = bool(sw) or (self._prev is not None and strategy != self._prev)
        scalar("comm/strategy_switch", 1.0 if switched else 0.0)
        if switched:
            sw = sw or {}
            text = f"step {step}: {sw.get('from', self._prev)} → {sw.get('to', strategy)}"
            if sw.get("reason"):
                text += f" ({sw['reason']})"
            w.add_text("strategy", text, step)
        elif self._prev is None and strategy is not None:
            w.add_text("strategy", f"step {step}: {strategy}", step)
        self._prev = strategy

    def write_eval(self, e: dict) -> None:
        step = int(e["step"])
        w = self._writer(step)
        if e.get("eval_loss") is not None:
            w.add_scalar("eval/loss", float(e["eval_loss"]), step)
        if e.get("exact_match") is not None:
            w.add_scalar("eval/exact_match", float(e["exact_match"]), step)

    def flush(self) -> None:
        if self._w is not None:
            self._w.flush()

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None


# ---------------------------------------------------------------- store publishing


def _own_connection(store):
    """A second connection to the same store, so that our traffic never waits
    behind (or interleaves with) the process group's own store calls."""
    try:
        return store.clone()
    except (AttributeError, RuntimeError, NotImplementedError):
        return store


class _Publisher:
    """Puts the latest record of this rank in the store from a daemon thread.

    Only the newest record matters: a record not yet sent when the next one
    arrives is replaced, so a slow store never builds a backlog.
    """

    def __init__(self, store, key: str):
        self._store = _own_connection(store)
        self._key = key
        self._cond = threading.Condition()
        self._pending: str | None = None
        self._busy = False
        self._closed = False
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="lorasync-metrics-publisher",
                                        daemon=True)
        self._thread.start()

    def offer(self, payload: str) -> None:
        with self._cond:
            if self._closed or self._failed:
                return
            self._pending = payload
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                payload, self._pending, self._busy = self._pending, None, True
            try:
                self._store.set(self._key, payload)
            except Exception as exc:  # the store's host went away: metrics are not worth a crash
                warnings.warn(f"lorasync metrics: cannot publish to the c10d store ({exc}); "
                              "Prometheus will not see this rank any more", RuntimeWarning)
                with self._cond:
                    self._failed, self._pending, self._busy = True, None, False
                    self._cond.notify_all()
                return
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: (self._pending is None and not self._busy)
                                       or self._failed, timeout)

    def close(self, timeout: float = 5.0) -> None:
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)


# ---------------------------------------------------------------- Prometheus


class _Collector:
    """Builds the metric families on each scrape from every rank's latest record."""

    def __init__(self, sinks: Sinks, store, world_size: int):
        self._sinks = sinks
        self._store = _own_connection(store) if store is not None else None
        self._world = world_size
        self._lock = threading.Lock()  # scrapes may come in concurrently

    def _records(self) -> tuple[dict[int, dict], bool]:
        out: dict[int, dict] = {}
        own = self._sinks.latest()
        if own is not None:
            out[self._sinks.rank] = own
        store_up = self._store is not None
        if self._store is not None:
            with self._lock:
                for r in range(self._world):
                    if r == self._sinks.rank:
                        continue
                    key = f"{STORE_PREFIX}{r}"
                    try:
                        # get() of a missing key would block until the store timeout
                        if self._store.check([key]):
                            out[r] = json.loads(self._store.get(key))
                    except ValueError:
                        continue
                    except Exception:  # store gone (run ending): serve what we have
                        store_up = False
                        break
        return dict(sorted(out.items())), store_up

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        recs, store_up = self._records()

        def gauge(name, doc, value=None, labels=None):
            g = GaugeMetricFamily(name, doc, labels=labels)
            if value is not None:
                g.add_metric([], float(value))
            return g

        yield gauge("lorasync_world_size", "ranks in the job", self._world)
        yield gauge("lorasync_ranks_reporting", "ranks whose latest record was read", len(recs))
        if self._store is not None:
            yield gauge("lorasync_store_up", "1 if the c10d store answered this scrape",
                        1 if store_up else 0)
        r0 = recs.get(self._sinks.rank)
        if not recs:
            return
        if r0 is not None:
            yield gauge("lorasync_step", "latest optimizer step of rank 0", r0.get("step"))
            if r0.get("lr") is not None:
                yield gauge("lorasync_learning_rate", "learning rate (rank 0)", r0["lr"])
            if r0.get("strategy") is not None:
                g = GaugeMetricFamily("lorasync_strategy_info",
                                      "1 for the sync strategy rank 0 runs now",
                                      labels=["strategy"])
                g.add_metric([str(r0["strategy"])], 1.0)
                yield g
            c = CounterMetricFamily("lorasync_strategy_switches",
                                    "strategy changes seen by rank 0")
            c.add_metric([], float(r0.get("switches_total", 0)))
            yield c

        wall = max((r.get("step_s") or 0.0) for r in recs.values())
        samples = sum((r.get("samples") or 0) for r in recs.values())
        if wall > 0:
            yield gauge("lorasync_samples_per_second",
                        "global: samples of all ranks' latest steps / slowest step time",
                        samples / wall)
        step_total = sum((r.get("step_s") or 0.0) for r in recs.values())
        if step_total > 0:
            yield gauge("lorasync_sync_share", "global: exposed sync time / step time",
                        sum((r.get("comm_s") or 0.0) for r in recs.values()) / step_total)

        per_rank = [
            ("lorasync_rank_step", "latest optimizer step of each rank", "step", False),
            ("lorasync_loss", "training loss of the latest step", "loss", False),
            ("lorasync_compute_seconds", "compute time of the latest step", "compute_s", False),
            ("lorasync_comm_seconds", "exposed sync time of the latest step", "comm_s", False),
            ("lorasync_step_seconds", "wall time of the latest step", "step_s", False),
            ("lorasync_wire_bytes", "bytes handed to collectives", "wire_bytes_total", True),
            ("lorasync_samples", "examples processed", "samples_total", True),
        ]
        for name, doc, field, counter in per_rank:
            fam = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc,
                                                                         labels=["rank"])
            for rank, r in recs.items():
                v = r.get(field)
                if v is not None and math.isfinite(float(v)):
                    fam.add_metric([str(rank)], float(v))
            yield fam


class _PrometheusServer:
    def __init__(self, sinks: Sinks, store, world_size: int, host: str, port: int):
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError:
            raise LorasyncError("--metrics-port needs the prometheus_client package, which is "
                                "not installed: pip install prometheus_client (or run without "
                                "--metrics-port)") from None
        # our own registry: no process/GC metrics of the global one, and a second
        # open_sinks in one process (tests, notebooks) does not clash
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(sinks, store, world_size))
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise LorasyncError(f"metrics port {host}:{port} is already in use; pick another "
                                    f"port (--metrics-port) or stop the program holding it "
                                    f"(ss -ltnp 'sport = :{port}')") from None
            if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
                raise LorasyncError(f"metrics host {host!r}: not an address of this machine; "
                                    "use 127.0.0.1 (local scrapes) or 0.0.0.0 (all "
                                    "interfaces)") from None
            if exc.errno == errno.EACCES:
                raise LorasyncError(f"metrics port {port}: permission denied (ports below 1024 "
                                    "need root); pick a port above 1024") from None
            raise
        self.host, self.port = host, self._httpd.server_address[1]

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
