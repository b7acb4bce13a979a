#!/usr/bin/env python3
"""GPU figures for the planner and the docs (run on a CUDA machine).

    python bench/gpu_check.py                      # --quick: no run starts that would end
                                                   # past --budget-s (450 s)
    python bench/gpu_check.py --full               # 1.5B shape too, 20 steps a run
    python bench/gpu_check.py --dry-run-cpu        # the same orchestration on the CPU,
                                                   # tiny shapes, 2 gloo ranks: tests the script

Results go to ``--json`` (default bench/reference/gpu/gpu_check.json), rewritten
after every run (``"complete": false`` until the end), so a run cut short still
leaves what it measured.  Without CUDA (and without --dry-run-cpu) it stops
with one line, exit 2.

1. ``step``: compute time of one training step of the embedded default's
   architecture (SmolLM2-135M config, random weights: the weights do not change
   the timing) + LoRA r=8 on q/k/v/o, batch 4 x 64 tokens, fp32 and bf16
   autocast, in this process: the compute_s a GPU node brings to the cost
   model.  Measured on an H200 before this script grew the sections below:
   0.18 s (fp32 and bf16 alike: this small batch is bound by kernel launches).
2. ``codecs``: encode+decode time of every strategy on the embedded default's
   adapter (921,600 values in 240 tensors) on the GPU, as ``auto`` times it at
   start (``lorasync.comm.loopback.time_encode``: the strategy's hooks alone,
   as on 2 ranks), in ms per sync, and the catalog's CPU figure next to it.
3. ``modes``: the product path, ``python -m lorasync train`` as a subprocess,
   on a random-weight model shaped like Qwen2.5-0.5B (hidden 896, 24 layers,
   14 heads, 2 KV heads, intermediate 4864, vocab 151,936, tied embeddings;
   built here from transformers' ``Qwen2Config``, saved in bfloat16 with the
   project's character tokenizer, whose ids fit the vocabulary), on the demo
   task packed into rows of --seq-len tokens, LoRA r=8 on q/k/v/o, one rank per
   GPU (NCCL), in each mode: fp32, --bf16, --gradient-checkpointing, both, and
   --load-in-4bit (QLoRA, computing in bfloat16; recorded as skipped, with
   lorasync's own refusal, when bitsandbytes is not installed).  Per rank: the
   median step time over the steps after the first, and the peak GPU memory
   (``peak_mem_bytes``: torch.cuda.max_memory_allocated) from the run's
   metrics.jsonl and summary.json.
4. ``strategies``: the same ``lorasync train`` (fp32) with each strategy
   (``--comm``).  On one GPU that is a 1-rank NCCL group: NCCL refuses two
   ranks on one device, and ``lorasync train --backend gloo`` puts its workers
   on the CPU (worker.train_worker: gloo -> device cpu), so it would not measure
   the GPU.  A 1-rank group runs each strategy's hooks (encode, the
   collectives, decode, its state) on CUDA tensors through the real trainer,
   but its collectives cross no link: comm_s here is the strategy's own
   overhead, not a network's; the link's share comes from the cost model
   (``lorasync plan``).  On a machine with several GPUs it runs one rank per
   GPU and the collectives are real NCCL ones.

Medians over repeats, CUDA-synchronised.  Nothing is downloaded: the model is
built from its config, the data is the generated demo task.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "src"))

from lorasync import catalog  # noqa: E402
from lorasync.comm.loopback import time_encode  # noqa: E402
from lorasync.config import LoraSettings  # noqa: E402
from lorasync.plan.costmodel import MODELS, encode_ns, lora_matrices  # noqa: E402
from lorasync.train.model import add_lora  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import encode_share  # noqa: E402  (the outer syncs' encode+decode as a share of a step)

DEFAULT_JSON = os.path.join("bench", "reference", "gpu", "gpu_check.json")

# Shapes of real models (their Hub config.json values), built with random weights.
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         max_position_embeddings=32768),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         max_position_embeddings=32768),
}
# --dry-run-cpu: the same config class, 2 layers and small widths (head_dim 32,
# 2 query heads per KV head), so that a CPU runs it in seconds
TINY_OVERRIDES = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                      max_position_embeddings=2048)

# (label, extra `lorasync train` flags)
MODES = [
    ("fp32", []),
    ("bf16", ["--bf16"]),
    ("gradient_checkpointing", ["--gradient-checkpointing"]),
    ("bf16_gradient_checkpointing", ["--bf16", "--gradient-checkpointing"]),
    # QLoRA's usual: the base in NF4, computing in bfloat16
    ("qlora_4bit", ["--load-in-4bit", "--dtype", "bfloat16"]),
]


# -- 1 and 2: this process ------------------------------------------------------------

def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int, device: str = "cuda") -> list[float]:
    out = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def step_time(steps: int, bf16: bool, device: str = "cuda", layers: int | None = None) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_json_file(os.path.join(os.path.dirname(__file__), "assets",
                                                  "smollm2-135m-config.json"))
    if layers:
        cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    model = add_lora(LlamaForCausalLM(cfg), LoraSettings(), seed=0).to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (4, 64), device=device)

    def one():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    timed(one, 1 if device == "cpu" else 3, device)  # warm-up
    t = timed(one, steps, device)
    del model, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "steps": steps,
            "layers": cfg.num_hidden_layers}


def codecs(repeats: int, device: str = "cuda") -> dict:
    params = [torch.zeros(m, device=device) for m in lora_matrices(MODELS["smollm2-135m"], 8)]
    n = sum(p.numel() for p in params)
    res = {}
    for name in catalog.STRATEGIES:
        t = [time_encode(name, params, 2, bucket_cap_bytes=1 << 20, seed=i) * n * 1e-6
             for i in range(repeats)]
        res[name] = {"ms": statistics.median(t), "cpu_figure_ms": encode_ns(name) * n * 1e-6}
    return res


def outer_codecs(device: str, repeats: int, presets: list[str]) -> dict:
    """DiLoCo's compressed outer syncs on each preset's adapter, as a share of
    its GPU step (bench/encode_share.py's measurement, on ``device``)."""
    return {"device": device, "period": encode_share.PERIOD, "bar": encode_share.BAR,
            "threads": torch.get_num_threads(), "repeats": repeats,
            "workloads": [encode_share.measure(w, device, repeats) for w in presets]}


# -- 3 and 4: lorasync train as subprocesses -------------------------------------------

def shape_config(shape: str, tiny: bool = False) -> dict:
    """The config values of ``shape`` (one of SHAPES), or its 2-layer small-width
    version for a CPU dry run."""
    values = dict(SHAPES[shape])
    if tiny:
        values.update(TINY_OVERRIDES)
    return values


def build_model(shape: str, out_dir: str, *, tiny: bool = False, device: str = "cpu") -> dict:
    """Save a random-weight Qwen2 causal LM of ``shape`` with the project's
    character tokenizer into ``out_dir`` (config.json + safetensors + tokenizer:
    what ``lorasync train --model DIR`` loads); return what was built."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    from lorasync.train.model import _tiny_tokenizer

    hf_logging.disable_progress_bar()

    t0 = time.perf_counter()
    tok = _tiny_tokenizer()
    values = shape_config(shape, tiny)
    if len(tok) > values["vocab_size"]:
        raise ValueError(f"the tokenizer's {len(tok)} ids do not fit vocab {values['vocab_size']}")
    cfg = Qwen2Config(**values, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.eos_token_id, use_sliding_window=False)
    torch.manual_seed(0)
    with torch.device(device):   # random init on the GPU takes a fraction of the CPU's time
        model = Qwen2ForCausalLM(cfg)
    # stored in bfloat16 as the real checkpoints are; each run loads it in its --dtype
    model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"shape": shape + (" (2-layer, small widths: dry run)" if tiny else ""),
            "architecture": "Qwen2ForCausalLM", "config": values, "params": params,
            "tokenizer": f"lorasync's character tokenizer ({len(tok)} ids)",
            "build_s": round(time.perf_counter() - t0, 1)}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def read_run(run_dir: str) -> dict:
    """Per-rank figures of a finished run from its metrics.jsonl and summary.json:
    medians over the steps after the first (DDP's bucket rebuild and the
    allocator's warm-up are in the first)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        recs = [json.loads(line) for line in fh if line.strip()]
    with open(os.path.join(run_dir, "summary.json")) as fh:
        summary = json.load(fh)
    ranks = sorted({r["rank"] for r in recs})
    first = min(r["step"] for r in recs)
    per_rank = []
    for rank in ranks:
        mine = sorted((r for r in recs if r["rank"] == rank), key=lambda r: r["step"])
        steady = [r for r in mine if r["step"] != first] or mine
        per_rank.append({
            "rank": rank, "steps": len(mine),
            "step_s_median": _median(r["step_s"] for r in steady),
            "step_s_min": min(r["step_s"] for r in steady),
            "step_s_max": max(r["step_s"] for r in steady),
            "compute_s_median": _median(r["compute_s"] for r in steady),
            "comm_s_median": _median(r["comm_s"] for r in steady),
            "encode_s_median": _median(r.get("encode_s") for r in steady),
            "wire_bytes_per_step": _median(r["wire_bytes"] for r in steady),
            "tokens_per_step": _median(r["tokens"] for r in steady),
            "samples_per_step": _median(r["samples"] for r in steady),
            "peak_mem_bytes": max((r.get("peak_mem_bytes") or 0 for r in mine), default=0),
            "final_loss": mine[-1]["loss"],
        })
    return {"per_rank": per_rank,
            "step_s_median": max(p["step_s_median"] for p in per_rank),   # the slowest rank
            "peak_mem_bytes": summary.get("peak_mem_bytes"),
            "peak_mem_kind": summary.get("peak_mem_kind"),
            "adapter_params": summary.get("adapter_params"),
            "samples_per_s": summary.get("samples_per_s"),
            "final_loss": summary.get("final_loss")}


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def train_run(model_dir: str, work: str, label: str, extra: list[str], common: list[str],
              timeout_s: float) -> dict:
    """One ``python -m lorasync train`` run; its figures, or why it did not run."""
    out = os.path.join(work, label)
    argv = [sys.executable, "-m", "lorasync", "train", "--model", model_dir,
            "--output-dir", out, *common, *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(REPO, "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    shown = ["lorasync", "train", "--model", "MODEL", *common, *extra]
    res = {"args": shown[2:]}
    t0 = time.perf_counter()
    # its own session, so that a timeout ends torchrun's workers too (they hold the GPU)
    p = subprocess.Popen(argv, env=env, cwd=work, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        res.update(status="failed", message=f"timed out after {timeout_s:.0f} s",
                   wall_s=round(time.perf_counter() - t0, 1),
                   output_tail=stdout[-1500:] + "\n--- stderr ---\n" + stderr[-3000:])
        return res
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    res["exit_code"] = p.returncode
    with open(os.path.join(work, label + ".log"), "w") as fh:
        fh.write(stdout + "\n--- stderr ---\n" + stderr)
    if p.returncode != 0:
        res["message"] = _last_line(stderr) or _last_line(stdout)
        if "--load-in-4bit" in extra and importlib.util.find_spec("bitsandbytes") is None:
            res["status"] = "skipped: bitsandbytes not installed"
        else:
            res["status"] = "failed"
            res["output_tail"] = stdout[-1500:] + "\n--- stderr ---\n" + stderr[-3000:]
        return res
    try:
        res.update(read_run(out))
    except (OSError, ValueError, KeyError) as exc:
        res.update(status="failed", message=f"ran, but its results do not read: {exc}")
        return res
    res["status"] = "ok"
    shutil.rmtree(os.path.join(out, "adapter"), ignore_errors=True)
    return res


def _guarded(fn, *args, **kwargs) -> dict:
    """``fn``'s result, or {"status": "failed", "message": ...} when it raises."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:   # noqa: BLE001 -- recorded, and the other parts still run
        import traceback

        print(f"gpu_check: {fn.__name__} failed: {exc!r}", file=sys.stderr, flush=True)
        return {"status": "failed", "message": f"{type(exc).__name__}: {exc}"[:500],
                "traceback": traceback.format_exc()[-3000:]}
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _version(pkg: str):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


class Report:
    """The result JSON, rewritten after every part so that a cut-short run keeps
    what it measured."""

    def __init__(self, path: str, data: dict):
        self.path, self.data = path, data

    def save(self) -> None:
        if not self.path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(self.data, fh, indent=1)
        os.replace(tmp, self.path)


def _mib(b) -> str:
    return f"{b / 2**20:,.0f}" if b else "n/a"


def markdown(d: dict) -> str:
    """The train runs of a result file as markdown tables (for docs/benchmarks.md)."""
    out = []
    for key in ("step_fp32", "step_bf16"):
        r = d.get(key) or {}
        if "median_s" in r:
            out.append(f"{key}: {r['median_s']:.3f} s median over {r['steps']} steps "
                       f"(min {r['min_s']:.3f}, max {r['max_s']:.3f})\n")
    enc = d.get("encode_ms_per_sync") or {}
    if enc and "status" not in enc:
        out += [f"| strategy | encode+decode on {d.get('encode_ms_per_sync_device')} (ms per "
                "sync) | catalog's CPU figure (ms) |", "|---|---|---|"]
        out += [f"| {k} | {v['ms']:.2f} | {v['cpu_figure_ms']:.2f} |" for k, v in enc.items()]
        out.append("")
    share = d.get("encode_share") or {}
    if share.get("workloads"):
        from tables import encode_share as share_table
        out += [share_table({**share, "device": d.get("device") or share["device"]}), ""]
    t = d.get("train") or {}
    for shape, e in t.get("shapes", {}).items():
        m = e["model"]
        if m.get("status") == "failed":
            out.append(f"{shape}: the model was not built: {m.get('message')}\n")
            continue
        out.append(f"{m['shape']}: {m['params']:,} parameters, random weights; "
                   f"{t.get('workload', '')}; {t.get('nproc')} rank(s), {t.get('backend')}, "
                   f"{d.get('device')}, torch {d.get('torch')}"
                   + ("" if d.get("complete") else " (INCOMPLETE run)") + "\n")
        mem = "resident memory (CPU)" if d.get("dry_run_cpu") else "GPU memory allocated"
        for section, head in (("modes", "mode"), ("strategies", "strategy")):
            if not e.get(section):
                continue
            out.append(f"| {head} | step time, median (s) | compute / exposed sync (s) | "
                       f"tokens per step per rank | peak {mem} per rank (MiB) |")
            out.append("|---|---|---|---|---|")
            for label, r in e[section].items():
                if r.get("status") != "ok":
                    why = r.get("status", "")
                    if r.get("message"):
                        why += f" (`{r['message'][:160]}`)"
                    out.append(f"| {label} | {why} | | | |")
                    continue
                p0 = r["per_rank"][0]
                out.append(f"| {label} | {r['step_s_median']:.3f} | {p0['compute_s_median']:.3f}"
                           f" / {p0['comm_s_median']:.3f} | {p0['tokens_per_step']:,.0f} | "
                           + " / ".join(_mib(b) for b in (r.get("peak_mem_bytes") or []))
                           + " |")
            out.append("")
    return "\n".join(out)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", dest="full", action="store_false",
                    help="the default: the 0.5B shape, --train-steps 6")
    ap.add_argument("--full", dest="full", action="store_true",
                    help="also the modes on the 1.5B shape; --train-steps 20")
    ap.set_defaults(full=False)
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="run the same orchestration on the CPU with tiny shapes (2 layers), "
                         "2 steps, 2 gloo ranks: tests this script, measures nothing")
    ap.add_argument("--json", default=DEFAULT_JSON, help="result file (default %(default)s)")
    ap.add_argument("--sections", default="step,codecs,modes,strategies",
                    help="comma-separated subset of step,codecs,modes,strategies")
    ap.add_argument("--modes", default=",".join(m for m, _ in MODES),
                    help="comma-separated subset of the modes")
    ap.add_argument("--strategies", default=",".join(catalog.STRATEGIES),
                    help="comma-separated subset of the strategies")
    ap.add_argument("--steps", type=int, default=10, help="timed steps of the 'step' section")
    ap.add_argument("--train-steps", type=int, default=0,
                    help="optimizer steps of each lorasync train run (default 6, --full 20, "
                         "dry run 2)")
    ap.add_argument("--batch-size", type=int, default=0,
                    help="rows per rank per step (default 4, dry run 2)")
    ap.add_argument("--seq-len", type=int, default=0,
                    help="tokens per packed row (default 1024, dry run 128)")
    ap.add_argument("--nproc", type=int, default=0,
                    help="ranks of each run (default: one per GPU; dry run 2)")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="skip the runs that would end after this many seconds of the script "
                         "(default 450, dry run none)")
    ap.add_argument("--run-timeout-s", type=float, default=0,
                    help="bound of one lorasync train run (default 180, dry run 600)")
    ap.add_argument("--table", metavar="JSON", default="",
                    help="print the train runs of a result file as markdown tables, and exit")
    ap.add_argument("--keep", default="",
                    help="keep the model and the run directories here (default: a temporary "
                         "directory, removed)")
    a = ap.parse_args(argv)
    dry = a.dry_run_cpu
    a.train_steps = a.train_steps or (2 if dry else 20 if a.full else 6)
    a.batch_size = a.batch_size or (2 if dry else 4)
    a.seq_len = a.seq_len or (128 if dry else 1024)
    a.budget_s = a.budget_s or (0 if dry else 900 if a.full else 450)
    a.run_timeout_s = a.run_timeout_s or (600 if dry else 180)
    a.sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    a.strategies = [s.strip() for s in a.strategies.split(",") if s.strip()]
    for name, got, known in (("--sections", a.sections, ["step", "codecs", "modes", "strategies"]),
                             ("--modes", a.modes, [m for m, _ in MODES]),
                             ("--strategies", a.strategies, list(catalog.STRATEGIES))):
        bad = [x for x in got if x not in known]
        if bad:
            ap.error(f"{name}: {bad[0]!r} is not one of {', '.join(known)}")
    for name in ("train_steps", "batch_size", "seq_len"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: give a positive integer")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.table:
        with open(a.table) as fh:
            print(markdown(json.load(fh)))
        return 0
    if not a.dry_run_cpu and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__} sees none): run it on a "
              "GPU machine, or --dry-run-cpu to test the orchestration on this CPU",
              file=sys.stderr)
        return 2
    device = "cpu" if a.dry_run_cpu else "cuda"
    gpus = 0 if a.dry_run_cpu else torch.cuda.device_count()
    nproc = a.nproc or (2 if a.dry_run_cpu else gpus)
    t_start = time.perf_counter()
    rep = Report(a.json, {
        "complete": False, "dry_run_cpu": a.dry_run_cpu, "quick": not a.full,
        "device": torch.cuda.get_device_name(0) if gpus else "cpu (dry run)", "gpus": gpus,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": _version("transformers"), "peft": _version("peft"),
        "bitsandbytes": _version("bitsandbytes"),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python bench/gpu_check.py " + " ".join(sys.argv[1:] if argv is None
                                                            else argv)})
    d = rep.data
    # a part that fails is recorded and the next one runs: device time is scarce
    if "step" in a.sections:
        layers = 2 if a.dry_run_cpu else None
        steps = 2 if a.dry_run_cpu else a.steps
        for key, bf16 in (("step_fp32", False), ("step_bf16", True)):
            d[key] = _guarded(step_time, steps, bf16, device, layers)
            rep.save()
    if "codecs" in a.sections:
        d["encode_ms_per_sync"] = _guarded(codecs, 1 if a.dry_run_cpu else 5, device)
        d["encode_ms_per_sync_device"] = device
        rep.save()
        # the bar: DiLoCo's compressed outer syncs on each workload's
        # adapter (the 7B preset's 40M values too), as a share of its GPU step
        # (dry run: the small preset only, 1 timing)
        d["encode_share"] = _guarded(outer_codecs, device, 1 if a.dry_run_cpu else 3,
                                     ["smollm2-h200"] if a.dry_run_cpu
                                     else list(encode_share.PRESETS))
        rep.save()

    runs = [("modes", label, extra) for label, extra in MODES if label in a.modes] \
        if "modes" in a.sections else []
    runs += [("strategies", s, ["--comm", s]) for s in a.strategies] \
        if "strategies" in a.sections else []
    shapes = ["qwen2.5-0.5b"] + (["qwen2.5-1.5b"] if a.full and not a.dry_run_cpu else [])
    if runs:
        packing = importlib.util.find_spec("trl") is not None
        common = ["--data", "demo", "--eval-size", "0", "--no-eval-before",
                  "--ckpt-interval", "0", "--max-steps", str(a.train_steps),
                  "--warmup-steps", "1", "--batch-size", str(a.batch_size),
                  "--seq-len", str(a.seq_len), *(["--packing"] if packing else []),
                  "--lora-r", "8", "--seed", "0", "--nproc", str(nproc),
                  "--backend", "gloo" if a.dry_run_cpu else "nccl",
                  "--max-restarts", "0", "--no-progress"]
        if a.dry_run_cpu:
            common += ["--threads", "1"]
        d["train"] = {
            "nproc": nproc, "backend": "gloo" if a.dry_run_cpu else "nccl",
            "packing": packing,
            "workload": f"demo task, {'packed into rows of ' if packing else 'rows up to '}"
                        f"{a.seq_len} tokens, batch {a.batch_size} rows per rank, "
                        f"{a.train_steps} steps, LoRA r=8 on q/k/v/o, AdamW",
            "strategies_note": (
                f"{nproc} rank(s), one per GPU: NCCL refuses two ranks on one device and "
                "lorasync train --backend gloo computes on the CPU, so with one GPU each "
                "strategy runs on a 1-rank NCCL group: its hooks (encode, collectives, "
                "decode, state) run on CUDA tensors through the real trainer, but the "
                "collectives cross no link; comm_s is the strategy's own overhead"
                if nproc == 1 and not a.dry_run_cpu else
                f"{nproc} ranks" + (" on the CPU (dry run)" if a.dry_run_cpu else "")),
            "shapes": {}}
        rep.save()
        work = a.keep or tempfile.mkdtemp(prefix="gpu_check-")
        os.makedirs(work, exist_ok=True)
        walls: list[float] = []
        try:
            for si, shape in enumerate(shapes):
                model_dir = os.path.join(work, "model-" + shape)
                entry = d["train"]["shapes"][shape] = {
                    "model": _guarded(build_model, shape, model_dir, tiny=a.dry_run_cpu,
                                      device=device),
                    "modes": {}, "strategies": {}}
                rep.save()
                if entry["model"].get("status") == "failed":
                    continue
                for section, label, extra in runs:
                    if si and section == "strategies":
                        continue   # the strategies on the first shape only
                    elapsed = time.perf_counter() - t_start
                    # a typical run (one that hung to its timeout says nothing of the next)
                    guess = statistics.median(walls) if walls else 0.0
                    if a.budget_s and elapsed + guess > a.budget_s:
                        entry[section][label] = {
                            "status": f"skipped: time budget (--budget-s {a.budget_s:.0f}; "
                                      f"{elapsed:.0f} s used, a run takes about {guess:.0f} s)"}
                        rep.save()
                        continue
                    print(f"gpu_check: {shape} {section} {label} ...", file=sys.stderr,
                          flush=True)
                    timeout = a.run_timeout_s if not a.budget_s else \
                        min(a.run_timeout_s, max(60.0, a.budget_s + 60 - elapsed))
                    res = train_run(model_dir, work, f"{shape}-{section}-{label}", extra,
                                    common, timeout)
                    if "wall_s" in res and not res.get("message", "").startswith("timed out"):
                        walls.append(res["wall_s"])
                    entry[section][label] = res
                    print(f"gpu_check:   {res['status']}"
                          + (f", step {res['step_s_median']:.3f} s, peak "
                             f"{[round((b or 0) / 2**20) for b in res['peak_mem_bytes']]} MiB"
                             if res["status"] == "ok" else f": {res.get('message', '')}"),
                          file=sys.stderr, flush=True)
                    rep.save()
                if not a.keep:
                    shutil.rmtree(model_dir, ignore_errors=True)
        finally:
            if not a.keep:
                shutil.rmtree(work, ignore_errors=True)
    d["complete"] = True
    d["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    rep.save()
    print(json.dumps(d, indent=1))
    failed = [k for k in ("step_fp32", "step_bf16", "encode_ms_per_sync")
              if d.get(k, {}).get("status") == "failed"]
    failed += [f"{shape}/model" for shape, e in d.get("train", {}).get("shapes", {}).items()
               if e["model"].get("status") == "failed"]
    failed += [f"{shape}/{sec}/{k}" for shape, e in d.get("train", {}).get("shapes", {}).items()
               for sec in ("modes", "strategies") for k, v in e[sec].items()
               if v.get("status") == "failed"]
    if failed:
        print(f"gpu_check: {len(failed)} run(s) failed: {', '.join(failed)} (see their "
              "message and output_tail in the JSON)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
