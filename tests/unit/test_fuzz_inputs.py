"""Fuzzing every file and option string lorasync reads (Hypothesis).

The contract for each input: its reader returns a valid result or raises a
``LorasyncError`` (never another exception), and ``lorasync.cli.main`` on
it exits 0, or exits 2 with one line on stderr, no traceback and nothing
written; an input the reader refuses always exits 2.  Nothing is started:
tests/unit/_bad_input.py stands in for torchrun's agent and ``tunnel up``'s
root check.

Deterministic (``derandomize``, no example database) and a few seconds per
target; ``LORASYNC_FUZZ_EXAMPLES=500`` searches harder.
"""

from __future__ import annotations

import json
import math
import os
import tempfile

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from _bad_input import (Guard, Reached, assert_refused, files, probe_json, run,  # noqa: E402
                        tunnel_configs)
from lorasync import catalog  # noqa: E402
from lorasync.config import (SECTIONS, CommConfig, iter_fields, load_config,  # noqa: E402
                             parse_options)
from lorasync.errors import LorasyncError  # noqa: E402
from lorasync.netdiag.tune import link_from_probe_data  # noqa: E402
from lorasync.overlay import tunnel  # noqa: E402
from lorasync.plan.net import net_from_probe  # noqa: E402
from lorasync.train.data import load_datasets, read_jsonl  # noqa: E402

EXAMPLES = int(os.environ.get("LORASYNC_FUZZ_EXAMPLES", "0"))


def fuzz(n: int):
    """``n`` examples (or LORASYNC_FUZZ_EXAMPLES), the same ones on every run."""
    return settings(max_examples=EXAMPLES or n, deadline=None, derandomize=True,
                    database=None, suppress_health_check=[
                        HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                        HealthCheck.data_too_large])


HOSTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "fixtures", "hosts", "good")

# ---------------------------------------------------------------- value strategies

NUMBERS = st.one_of(
    st.integers(-3, 300), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 2**31, 2**63, 10**30, 10**400, 1e-300, 1e300, 0.5, 65536]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=12),
                    st.sampled_from(["", "\0", "demo", "tiny", "auto", "1:3", "h:99999",
                                     "10.0.0.1:29400", "yes", "nan", "1e999", "²", "q_proj"]))
JSON = st.recursive(SCALARS, lambda c: st.lists(c, max_size=3)
                    | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=8)
#: text fragments that break YAML and JSON readers
BREAKERS = st.sampled_from(["[1", "{", "}", "!!python/object:os.system", "&a [*a]", "*b",
                            "'", '"', "\t", "- - -", "%YAML 9", "\\ud800", "[" * 3000,
                            "1" * 5000, "\x00", "\ufeff", "\udcff", "2020-13-45", "\x1f"])


def _deep(n: int) -> str:
    return "[" * n + "]" * n


@pytest.fixture
def guard(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    return Guard(monkeypatch, launch_ok=True)


def _cli(capsys, root, argv, refused_by_reader: bool) -> int:
    """Run ``argv``: exit 0, or the bad-input contract; nothing written either way."""
    before = files(root)
    rc, _, err = run(capsys, argv)
    assert rc in (0, 2), (rc, err[-3000:])
    if rc == 2 or refused_by_reader:
        assert_refused(rc, err)
    assert "Traceback" not in err
    assert files(root) == before, "nothing may be written before the workers start"
    return rc


def _reads(fn, *args, **kw):
    """(result, None) or (None, the LorasyncError): any other exception fails the test."""
    try:
        return fn(*args, **kw), None
    except LorasyncError as exc:
        assert str(exc) and "\n" not in str(exc).strip(), repr(str(exc))
        return None, exc


# ---------------------------------------------------------------- YAML config

def _field_values(section: str, f):
    name = f"{section}.{f.name}"
    if name == "comm.strategy":
        return st.sampled_from(catalog.names() + ["carrier-pigeon", ""])
    if name == "comm.options":
        keys = sorted({k for s in catalog.names() for k, _, _ in catalog.option_help(s)})
        return st.dictionaries(st.sampled_from(keys) | st.text(max_size=6), JSON, max_size=3)
    if name == "lora.targets":
        return st.lists(st.sampled_from(["q_proj", "v_proj", "q", "self_attn", "lm_head", ""])
                        | st.text(max_size=6), max_size=3) | SCALARS
    if name == "data.path":   # never the demo with a huge size: the launcher would build it
        return st.sampled_from(["demo", "missing.jsonl", "", "/", "d.jsonl"]) | SCALARS
    return JSON


#: plausible values of the fields whose default says little
GOOD = {"comm.strategy": catalog.names(), "comm.options": [{}], "data.path": ["demo", "d.jsonl"],
        "run.metrics_port": [0], "run.nnodes": ["", "1"], "run.output_dir": ["", "out"],
        "run.rdzv_endpoint": ["", "127.0.0.1:29400"], "model.dtype": ["float32", "bfloat16"],
        "train.schedule": ["constant", "linear", "cosine"], "run.backend": ["auto", "gloo"],
        "comm.hierarchy": ["auto", "flat", "node"], "comm.cross_node": ["auto", "leaders"],
        "comm.allreduce_algo": ["ring", "recursive_doubling", "auto"],
        "lora.targets": [["q_proj", "v_proj"], "q_proj,k_proj", ["o_proj"]]}


def _good_values(section: str, f):
    """Values near the field's default, valid on their own."""
    name = f"{section}.{f.name}"
    if name in GOOD:
        return st.sampled_from(GOOD[name])
    default = getattr(SECTIONS[section](), f.name)
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, (int, float)):
        return st.sampled_from(sorted({default, default + 1, default * 2}))
    return st.just(default)


@st.composite
def yaml_configs(draw) -> bytes:
    """Raw bytes, text that breaks YAML, or a config of valid values with at
    most one field drawn from anything (an unknown section now and then)."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.binary(max_size=64))
    if kind == 1:
        return (draw(BREAKERS) + draw(st.text(max_size=20))).encode("utf-8", "surrogatepass")
    doc: dict = {}
    every = list(iter_fields())
    for section, f in every:
        if draw(st.integers(0, 7)) == 0:
            doc.setdefault(section, {})[f.name] = draw(_good_values(section, f))
    if kind in (2, 3, 4, 5, 6):
        section, f = every[draw(st.integers(0, len(every) - 1))]
        doc.setdefault(section, {})[f.name] = draw(_field_values(section, f))
    if kind == 7:
        doc[draw(st.text(max_size=6))] = draw(JSON)
    text = yaml.safe_dump(doc, allow_unicode=True)
    return text.encode("utf-8", "surrogatepass")


@fuzz(60)
@given(content=yaml_configs())
def test_fuzz_yaml_config(guard, tmp_path, capsys, content):
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    (tmp_path / "d.jsonl").write_text('{"text": "a row"}\n' * 8)
    out = str(tmp_path / "run")
    cfg, err = _reads(load_config, str(path), {   # what the flags below override
        "model": {"name": "tiny"}, "run": {"progress": False, "output_dir": out}})
    rc = _cli(capsys, tmp_path, ["train", "--config", path, "--model", "tiny", "--no-progress",
                                 "--output-dir", out], err is not None)
    assert rc == 2 or cfg is not None


# ---------------------------------------------------------------- --comm-opt

OPTION_KEYS = sorted({k for s in catalog.names() for k, _, _ in catalog.option_help(s)})
COMM_OPTS = st.one_of(
    st.text(max_size=20),
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(OPTION_KEYS) | st.text(max_size=6),
              st.one_of(BREAKERS, st.text(max_size=12), NUMBERS.map(str),
                        JSON.map(lambda v: json.dumps(v, allow_nan=True)),
                        st.integers(1, 20000).map(_deep))))


def _good_options(strategy: str):
    """KEY=VALUE of one of ``strategy``'s options, its default or twice it."""
    opts = catalog.option_help(strategy)
    if not opts:
        return st.just("warmup=0")   # an option it does not take
    return st.sampled_from(opts).flatmap(lambda o: st.sampled_from(
        [o[1], o[1] * 2 if isinstance(o[1], (int, float)) else o[1]]).map(
        lambda v: f"{o[0]}={json.dumps(v)}"))


@fuzz(50)
@given(data=st.data(), strategy=st.sampled_from(catalog.names()))
def test_fuzz_comm_opt(guard, tmp_path, capsys, data, strategy):
    text = data.draw(COMM_OPTS | _good_options(strategy), label="text")
    opts, err = _reads(parse_options, [text])
    if err is None:
        _, err = _reads(CommConfig, strategy=strategy, options=opts)
    rc = _cli(capsys, tmp_path, ["train", "--model", "tiny", "--no-progress", "--comm", strategy,
                                 f"--comm-opt={text}", "--output-dir", tmp_path / "run"],
              err is not None)
    assert (rc == 2) == (err is not None), (text, strategy)


# ---------------------------------------------------------------- JSONL rows

ROW = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(max_size=12), "completion": st.text(max_size=12)}),
    st.fixed_dictionaries({"text": st.text(max_size=16)}),
    st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "bot"]),
         "content": st.text(max_size=8) | SCALARS}), max_size=3)}),
    JSON)
LINE = st.one_of(
    ROW.map(lambda r: json.dumps(r, allow_nan=True).encode()),
    ROW.map(lambda r: json.dumps(r, ensure_ascii=False).encode("utf-8", "surrogatepass")),
    st.binary(max_size=24), BREAKERS.map(lambda b: b.encode("utf-8", "surrogatepass")),
    st.integers(1, 100_000).map(lambda n: _deep(n).encode()),
    st.sampled_from([b'{"text": "\\ud800"}', b'{"prompt": "a", "completion": "\\udfff"}',
                     b"", b"   ", b"\xef\xbb\xbf{}", b'{"text": ' + b"9" * 5000 + b"}"]))


@fuzz(50)
@given(lines=st.lists(LINE, min_size=0, max_size=6), good=st.integers(0, 3))
def test_fuzz_jsonl_rows(guard, tmp_path, capsys, lines, good):
    from lorasync.config import DataConfig
    from lorasync.train.model import _tiny_tokenizer

    path = tmp_path / "d.jsonl"
    rows = [json.dumps({"prompt": f"p{i}", "completion": f"c{i}"}).encode() for i in range(good)]
    path.write_bytes(b"\n".join(rows + lines) + b"\n")
    got, err = _reads(read_jsonl, str(path))
    if err is None:
        assert all(isinstance(r, dict) for r in got)
        data, err = _reads(load_datasets, DataConfig(path=str(path), seq_len=16, eval_size=2),
                           _tiny_tokenizer(bare=True))
    rc = _cli(capsys, tmp_path, ["train", "--model", "tiny", "--no-progress", "--data", path,
                                 "--nproc", "1", "--batch-size", "1", "--seq-len", "16",
                                 "--output-dir", tmp_path / "run"], err is not None)
    assert (rc == 2) == (err is not None)


# ---------------------------------------------------------------- probe JSON

PROBE_PATHS = [("world_size",), ("backend",), ("model",), ("sweep",), ("pairs",), ("ranks",),
               ("rdma",), ("slowest_pair",), ("model", "alpha_s"), ("model", "bandwidth_Bps"),
               ("model", "beta_s_per_byte"), ("model", "latency_s"), ("sweep", 0),
               ("sweep", 1, "bytes"), ("sweep", 2, "time_s"), ("sweep", 0, "collective"),
               ("pairs", 0), ("pairs", 0, "latency_s"), ("pairs", 0, "latency_min_s"),
               ("slowest_pair", "latency_s")]


#: plan ranks these in milliseconds on any link; a periodic strategy's advice
#: searches for seconds on a 1 kB/s link with a latency of seconds
PER_STEP = ",".join(s for s in catalog.STRATEGIES if s not in catalog.PERIODIC and s != "auto")


@st.composite
def probes(draw):
    if draw(st.integers(0, 9)) == 0:
        return draw(JSON)
    p = probe_json(n=draw(st.integers(1, 8)), alpha=draw(st.floats(1e-6, 0.05)),
                   bw=draw(st.floats(1e5, 1e12)))

    def has(node, k) -> bool:   # node[k] exists (an earlier change may have replaced node)
        if isinstance(node, dict):
            return k in node
        return isinstance(node, list) and isinstance(k, int) and k < len(node)

    for _ in range(draw(st.integers(0, 3))):
        path = draw(st.sampled_from(PROBE_PATHS))
        node = p
        for k in path[:-1]:
            node = node[k] if has(node, k) else None
        if isinstance(node, dict) and draw(st.booleans()) and path[-1] in node:
            del node[path[-1]]
        elif isinstance(node, dict) or has(node, path[-1]):
            node[path[-1]] = draw(NUMBERS | JSON)
    n = p.get("world_size") if isinstance(p, dict) else None
    if isinstance(n, int) and 64 < n <= 1 << 20:   # plan takes seconds for 10,000 ranks
        p["world_size"] = 64
    return p


@fuzz(60)
@given(probe=probes())
def test_fuzz_probe_json(guard, tmp_path, capsys, probe):
    for strict in (False, True):
        _reads(net_from_probe, probe, strict=strict)
        _reads(link_from_probe_data, probe, strict=strict)
    _, err = _reads(net_from_probe, probe, strict=True)
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(probe, allow_nan=True))
    rc = _cli(capsys, tmp_path, ["plan", "--probe", path, "--compute-s", "1", "--strategies",
                                 PER_STEP], err is not None)
    assert rc == 2 or err is None
    _, err = _reads(link_from_probe_data, probe, strict=True)
    rc = _cli(capsys, tmp_path, ["tune", "--root", HOSTS, "--from-probe", path],
              err is not None)
    assert rc == 2 or err is None


def test_fuzz_probe_json_finds_nothing_absurd_in_what_it_accepts():
    # what the strict reader accepts is a link: finite, within the bounds
    net, link = net_from_probe(probe_json(), strict=True)
    assert math.isfinite(net.alpha_s) and 1e3 <= net.bandwidth_Bps <= 1e13


# ---------------------------------------------------------------- tunnel.json

TUNNEL_KEYS = ["version", "node", "hub", "is_hub", "ifname", "address", "subnet", "listen_port",
               "endpoint", "mtu", "keepalive_s", "stale_s", "public_key", "private_key_file",
               "relay", "peers", "routes", "nodes"]
PEER_KEYS = ["name", "address", "public_key", "endpoint", "allowed_ips", "relays", "keepalive_s"]
CIDRS = st.sampled_from(["0.0.0.0/0", "::/0", "0.0.0.0/1", "203.0.113.5/32", "10.77.0.1/32",
                         "10.77.0.0/24", "10.77.0.0/16", "10.78.0.1/32", "fd00::/8", "x",
                         "10.77.0.300/32", "", "10.77.0.1"])


@pytest.fixture(scope="module")
def overlay(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlay")
    return [json.loads(p.read_text()) for p in tunnel_configs(root)], root


@st.composite
def tunnel_jsons(draw, bases):
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.binary(max_size=40))
    raw = json.loads(json.dumps(bases[draw(st.integers(0, len(bases) - 1))]))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["top", "peer", "node", "allowed"]))
        if where == "top":
            key = draw(st.sampled_from(TUNNEL_KEYS))
            if draw(st.integers(0, 3)) == 0:
                raw.pop(key, None)
            else:
                raw[key] = draw(NUMBERS | JSON)
        else:   # inside the first peer or node, while there is one
            key = "nodes" if where == "node" else "peers"
            items = raw.get(key)
            if not (isinstance(items, list) and items and isinstance(items[0], dict)):
                continue
            if where == "allowed":
                items[0]["allowed_ips"] = draw(st.lists(CIDRS | st.text(max_size=8),
                                                        max_size=3))
            else:
                fields = PEER_KEYS if where == "peer" else ["name", "address", "endpoint"]
                items[0][draw(st.sampled_from(fields))] = draw(NUMBERS | JSON | CIDRS)
    return json.dumps(raw, allow_nan=True).encode()


@fuzz(60)
@given(data=st.data())
def test_fuzz_tunnel_json(guard, overlay, capsys, data):
    bases, root = overlay
    content = data.draw(tunnel_jsons(bases))
    with tempfile.TemporaryDirectory(dir=root) as d:
        path = os.path.join(d, "tunnel.json")
        with open(path, "wb") as fh:
            fh.write(content)
        os.symlink(os.path.join(root, "overlay", "a", "private.key"),
                   os.path.join(d, "private.key"))
        cfg, err = _reads(tunnel.load_config, path)
        if err is None:   # a good file: up goes on to the root check, where the guard stops it
            with pytest.raises(Reached):
                run(capsys, ["tunnel", "up", "--config", path])
        else:
            before = files(d)
            rc, _, stderr = run(capsys, ["tunnel", "up", "--config", path])
            assert_refused(rc, stderr)
            assert files(d) == before
