"""The CPU cap an emulated cluster's bench puts on its ranks (lorasync.emulate.cpucap)."""

import os
import subprocess
import sys

import pytest

from lorasync.emulate import cpucap
from lorasync.errors import ConfigError

V1 = ("35 25 0:31 / /sys/fs/cgroup/cpu rw,nosuid shared:10 - cgroup cgroup rw,cpu\n"
      "36 25 0:32 / /sys/fs/cgroup/memory rw shared:11 - cgroup cgroup rw,memory\n"
      "37 25 0:33 / /sys/fs/cgroup/unified rw shared:12 - cgroup2 cgroup2 rw\n")


def test_mountinfo_v1_cpu_is_chosen_before_a_v2_mount(tmp_path):
    f = tmp_path / "mountinfo"
    f.write_text(V1)
    assert cpucap.hierarchy(str(f)) == (cpucap.Path("/sys/fs/cgroup/cpu"), "v1")


def test_mountinfo_v2_needs_the_cpu_controller(tmp_path):
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory pids\n")
    f = tmp_path / "mountinfo"
    f.write_text(f"30 25 0:26 / {root} rw shared:4 - cgroup2 cgroup2 rw\n")
    assert cpucap.hierarchy(str(f)) is None
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert cpucap.hierarchy(str(f)) == (root, "v2")


@pytest.mark.parametrize("cores", [0, -1, 10_000])
def test_a_cap_outside_the_host_is_refused_by_name(cores):
    with pytest.raises(ConfigError) as e:
        with cpucap.cpu_cap(cores, "unit-bad"):
            pass
    assert "cpu cap" in str(e.value)


needs_cgroup = pytest.mark.skipif(os.geteuid() != 0 or cpucap.hierarchy() is None,
                                  reason="needs root and a CPU cgroup")


@needs_cgroup
def test_a_child_runs_under_the_quota_and_the_cgroup_goes_with_the_cap():
    with cpucap.cpu_cap(0.5, "unit-test") as cap:
        assert cap.path.is_dir()
        quota = (cap.path / "cpu.cfs_quota_us") if (cap.path / "cpu.cfs_quota_us").exists() \
            else (cap.path / "cpu.max")
        assert quota.read_text().split()[0] == "50000"
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                 stdin=subprocess.PIPE, preexec_fn=cap.enter)
        try:
            assert str(child.pid) in (cap.path / "cgroup.procs").read_text().split()
        finally:
            child.communicate(b"")
    assert not cap.path.exists()


@needs_cgroup
def test_a_cap_left_by_a_killed_run_is_removed_with_what_still_runs_in_it():
    root, _ = cpucap.hierarchy()
    path = root / "lorasync-unit-left"
    path.mkdir()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        (path / "cgroup.procs").write_text(str(child.pid))
        assert cpucap.leftovers("unit-left") == [str(path)]
        assert not path.exists()
        assert child.poll() is None  # moved out, not killed
    finally:
        child.communicate(b"")
