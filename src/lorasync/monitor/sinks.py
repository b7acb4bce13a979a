"""Live metric sinks the trainer feeds every step: TensorBoard, W&B, MLflow and Prometheus.

The trainer calls::

    sinks = open_sinks(run_dir, rank=rank, world_size=world, report_to=["tensorboard"],
                       metrics_port=9400, store=dist.distributed_c10d._get_default_store())
    try:
        for step ...:
            sinks.write(record)      # every rank, once per step, its metrics record
    finally:
        sinks.close()

Experiment trackers (``report_to``: tensorboard, wandb, mlflow): rank 0 logs
its step records and the evaluations, each through the library's own client,
under the names the Hugging Face Trainer gives its logs (``scalars``):
``train/loss``, ``train/learning_rate``, ``train/grad_norm``, ``eval/loss``;
lorasync's own measurements under ``lorasync/`` (the keys ``lorasync.hf``
adds to the Trainer's logs: ``lorasync/comm_s``, ``lorasync/wire_bytes``,
...).  ``lorasync/samples_per_s`` is rank 0's samples x world size / rank
0's step time, the global rate because every rank waits for the others at
each sync.  Strategy switches appear as ``lorasync/strategy_switch`` (1 at
the step that ran the new strategy) and, in TensorBoard, as text under
``lorasync/strategy``.

* TensorBoard: event files under ``RUN_DIR/tensorboard``.  On resume, events
  from steps at or after the first step written are hidden (SummaryWriter's
  ``purge_step``), so re-run steps do not show twice.
* W&B: ``wandb.init(dir=RUN_DIR, project=$WANDB_PROJECT or "lorasync")``,
  the resolved config (``RUN_DIR/config.yaml``) as the run's config; the
  run's id is kept in ``RUN_DIR/wandb/lorasync-run-id`` so a resumed run
  continues the same W&B run.  ``WANDB_MODE=offline`` writes it to disk only.
* MLflow: ``MLFLOW_TRACKING_URI`` when set, else a file store in
  ``RUN_DIR/mlruns``; experiment ``$MLFLOW_EXPERIMENT_NAME`` or "lorasync";
  the config as params, one ``log_batch`` per step; the run id is kept in
  ``RUN_DIR/mlruns/lorasync-run-id`` for a resume.

``check_report_to`` says, before any worker starts, which named package is
missing (one line with the pip command).

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
import uuid
import warnings

from lorasync.errors import LorasyncError

__all__ = ["open_sinks", "Sinks", "STORE_PREFIX", "scalars", "check_report_to",
           "TRACKERS"]

STORE_PREFIX = "lorasync/metrics/"


#: report_to name -> (module imported, pip package that provides it)
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow-skinny")}


def check_report_to(report_to) -> None:
    """A ``ConfigError`` naming the first tracker in ``report_to`` whose package
    is not installed, with the pip command (checked without importing it)."""
    import importlib.util

    from lorasync.errors import ConfigError

    for name in report_to:
        if name not in TRACKERS:
            continue
        module, pip = TRACKERS[name]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError("run.report_to", name, f"the {module} package is not installed: "
                              f"pip install {pip} (or pip install 'lorasync[logging]'), or "
                              f"drop {name} from --report-to")


def open_sinks(run_dir: str, *, rank: int, world_size: int, tensorboard: bool = False,
               metrics_port: int = 0, store=None, metrics_host: str = "127.0.0.1",
               report_to=()) -> "Sinks":
    """Open the sinks this rank needs; raises ``LorasyncError`` (missing
    package, port in use) before training starts.  ``tensorboard=True`` is
    ``report_to=["tensorboard"]`` (the older flag)."""
    if metrics_port < 0 or metrics_port > 65535:
        raise LorasyncError(f"metrics_port: invalid value {metrics_port!r}: use 1-65535, or 0 "
                            "for no Prometheus endpoint")
    report_to = [t for t in report_to if t != "none"]
    if tensorboard and "tensorboard" not in report_to:
        report_to.append("tensorboard")
    sinks = Sinks(rank, world_size)
    try:
        if rank == 0:
            check_report_to(report_to)
            for name in report_to:
                cls = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}[name]
                sinks._trackers.append(cls(run_dir, world_size))
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
        self._trackers: list = []   # rank 0's experiment trackers (report_to)
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
            for t in self._trackers:
                t.write_eval(record)
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
        for t in self._trackers:
            t.write(record)

    def latest(self) -> dict | None:
        with self._lock:
            return self._latest

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the latest record is in the store and on disk (tests, shutdown)."""
        ok = True
        if self._publisher is not None:
            ok = self._publisher.flush(timeout)
        for t in self._trackers:
            t.flush()
        return ok

    def close(self) -> None:
        """Flush and stop everything; frees the port. Safe to call twice."""
        pub, trackers, server = self._publisher, self._trackers, self._server
        self._publisher = self._server = None
        self._trackers = []
        try:
            if pub is not None:
                pub.close()
            for t in trackers:
                t.close()
        finally:
            if server is not None:
                server.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------- experiment trackers


def scalars(r: dict, world_size: int) -> dict[str, float]:
    """The scalars of one step record, under the Hugging Face Trainer's names
    (``train/...``) and lorasync's own (``lorasync/...``); missing and
    non-finite values are left out."""
    step_s = r.get("step_s") or 0.0
    wire, fp32 = r.get("wire_bytes"), r.get("fp32_bytes")
    out = {"train/loss": r.get("loss"), "train/learning_rate": r.get("lr"),
           "train/grad_norm": r.get("grad_norm"),
           "lorasync/grad_accum": r.get("grad_accum"),
           "lorasync/compute_s": r.get("compute_s"), "lorasync/comm_s": r.get("comm_s"),
           "lorasync/step_s": r.get("step_s"), "lorasync/wire_bytes": wire,
           "lorasync/fp32_bytes": fp32,
           "lorasync/compression": fp32 / wire if wire and fp32 is not None else None}
    if step_s > 0:
        out["lorasync/samples_per_s"] = r.get("samples", 0) * world_size / step_s
        out["lorasync/sync_share"] = r.get("comm_s", 0.0) / step_s
    return {k: float(v) for k, v in out.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def eval_scalars(e: dict) -> dict[str, float]:
    """An evaluation record as ``eval/loss`` and ``eval/exact_match``."""
    out = {"eval/loss": e.get("eval_loss"), "eval/exact_match": e.get("exact_match")}
    return {k: float(v) for k, v in out.items()
            if isinstance(v, (int, float)) and math.isfinite(float(v))}


class _Tracker:
    """One experiment tracker of rank 0: ``log(scalars, step)`` is the client's;
    strategy switches are followed here."""

    def __init__(self, run_dir: str, world_size: int):
        self.run_dir, self.world_size = run_dir, world_size
        self._prev = None

    def write(self, r: dict) -> None:
        step = int(r["step"])
        values = scalars(r, self.world_size)
        strategy, sw = r.get("strategy"), r.get("switch")
        switched = bool(sw) or (self._prev is not None and strategy != self._prev)
        values["lorasync/strategy_switch"] = 1.0 if switched else 0.0
        self.log(values, step)
        if switched:
            sw = sw or {}
            text = f"step {step}: {sw.get('from', self._prev)} → {sw.get('to', strategy)}"
            if sw.get("reason"):
                text += f" ({sw['reason']})"
            self.text(text, step)
        elif self._prev is None and strategy is not None:
            self.text(f"step {step}: {strategy}", step)
        self._prev = strategy

    def write_eval(self, e: dict) -> None:
        self.log(eval_scalars(e), int(e["step"]))

    def log(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def text(self, text: str, step: int) -> None:
        """The strategy in use, in words (where the tracker shows text)."""

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _config(self) -> dict:
        """The run's resolved config (RUN_DIR/config.yaml), flattened to
        ``section.key``; empty when it is not there (yet)."""
        import yaml

        try:
            with open(os.path.join(self.run_dir, "config.yaml"), encoding="utf-8") as fh:
                data = yaml.safe_load(fh) or {}
        except (OSError, ValueError, yaml.YAMLError):
            return {}
        return {f"{sec}.{k}": v for sec, vals in data.items() if isinstance(vals, dict)
                for k, v in vals.items()}

    def _run_id(self, folder: str, new) -> str:
        """The id this run directory's tracker run has, made by ``new()`` the
        first time and kept in ``folder``, so a resumed run continues it."""
        path = os.path.join(folder, "lorasync-run-id")
        try:
            with open(path) as fh:
                rid = fh.read().strip()
            if rid:
                return rid
        except OSError:
            pass
        rid = new()
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as fh:
            fh.write(rid)
        return rid


def _missing(name: str) -> LorasyncError:
    module, pip = TRACKERS[name]
    return LorasyncError(f"run.report_to: {name} needs the {module} package, which is not "
                         f"installed: pip install {pip} (or drop {name} from --report-to)")


class _TensorBoard(_Tracker):
    def __init__(self, run_dir: str, world_size: int):
        super().__init__(run_dir, world_size)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise LorasyncError("--report-to tensorboard needs the tensorboard package, which "
                                "is not installed: pip install tensorboard (or drop tensorboard "
                                "from --report-to)") from None
        self._cls = SummaryWriter
        self.log_dir = os.path.join(run_dir, "tensorboard")
        self._w = None

    def _writer(self, step: int):
        if self._w is None:
            # created on the first record so that a resumed run hides the steps it re-runs
            self._w = self._cls(log_dir=self.log_dir, purge_step=step, flush_secs=10)
        return self._w

    def log(self, values: dict[str, float], step: int) -> None:
        w = self._writer(step)
        for tag, value in values.items():
            w.add_scalar(tag, value, step)

    def text(self, text: str, step: int) -> None:
        self._writer(step).add_text("lorasync/strategy", text, step)

    def flush(self) -> None:
        if self._w is not None:
            self._w.flush()

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None


class _WandB(_Tracker):
    def __init__(self, run_dir: str, world_size: int):
        super().__init__(run_dir, world_size)
        try:
            import wandb
        except ImportError:
            raise _missing("wandb") from None
        folder = os.path.join(run_dir, "wandb")
        rid = self._run_id(folder, lambda: uuid.uuid4().hex[:16])
        try:
            self._run = wandb.init(dir=run_dir, project=os.environ.get("WANDB_PROJECT") or
                                   "lorasync", name=os.path.basename(os.path.abspath(run_dir)),
                                   id=rid, resume="allow", config=self._config(),
                                   reinit="create_new")
        except Exception as exc:   # not logged in, no network without WANDB_MODE=offline
            raise LorasyncError(f"run.report_to: wandb could not start a run "
                                f"({str(exc).splitlines()[0][:200]}); run `wandb login`, or set "
                                "WANDB_MODE=offline to log to RUN/wandb only") from None

    def log(self, values: dict[str, float], step: int) -> None:
        if values:
            self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class _MLflow(_Tracker):
    def __init__(self, run_dir: str, world_size: int):
        super().__init__(run_dir, world_size)
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing("mlflow") from None
        folder = os.path.join(os.path.abspath(run_dir), "mlruns")
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow 3 keeps its file store in maintenance mode behind this switch; it is
            # what works with no server and no database (mlflow-skinny has no SQLite store)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = "file://" + folder
        self._client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "lorasync"

        def new() -> str:
            exp = self._client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp else self._client.create_experiment(name)
            run = self._client.create_run(exp_id, run_name=os.path.basename(
                os.path.abspath(run_dir)))
            params = self._config()
            if params:
                from mlflow.entities import Param
                self._client.log_batch(run.info.run_id, params=[
                    Param(k, str(v)[:6000]) for k, v in params.items()])
            return run.info.run_id

        self._id = self._run_id(folder, new)
        self._client.update_run(self._id, status="RUNNING")

    def log(self, values: dict[str, float], step: int) -> None:
        import time as _time

        from mlflow.entities import Metric

        ms = int(_time.time() * 1000)
        if values:
            self._client.log_batch(self._id, metrics=[Metric(k, v, ms, step)
                                                      for k, v in values.items()])

    def close(self) -> None:
        self._client.set_terminated(self._id)


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
