"""auto's start probe on an emulated long, thin link: 10 Mbit/s, 50 ms one way.

The figure ``--comm auto`` starts from (``Links.start_probe``: the quick probe,
and the live one that ``probe=live`` and a failed quick probe use) must be
within 2x of the link's rate.  Before the probe was sized by its latency the
quick one read this link anywhere from 0.24x to 10.7x (bench/long_link.py,
docs/slow-links.md).  Needs root; about 25 s.
"""

from __future__ import annotations

import json
import os

import pytest

from lorasync.emulate.cluster import down
from lorasync.emulate.launch import emulated, launch_on_cluster
from lorasync.emulate.spec import ClusterSpec

pytestmark = pytest.mark.netns(tun=True)   # the delay link

NAME = f"t{os.getpid() % 100000}ll"
RATE_BPS = 10e6 / 8

WORKER = """
import json, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
from lorasync.comm.auto.measure import Links
from lorasync.comm.wire import Wire
spent = []
links = Links(Wire(None, lambda n: None), None, torch.device("cpu"), lambda n: None, spent.append)
out = {}
for mode in ("quick", "live"):
    net = links.start_probe(mode, "flat")
    out[mode] = {"bandwidth_Bps": net.bandwidth_Bps, "alpha_s": net.alpha_s}
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as fh:
        json.dump(out, fh)
dist.destroy_process_group()
"""


@pytest.fixture(autouse=True)
def _sweep():
    try:
        yield
    finally:
        down(NAME)


def test_start_figure_on_a_50ms_10mbit_link_is_within_2x(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out.json"
    with emulated(ClusterSpec(nodes=2, rate_bps="10mbit", delay_s="50ms", name=NAME)) as c:
        rc = launch_on_cluster(c, [str(script), str(out)], module=None, timeout=150,
                               log_dir=tmp_path / "logs", fail_grace=1.0)
    assert rc == 0, (tmp_path / "logs" / "node0.log").read_text()[-3000:]
    res = json.loads(out.read_text())
    for mode in ("quick", "live"):
        bw = res[mode]["bandwidth_Bps"]
        assert RATE_BPS / 2 <= bw <= 2 * RATE_BPS, (mode, bw * 8 / 1e6, res)
        # a 2-rank ring all-reduce waits a round trip per message: 50 ms each way
        assert res[mode]["alpha_s"] >= 0.05, (mode, res)
