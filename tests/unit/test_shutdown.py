"""lorasync.comm.shutdown, the exit guard, without processes: it settles what
it tracks, reports trouble in one line and never raises, keeps to its
deadline, and stops lorasync's point-to-point workers.
(tests/dist/test_hf_exits.py runs it at real exits.)"""

import threading
import time
import weakref

import pytest

pytest.importorskip("torch")

from lorasync.comm import shutdown, wire  # noqa: E402


class FakeSync:
    name = "fake"

    def __init__(self, settle=None):
        self.settled = 0
        self._settle = settle

    def settle(self):
        self.settled += 1
        if self._settle:
            self._settle()


@pytest.fixture
def tracked(monkeypatch):
    monkeypatch.setattr(shutdown, "_syncs", weakref.WeakSet())
    monkeypatch.delenv("LORASYNC_EXIT_TIMEOUT", raising=False)
    return shutdown._syncs


def test_at_exit_settles_every_live_sync(tracked, capsys):
    a, b = FakeSync(), FakeSync()
    shutdown.track(a)
    shutdown.track(b)
    shutdown.at_exit()
    assert (a.settled, b.settled) == (1, 1)
    assert capsys.readouterr().err == ""


def test_a_sync_that_is_gone_is_not_kept_alive(tracked):
    shutdown.track(FakeSync())
    import gc
    gc.collect()
    assert len(tracked) == 0


def test_a_failing_settle_is_one_line_not_an_exception(tracked, capsys):
    def boom():
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234\nmore")
    sync = FakeSync(boom)
    shutdown.track(sync)
    shutdown.at_exit()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "at exit" in err[0] and "fake.settle: RuntimeError: Connection closed" in err[0]


def test_a_hanging_settle_does_not_hang_the_exit(tracked, capsys, monkeypatch):
    monkeypatch.setenv("LORASYNC_EXIT_TIMEOUT", "0.2")
    release = threading.Event()
    sync = FakeSync(lambda: release.wait(10))
    shutdown.track(sync)
    t0 = time.monotonic()
    shutdown.at_exit()
    took = time.monotonic() - t0
    release.set()
    assert took < 3
    assert "did not settle within 0.2 s" in capsys.readouterr().err


@pytest.mark.parametrize("raw", ["soon", "-1", "0"])
def test_a_bad_timeout_names_the_variable_and_keeps_the_default(tracked, capsys, monkeypatch,
                                                              raw):
    monkeypatch.setenv("LORASYNC_EXIT_TIMEOUT", raw)
    assert shutdown._timeout() == shutdown.EXIT_TIMEOUT_S
    assert f"LORASYNC_EXIT_TIMEOUT={raw!r}" in capsys.readouterr().err


def test_install_registers_once(monkeypatch):
    calls = []
    monkeypatch.setattr(shutdown, "_installed", False)
    monkeypatch.setattr(shutdown.atexit, "register", calls.append)
    shutdown.install()
    shutdown.install()
    assert calls == [shutdown.at_exit]


def test_no_gloo_worker_means_no_wait():
    t0 = time.monotonic()
    assert shutdown.wait_workers_idle(timeout=1.0)
    assert time.monotonic() - t0 < 0.5


def test_point_to_point_workers_stop():
    import torch

    runner = wire._runner(None)
    assert runner.submit(lambda: torch.ones(1)).wait()
    thread = runner._thread
    assert thread.is_alive()
    assert wire.stop_runners(timeout=2.0)
    assert not thread.is_alive() and not wire._runners
