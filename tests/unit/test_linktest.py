"""lorasync.overlay.linktest on loopback: the protocol behind Cluster.measure, no root needed."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from lorasync.overlay import linktest


def _server(window=0.3, max_bytes=64 << 20):
    ports: list[int] = []
    ready = threading.Event()
    t = threading.Thread(target=linktest.serve, args=("127.0.0.1", window, max_bytes),
                         kwargs={"ready": lambda p: (ports.append(p), ready.set())}, daemon=True)
    t.start()
    assert ready.wait(10)
    return t, ports[0]


def test_measure_reports_rtt_and_rate_and_the_server_exits_after_the_data_part():
    t, port = _server()
    res = linktest.measure("127.0.0.1", port, 0.3)
    t.join(10)
    assert not t.is_alive()  # one data measurement, then the server is done
    assert set(res) >= {"bytes", "seconds", "rate_bps", "rtt_s", "rtt_min_s", "connect_s"}
    assert res["bytes"] > 0 and res["rate_bps"] > 0
    assert 0 < res["rtt_min_s"] <= res["rtt_s"] and res["connect_s"] > 0


def test_max_bytes_ends_the_data_part_early():
    t, port = _server(window=30, max_bytes=1 << 20)
    res = linktest.measure("127.0.0.1", port, 30)
    t.join(10)
    assert (1 << 20) <= res["bytes"] < (1 << 20) + (8 << 20) and res["seconds"] < 30


def test_command_line_serve_and_measure():
    py = [sys.executable, "-m", "lorasync.overlay.linktest"]
    srv = subprocess.Popen([*py, "serve", "127.0.0.1", "0.3", str(64 << 20)], stdout=subprocess.PIPE,
                           text=True)
    try:
        port = srv.stdout.readline().strip()
        assert port.isdigit()
        out = subprocess.run([*py, "measure", "127.0.0.1", port, "0.3"], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["rate_bps"] > 0
        assert srv.wait(timeout=20) == 0
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()


def test_command_line_errors():
    py = [sys.executable, "-m", "lorasync.overlay.linktest"]
    assert subprocess.run([*py, "bogus"], capture_output=True).returncode == 2
    # nothing listens on port 1 of loopback: a one-line error, exit 1
    r = subprocess.run([*py, "measure", "127.0.0.1", "1", "0.1"], capture_output=True, text=True)
    assert r.returncode == 1 and "linktest: ConnectionRefusedError" in r.stderr


def test_measure_refused_raises():
    with pytest.raises(ConnectionRefusedError):
        linktest.measure("127.0.0.1", 1, 0.1)
