"""The report as a person sees it: rendered by headless Chromium.

Needs Debian's ``chromium`` (``apt-get install -y chromium``); skipped without it.
"""

import base64
import io
import os
import re
import subprocess

import pytest

from lorasync.monitor import report
from test_report import make_evals, make_records, make_run

CHROMIUM = "/usr/bin/chromium"

pytestmark = [
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason=f"{CHROMIUM} not installed (apt-get install -y chromium)"),
    pytest.mark.timeout(180),
]


def chromium(tmp_path, *args):
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
           *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


@pytest.fixture(scope="module")
def comparison_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("browser")
    a = make_run(tmp / "allreduce", make_records(switch_at=None, comm=(0.6, 0.6), seed=1),
                 make_evals(loss0=3.4, correct=(0, 20, 35)), strategy="allreduce")
    b = make_run(tmp / "auto", make_records(seed=2), make_evals(correct=(0, 21, 38)))
    return tmp, report.write_report([a, b], str(tmp / "report.html"))


def test_page_loads_with_its_images(comparison_report):
    from matplotlib.image import imread

    tmp, path = comparison_report
    dom = chromium(tmp, "--dump-dom", f"file://{path}")
    assert "<h2>Comparison</h2>" in dom and "speedup vs allreduce" in dom
    srcs = re.findall(r'<img [^>]*src="([^"]+)"', dom)
    assert len(srcs) == 4
    for src in srcs:
        assert src.startswith("data:image/png;base64,")
        img = imread(io.BytesIO(base64.b64decode(src.split(",", 1)[1])), format="png")
        assert img.shape[0] > 200 and img.shape[1] > 500


def test_screenshot_is_not_blank(comparison_report):
    from matplotlib.image import imread

    tmp, path = comparison_report
    shot = tmp / "shot.png"
    chromium(tmp, f"--screenshot={shot}", "--window-size=1200,2000", f"file://{path}")
    img = imread(str(shot))
    assert img.shape[:2] == (2000, 1200)
    rgb = img[..., :3]
    # mostly white page, but with plenty of ink: text, tables and the plots' colours
    dark = (rgb.mean(axis=2) < 0.5).mean()
    coloured = (rgb.max(axis=2) - rgb.min(axis=2) > 0.3).mean()
    assert 0.005 < dark < 0.5, dark
    assert coloured > 0.01, coloured
