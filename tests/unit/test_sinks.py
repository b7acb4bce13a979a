"""Live sinks: TensorBoard event files and the Prometheus endpoint aggregated over ranks."""

import datetime
import os
import socket
import sys
import urllib.request

import pytest

from lorasync.errors import LorasyncError
from lorasync.monitor.sinks import STORE_PREFIX, open_sinks
from test_report import make_records

pytestmark = pytest.mark.timeout(60)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port):
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
def store():
    import torch.distributed as dist

    s = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    # what torchrun's default process group hands the trainer
    return dist.PrefixStore("default_pg", s)


# ---------------------------------------------------------------- TensorBoard


def test_tensorboard_events_written_and_readable(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recs = [r for r in make_records() if r["rank"] == 0]
    sinks = open_sinks(str(tmp_path), rank=0, world_size=2, tensorboard=True, metrics_port=0)
    for r in recs:
        sinks.write(r)
    sinks.write({"step": 30, "eval_loss": 0.73, "exact_match": 0.63, "n": 60, "time": 0.0})
    sinks.close()
    sinks.close()  # twice is fine

    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0,
                                                                         "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    # the Hugging Face Trainer's names, lorasync's own under lorasync/
    for tag in ("train/loss", "train/learning_rate", "lorasync/grad_accum",
                "lorasync/samples_per_s", "lorasync/compute_s", "lorasync/comm_s",
                "lorasync/sync_share", "lorasync/wire_bytes", "lorasync/strategy_switch",
                "eval/loss", "eval/exact_match"):
        assert tag in tags, tag
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 31))
    assert loss[4].value == pytest.approx(recs[4]["loss"], rel=1e-6)
    sps = acc.Scalars("lorasync/samples_per_s")[9]
    assert sps.value == pytest.approx(8 * 2 / recs[9]["step_s"], rel=1e-5)
    switch = {e.step: e.value for e in acc.Scalars("lorasync/strategy_switch")}
    assert switch[15] == 1.0 and sum(switch.values()) == 1.0
    text = [(e.step, e.tensor_proto.string_val[0].decode())
            for e in acc.Tensors("lorasync/strategy/text_summary")]
    assert text[0] == (1, "step 1: allreduce")
    assert text[1][0] == 15 and "allreduce → fp16" in text[1][1] and "10 Mbit/s" in text[1][1]


def test_tensorboard_only_on_rank_0(tmp_path):
    sinks = open_sinks(str(tmp_path), rank=1, world_size=2, tensorboard=True, metrics_port=0)
    sinks.write(make_records()[1])
    sinks.close()
    assert not (tmp_path / "tensorboard").exists()


def test_missing_tensorboard_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(LorasyncError, match=r"pip install tensorboard"):
        open_sinks(str(tmp_path), rank=0, world_size=1, tensorboard=True, metrics_port=0)


# ---------------------------------------------------------------- Prometheus


def test_prometheus_aggregates_ranks_through_the_store(tmp_path, store):
    pytest.importorskip("prometheus_client")
    port = free_port()
    recs = make_records(steps=16)
    rank0 = open_sinks(str(tmp_path), rank=0, world_size=2, tensorboard=False,
                       metrics_port=port, store=store)
    rank1 = open_sinks(str(tmp_path), rank=1, world_size=2, tensorboard=False,
                       metrics_port=port, store=store)  # rank 1 serves nothing, publishes
    try:
        for r in recs:
            (rank0 if r["rank"] == 0 else rank1).write(r)
        assert rank1.flush(5)
        assert store.check([f"{STORE_PREFIX}1"])
        m = scrape(port)
    finally:
        rank1.close()
        rank0.close()
    last = {r["rank"]: r for r in recs if r["step"] == 16}
    assert m[("lorasync_step", ())] == 16
    assert m[("lorasync_world_size", ())] == 2 and m[("lorasync_ranks_reporting", ())] == 2
    assert m[("lorasync_store_up", ())] == 1
    for k in (0, 1):
        lab = (("rank", str(k)),)
        assert m[("lorasync_loss", lab)] == pytest.approx(last[k]["loss"])
        assert m[("lorasync_compute_seconds", lab)] == pytest.approx(last[k]["compute_s"])
        assert m[("lorasync_comm_seconds", lab)] == pytest.approx(last[k]["comm_s"])
        assert m[("lorasync_rank_step", lab)] == 16
        wire = sum(r["wire_bytes"] for r in recs if r["rank"] == k)
        assert m[("lorasync_wire_bytes_total", lab)] == wire
        assert m[("lorasync_samples_total", lab)] == 8 * 16
    assert m[("lorasync_samples_per_second", ())] == pytest.approx(
        16 / max(r["step_s"] for r in last.values()))
    assert m[("lorasync_sync_share", ())] == pytest.approx(
        sum(r["comm_s"] for r in last.values()) / sum(r["step_s"] for r in last.values()))
    assert m[("lorasync_strategy_info", (("strategy", "fp16"),))] == 1
    assert m[("lorasync_strategy_switches_total", ())] == 1
    assert m[("lorasync_learning_rate", ())] == pytest.approx(2e-3)
    # close() freed the port: the next run can serve on it (a plain bind() could still
    # fail on the scrape connection's TIME_WAIT; servers set SO_REUSEADDR)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


def test_prometheus_single_process_without_store(tmp_path):
    pytest.importorskip("prometheus_client")
    port = free_port()
    with open_sinks(str(tmp_path), rank=0, world_size=1, tensorboard=False,
                    metrics_port=port) as sinks:
        m = scrape(port)  # before the first step: no record yet, still answers
        assert m[("lorasync_ranks_reporting", ())] == 0
        recs = make_records(steps=3, world=1)
        for r in recs:
            sinks.write(r)
        m = scrape(port)
    assert m[("lorasync_step", ())] == 3 and m[("lorasync_ranks_reporting", ())] == 1
    assert m[("lorasync_samples_per_second", ())] == pytest.approx(8 / recs[-1]["step_s"])
    assert ("lorasync_store_up", ()) not in m


def test_port_in_use_is_a_clear_error(tmp_path):
    pytest.importorskip("prometheus_client")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LorasyncError, match=rf"127.0.0.1:{port} is already in use.*"
                                                r"--metrics-port"):
            open_sinks(str(tmp_path), rank=0, world_size=1, tensorboard=False,
                       metrics_port=port)


def test_bad_port_and_host(tmp_path):
    with pytest.raises(LorasyncError, match="metrics_port"):
        open_sinks(str(tmp_path), rank=0, world_size=1, tensorboard=False, metrics_port=70000)
    pytest.importorskip("prometheus_client")
    with pytest.raises(LorasyncError, match="not an address of this machine"):
        open_sinks(str(tmp_path), rank=0, world_size=1, tensorboard=False,
                   metrics_port=free_port(), metrics_host="192.0.2.1")


def test_no_sinks_is_cheap_and_harmless(tmp_path):
    sinks = open_sinks(str(tmp_path), rank=0, world_size=1, tensorboard=False, metrics_port=0)
    for r in make_records(steps=2, world=1):
        sinks.write(r)
    sinks.close()
    assert os.listdir(tmp_path) == []


class SlowStore:
    """A store on a slow link: every set takes 0.2 s; no clone()."""

    def __init__(self, fail=False):
        self.data, self.sets, self.fail = {}, 0, fail

    def set(self, key, value):
        import time

        time.sleep(0.2)
        if self.fail:
            raise RuntimeError("Connection reset by peer")
        self.sets += 1
        self.data[key] = value


def test_write_never_waits_on_the_store(tmp_path):
    import json
    import time

    store = SlowStore()
    sinks = open_sinks(str(tmp_path), rank=1, world_size=2, tensorboard=False,
                       metrics_port=free_port(), store=store)
    recs = [r for r in make_records(steps=10) if r["rank"] == 1]
    t0 = time.perf_counter()
    for r in recs:
        sinks.write(r)
    assert time.perf_counter() - t0 < 0.1
    sinks.close()  # flushes the newest record; older unsent ones were replaced, not queued
    assert json.loads(store.data[f"{STORE_PREFIX}1"])["step"] == 10
    assert store.sets < 10


def test_store_failure_warns_once_and_training_goes_on(tmp_path):
    sinks = open_sinks(str(tmp_path), rank=1, world_size=2, tensorboard=False,
                       metrics_port=free_port(), store=SlowStore(fail=True))
    with pytest.warns(RuntimeWarning, match="cannot publish"):
        sinks.write(make_records()[1])
        sinks.flush(5)
    for r in make_records(steps=3)[3::2]:
        sinks.write(r)
    sinks.close()
