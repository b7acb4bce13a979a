"""`lorasync cluster launch`: your own script on an emulated link, for real.

A plain DDP loop and a tiny transformers Trainer script (tests/netns/_trainer_script.py)
run with one torchrun agent per emulated node; the caller's environment
reaches them; afterwards the namespaces and every process are gone, also when
the script fails on one node.  Needs root and iproute2 (the missing-script
check does not: it must fail before any namespace is made).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest

from lorasync.cli import main
from lorasync.emulate.cluster import down

from conftest import NETNS_TOOLS, missing

#: None where namespaces can be made: the sweep and the no-root tests look at them then
_why = missing(*NETNS_TOOLS)

TAG = f"s{os.getpid() % 100000}"
HERE = os.path.dirname(os.path.abspath(__file__))


def _name(kind: str) -> str:
    return f"{TAG}{kind}"


def _namespaces(name: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"lsync-{name}-")]


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds ``text`` (a test's own tmp path)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if text.encode() in fh.read():
                    out.append(int(pid))
        except OSError:
            continue
    return out


@pytest.fixture(scope="module", autouse=True)
def _sweep():
    """Whatever a failed test left behind, the module removes at the end."""
    try:
        yield
    finally:
        if _why is None:
            for kind in ("ddp", "hf", "fail", "gone"):
                down(_name(kind))


DDP = """
import json, os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(8, 64) * (rank + 1)).square().mean().backward()
    opt.step()
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t)
with open(os.path.join(sys.argv[1], "rank%d.json" % rank), "w") as f:
    json.dump({"sum": t[0].item(), "world": dist.get_world_size(),
               "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
               "weight": model.module.weight.sum().item(),
               "env": {k: os.environ.get(k) for k in
                       ("LSYNC_TEST_VAR", "LORASYNC_STRATEGY", "LORASYNC_SECRET_FILE",
                         "OMP_NUM_THREADS")}}, f)
# the DDP model holds the group: with it alive, gloo's worker threads outlive the script and
# may abort it at exit on a loaded host (docs/huggingface.md, "Clean exits")
del model, opt
dist.destroy_process_group()
"""


def _launch(name: str, *argv: str) -> int:
    return main(["cluster", "launch", "--emulate", f"nodes=2,rate=100mbit,name={name}", "--",
                 *argv])


@pytest.mark.netns
def test_plain_ddp_script_with_the_callers_environment(tmp_path, monkeypatch):
    script = tmp_path / "ddp.py"
    script.write_text(textwrap.dedent(DDP))
    monkeypatch.setenv("LSYNC_TEST_VAR", "mine")
    monkeypatch.setenv("LORASYNC_STRATEGY", "fp16")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")   # a script keeps the caller's threads
    # a caller's job secret: an agent guarding its store with it would refuse the
    # script's workers (torch's plain store client): it must not reach the agents
    secret = tmp_path / "job.secret"
    secret.write_text("ab" * 32)
    secret.chmod(0o600)
    monkeypatch.setenv("LORASYNC_SECRET_FILE", str(secret))
    rc = _launch(_name("ddp"), str(script), str(tmp_path))
    assert rc == 0
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["sum"] for r in res] == [3.0, 3.0] and {r["world"] for r in res} == {2}
    assert {r["ifname"] for r in res} == {"eth0"}
    assert res[0]["weight"] == pytest.approx(res[1]["weight"])   # DDP kept them in step
    assert all(r["env"] == {"LSYNC_TEST_VAR": "mine", "LORASYNC_STRATEGY": "fp16",
                            "LORASYNC_SECRET_FILE": None, "OMP_NUM_THREADS": "2"} for r in res)
    assert _namespaces(_name("ddp")) == [] and _processes_naming(str(tmp_path)) == []


@pytest.mark.netns
def test_trainer_script_then_the_report_reads_its_output(tmp_path):
    from lorasync.monitor.report import load_run, summarize_run

    out = tmp_path / "out"
    rc = _launch(_name("hf"), os.path.join(HERE, "_trainer_script.py"), str(out),
                 "--strategy", "fp16", "--steps", "4")
    assert rc == 0
    res = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [(r["world"], r["ifname"], r["steps"]) for r in res] == [(2, "eth0", 4)] * 2
    s = summarize_run(load_run(str(out)))
    assert s["world_size"] == 2 and s["strategies_used"] == ["fp16"]
    assert s["wire_bytes_per_step"] > 0 and s["samples_per_s"] > 0
    assert _namespaces(_name("hf")) == [] and _processes_naming(str(tmp_path)) == []


FAIL = """
import os, sys, time, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
open(os.path.join(sys.argv[1], "pid%d" % os.getpid()), "w").close()
if rank == 1:
    sys.exit(1)
time.sleep(300)   # rank 0 never ends by itself: the launcher must stop it
"""


@pytest.mark.netns
def test_a_failing_script_leaves_nothing_behind(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent(FAIL))
    rc = _launch(_name("fail"), str(script), str(tmp_path))
    assert rc == 1
    pids = [int(f.name[3:]) for f in tmp_path.glob("pid*")]
    assert len(pids) == 2
    assert _namespaces(_name("fail")) == [] and _processes_naming(str(tmp_path)) == []
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]


@pytest.mark.parametrize("case, expect", [
    ("missing", "SCRIPT: invalid value"),
    ("folder", "is a directory"),
    ("no_script", "give the script after --"),
    ("two_names", "--name: invalid value 'other': with --emulate name the cluster inside"),
    ("bad_spec", "nodes: invalid value 'two'"),
    ("bad_timeout", "--timeout: invalid value '0'"),
])
def test_bad_input_fails_before_any_namespace(tmp_path, capsys, case, expect):
    """One line, exit code 2, and no namespace made (no root needed to see it)."""
    name = _name("gone")
    script = tmp_path / "ok.py"
    script.write_text("print('never run')\n")
    args = {"missing": ["--", str(tmp_path / "nope.py"), "x"],
            "folder": ["--", str(tmp_path)],
            "no_script": ["--"],
            "two_names": ["--name", "other", "--", str(script)],
            "bad_spec": ["--", str(script)],
            "bad_timeout": ["--timeout", "0", "--", str(script)]}[case]
    spec = f"nodes={'two' if case == 'bad_spec' else 2},name={name}"
    rc = main(["cluster", "launch", "--emulate", spec, *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("lorasync cluster: error: ") and expect in err
    if case == "missing":
        assert f"{tmp_path / 'nope.py'} does not exist" in err
    if _why is None:
        assert _namespaces(name) == []
