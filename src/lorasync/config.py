"""Typed, validated configuration of a training run.

One dataclass per component; every field carries its help text and CLI flag
in ``metadata``, so the CLI and the YAML loader are generated from these
classes (one source of truth).  Each class validates itself in
``__post_init__``; errors name the field, the value and the fix.

YAML layout (every section and key optional)::

    model: {name: smollm2-135m}
    lora:  {r: 8, alpha: 16, dropout: 0.0, targets: [q_proj, k_proj, v_proj, o_proj]}
    data:  {path: demo, seq_len: 1024, format: auto, packing: false}
    train: {batch_size: 4, grad_accum: 1, lr: 2.0e-3, max_steps: 120, seed: 0}
    comm:  {strategy: auto, bucket_mb: 1.0, options: {period: 8}}
    run:   {output_dir: runs/..., nproc: 2}
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any

from lorasync import catalog
from lorasync.errors import ConfigError, LorasyncError, UnknownKey
from lorasync.units import parse_hostport

__all__ = [
    "ModelConfig", "LoraSettings", "DataConfig", "TrainConfig", "CommConfig", "RunConfig",
    "Config", "load_config", "config_to_dict", "iter_fields", "parse_nnodes", "parse_endpoint",
]


def _f(default, help: str, flag: str | None = None, **kw):
    """A dataclass field with help text and an optional CLI flag name."""
    meta = {"help": help}
    if flag:
        meta["flag"] = flag
    if callable(default) and not isinstance(default, (str, int, float, bool)):
        return field(default_factory=default, metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def _check(cond: bool, name: str, value, fix: str) -> None:
    if not cond:
        raise ConfigError(name, value, fix)


def _use_either(values) -> str:
    """``use a, b or c``: the fix for a value outside ``values``."""
    return "use " + ", ".join(values[:-1]) + " or " + values[-1]


@dataclass
class ModelConfig:
    name: str = _f("smollm2-135m", "model: 'smollm2-135m' (embedded default), 'tiny' "
                   "(small random-init model for tests), a local Hugging Face causal-LM "
                   "directory, or a Hub id (org/name) already in the local Hugging Face cache "
                   "(nothing downloads: fetch it first with `hf download ID`)",
                   flag="--model")
    dtype: str = _f("float32", "parameter dtype of the base model (float32, bfloat16); with "
                    "--load-in-4bit also the compute dtype", flag="--dtype")
    load_in_4bit: bool = _f(False, "QLoRA: load the base in 4 bits through bitsandbytes "
                            "(needs bitsandbytes and a device it supports, a CUDA GPU)",
                            flag="--load-in-4bit")
    load_in_8bit: bool = _f(False, "load the base in 8 bits (LLM.int8) through bitsandbytes "
                            "(needs bitsandbytes and a device it supports, a CUDA GPU)",
                            flag="--load-in-8bit")
    quant_type: str = _f("nf4", "4-bit data type with --load-in-4bit: nf4 (QLoRA's) or fp4",
                         flag="--bnb-4bit-quant-type")
    double_quant: bool = _f(True, "with --load-in-4bit also quantize the quantization "
                            "constants (QLoRA's double quantization)",
                            flag="--bnb-4bit-double-quant")

    def __post_init__(self):
        _check(isinstance(self.name, str) and self.name != "", "model.name", self.name,
               "give 'smollm2-135m', 'tiny', a path to a local model directory or a Hub id")
        _check(self.dtype in ("float32", "bfloat16"), "model.dtype", self.dtype,
               "use float32 or bfloat16")
        _check(not (self.load_in_4bit and self.load_in_8bit), "model.load_in_8bit", True,
               "choose one of --load-in-4bit and --load-in-8bit")
        _check(self.name != "tiny" or not (self.load_in_4bit or self.load_in_8bit),
               "model.name", self.name, "'tiny' is built in memory, not loaded, so it cannot "
               "be quantized; give a model directory or Hub id, or drop --load-in-4bit/8bit")
        _check(self.quant_type in ("nf4", "fp4"), "model.quant_type", self.quant_type,
               "use nf4 or fp4")


@dataclass
class LoraSettings:
    r: int = _f(8, "LoRA rank", flag="--lora-r")
    alpha: float = _f(16.0, "LoRA alpha (scaling = alpha / r, or alpha / sqrt(r) with "
                      "--use-rslora)", flag="--lora-alpha")
    dropout: float = _f(0.0, "LoRA dropout probability", flag="--lora-dropout")
    targets: list = _f(lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                       "module names that get adapters, or all-linear (every linear layer "
                       "but the output head, as PEFT picks them)", flag="--lora-targets")
    freeze_a: bool = _f(False, "FFA-LoRA: freeze the A matrices, train and sync only B "
                        "(half the traffic; averaging becomes exact)", flag="--freeze-a")
    use_dora: bool = _f(False, "DoRA: weight-decomposed LoRA (PEFT's use_dora; a trained "
                        "magnitude per output feature)", flag="--use-dora")
    use_rslora: bool = _f(False, "rsLoRA: scale by alpha / sqrt(r) (PEFT's use_rslora)",
                          flag="--use-rslora")
    modules_to_save: list = _f(list, "modules trained whole and saved with the adapter "
                               "besides it (PEFT's modules_to_save: every module whose full "
                               "name ends with one of them), e.g. lm_head",
                               flag="--lora-modules-to-save")
    options: dict = _f(dict, "other fields of PEFT's LoraConfig as key=value pairs, e.g. "
                       "init_lora_weights=gaussian", flag="--lora-opt")

    def __post_init__(self):
        _check(isinstance(self.r, int) and self.r >= 1, "lora.r", self.r, "use an integer >= 1")
        _check(_num(self.alpha) and self.alpha > 0, "lora.alpha", self.alpha, "use a number > 0")
        _check(_num(self.dropout) and 0 <= self.dropout < 1, "lora.dropout", self.dropout,
               "use a number in [0, 1)")
        if isinstance(self.targets, str):
            self.targets = [t.strip() for t in self.targets.split(",") if t.strip()]
        _check(isinstance(self.targets, list) and len(self.targets) > 0
               and all(isinstance(t, str) and t for t in self.targets),
               "lora.targets", self.targets, "give a non-empty list of module names, e.g. q_proj,v_proj")
        _check("all-linear" not in self.targets or self.targets == ["all-linear"],
               "lora.targets", self.targets, "all-linear stands alone: give all-linear or "
               "module names, not both")
        if isinstance(self.modules_to_save, str):
            self.modules_to_save = [t.strip() for t in self.modules_to_save.split(",")
                                    if t.strip()]
        _check(isinstance(self.modules_to_save, list)
               and all(isinstance(t, str) and t for t in self.modules_to_save),
               "lora.modules_to_save", self.modules_to_save,
               "give a list of module names, e.g. lm_head")
        _check(isinstance(self.options, dict), "lora.options", self.options,
               "give a mapping of LoraConfig fields to values")
        if self.options:   # PEFT's fields (the import costs seconds: only when used)
            _check_lora_options(self.options)


#: LoraConfig fields lorasync sets itself, and the flag that sets each (None: fixed)
LORA_OWN_FIELDS = {"r": "--lora-r", "lora_alpha": "--lora-alpha",
                   "lora_dropout": "--lora-dropout", "target_modules": "--lora-targets",
                   "use_dora": "--use-dora", "use_rslora": "--use-rslora",
                   "modules_to_save": "--lora-modules-to-save", "task_type": None,
                   "peft_type": None, "base_model_name_or_path": None, "revision": None,
                   "inference_mode": None, "auto_mapping": None, "peft_version": None}


def _check_lora_options(options: dict) -> None:
    """Each key of ``lora.options`` is a field of PEFT's ``LoraConfig`` that
    lorasync does not set itself; a ConfigError naming the key and the fix
    otherwise (the values are PEFT's to judge: ``train.model.lora_config``)."""
    from dataclasses import fields as dc_fields

    from peft import LoraConfig

    names = [f.name for f in dc_fields(LoraConfig)]
    for key in options:
        if key in LORA_OWN_FIELDS:
            flag = LORA_OWN_FIELDS[key]
            raise ConfigError(f"lora.options.{key}", options[key],
                              f"set it with {flag}" if flag else "lorasync sets it itself; "
                              "drop it")
        if key not in names:
            raise UnknownKey("lora.options", key, [n for n in names if n not in LORA_OWN_FIELDS],
                             what="LoraConfig field", field=_option_field(key, "lora"))


# row formats of --data-format, and the fields --data-columns can map (train/data.py)
DATA_FORMATS = ("auto", "prompt_completion", "text", "messages", "alpaca", "sharegpt")
DATA_COLUMNS = ("prompt", "completion", "text", "messages", "conversations", "instruction",
                "input", "output", "system")


@dataclass
class DataConfig:
    path: str = _f("demo", "'demo' (bundled generated task), a .jsonl, .json, .csv, .tsv or "
                   ".parquet file, a directory written by datasets' save_to_disk (or of such "
                   "files), or the id of a Hub dataset in the local cache (docs/data.md)",
                   flag="--data")
    seq_len: int = _f(1024, "maximum tokens per example: longer ones are truncated and counted "
                      "in a warning; batches are padded only to their longest example",
                      flag="--seq-len")
    eval_path: str = _f("", "evaluation data, any form --data takes; default: the demo's "
                        "held-out split, the dataset's validation/test split, or the last "
                        "eval_size rows of --data", flag="--eval-data")
    eval_size: int = _f(48, "examples used for eval loss and exact-match", flag="--eval-size")
    demo_size: int = _f(4000, "training examples the demo task generates", flag="--demo-size")
    format: str = _f("auto", "row format: auto (detected from the columns), prompt_completion, "
                     "text, messages, alpaca or sharegpt", flag="--data-format")
    columns: dict = _f(dict, "map your column names to the format's, e.g. "
                       "prompt=question,completion=answer (fields: " + ", ".join(DATA_COLUMNS)
                       + ")", flag="--data-columns")
    split: str = _f("train", "split of a dataset directory or Hub dataset to train on",
                    flag="--data-split")
    packing: bool = _f(False, "pack several examples into each sequence of seq_len tokens "
                       "(fewer, fuller rows; attention and loss stay within each example)",
                       flag="--packing")

    def __post_init__(self):
        _check(isinstance(self.path, str) and self.path != "", "data.path", self.path,
               "give 'demo', a data file, a dataset directory or a cached Hub dataset id")
        _check(isinstance(self.seq_len, int) and 8 <= self.seq_len <= 32768, "data.seq_len",
               self.seq_len, "use an integer between 8 and 32768")
        _check(_int(self.eval_size) and 0 <= self.eval_size <= 100_000, "data.eval_size",
               self.eval_size, "use an integer between 0 (no evaluation) and 100000")
        _check(_int(self.demo_size) and 16 <= self.demo_size <= 1_000_000, "data.demo_size",
               self.demo_size, "use an integer between 16 and 1000000")
        # the demo task brings its own held-out split and would ignore the file
        _check(not (self.path == "demo" and self.eval_path), "data.eval_path", self.eval_path,
               "the demo task evaluates on its own held-out split: drop --eval-data, or give "
               "--data FILE.jsonl to evaluate your rows on it")
        _check(self.format in DATA_FORMATS, "data.format", self.format, _use_either(DATA_FORMATS))
        self.columns = _column_map(self.columns)
        _check(isinstance(self.split, str) and self.split.strip() != "", "data.split",
               self.split, "name a split, e.g. train")


def _column_map(value) -> dict[str, str]:
    """``"prompt=question,completion=answer"`` (or the YAML mapping) -> {field: column}."""
    if isinstance(value, str):
        pairs = {}
        for part in (p.strip() for p in value.split(",")):
            if not part:
                continue
            k, eq, v = part.partition("=")
            _check(bool(eq) and k.strip() != "" and v.strip() != "", "data.columns", value,
                   "write FIELD=COLUMN pairs separated by commas, e.g. "
                   "prompt=question,completion=answer")
            _check(k.strip() not in pairs, "data.columns", value,
                   f"{k.strip()!r} is mapped twice; map each field once")
            pairs[k.strip()] = v.strip()
        value = pairs
    _check(isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) and v
                                           for k, v in value.items()),
           "data.columns", value, "give a mapping of field names to column names, e.g. "
           "prompt=question,completion=answer")
    for k in value:
        _check(k in DATA_COLUMNS, "data.columns", k, "map one of the format's fields: "
               + ", ".join(DATA_COLUMNS))
    _check(len(set(value.values())) == len(value), "data.columns", value,
           "map each column to one field only")
    return dict(value)


@dataclass
class TrainConfig:
    batch_size: int = _f(4, "examples per rank per micro-batch", flag="--batch-size")
    grad_accum: int = _f(1, "micro-batches per optimizer step (gradient accumulation)",
                         flag="--grad-accum")
    max_grad_accum: int = _f(0, "adaptive accumulation with --comm auto: up to this many "
                             "micro-batches per sync while the step waits on sync, back down "
                             "to --grad-accum when it does not (0: fixed)",
                             flag="--max-grad-accum")
    lr: float = _f(2e-3, "peak learning rate (AdamW)", flag="--lr")
    weight_decay: float = _f(0.0, "AdamW weight decay", flag="--weight-decay")
    schedule: str = _f("cosine", "learning-rate schedule: constant, linear or cosine",
                       flag="--schedule")
    warmup_steps: int = _f(5, "linear warm-up steps of the schedule", flag="--warmup-steps")
    max_steps: int = _f(120, "optimizer steps to run (0: use --epochs)", flag="--max-steps")
    epochs: float = _f(0.0, "passes over the training data when --max-steps is 0",
                       flag="--epochs")
    seed: int = _f(0, "seed of data order, adapter init and dropout", flag="--seed")
    eval_interval: int = _f(0, "evaluate every N steps (0: only before and after training)",
                            flag="--eval-interval")
    ckpt_interval: int = _f(40, "write a checkpoint every N steps (0: only at the end)",
                            flag="--ckpt-interval")
    keep_ckpts: int = _f(2, "checkpoints kept (older ones are deleted)", flag="--keep-ckpts")
    stop_after: int = _f(0, "end this session after step N, checkpointed, keeping the schedule "
                         "of max_steps (a time-boxed run; continue it with --resume)",
                         flag="--stop-after")
    max_new_tokens: int = _f(24, "tokens generated per example for exact-match",
                             flag="--max-new-tokens")
    eval_before: bool = _f(True, "also evaluate the untrained adapter before step 1",
                           flag="--eval-before")
    eval_mean: bool = _f(False, "under local SGD and DiLoCo, evaluate the mean of the ranks' "
                         "adapters between outer syncs (the model finish() would give, an "
                         "outer update still in flight aside) instead of each rank its own "
                         "on its share of the examples: one fp32 all-reduce of the adapter "
                         "per evaluation, outside the strategy's bytes", flag="--eval-mean")
    bf16: bool = _f(False, "bf16 mixed precision: forward and backward under torch.autocast "
                    "(bfloat16) on the device; the adapter, its gradients and the optimizer "
                    "stay fp32", flag="--bf16")
    fp16: bool = _f(False, "fp16 mixed precision: torch.autocast (float16) with a loss "
                    "scaler (torch.amp.GradScaler); not with error-feedback strategies "
                    "(int8, onebit, topk, powersgd, auto)", flag="--fp16")
    gradient_checkpointing: bool = _f(False, "recompute the base model's activations in "
                                      "backward instead of keeping them (less memory, about "
                                      "a third more compute)", flag="--gradient-checkpointing")
    max_grad_norm: float = _f(1.0, "clip the gradient's global L2 norm to this (0: no "
                              "clipping): the synchronized gradient under per-step "
                              "strategies, each replica's own under local and diloco",
                              flag="--max-grad-norm")

    def __post_init__(self):
        for name, lo in (("batch_size", 1), ("grad_accum", 1), ("warmup_steps", 0),
                         ("max_steps", 0), ("eval_interval", 0), ("ckpt_interval", 0),
                         ("keep_ckpts", 1), ("max_new_tokens", 1), ("stop_after", 0)):
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= lo, f"train.{name}",
                   v, f"use an integer >= {lo}")
        _check(_int(self.seed) and 0 <= self.seed < 2**32, "train.seed", self.seed,
               "use an integer between 0 and 4294967295")
        _check(_num(self.lr) and 0 < self.lr < 1, "train.lr", self.lr, "use a number in (0, 1)")
        _check(_num(self.weight_decay) and self.weight_decay >= 0, "train.weight_decay",
               self.weight_decay, "use a number >= 0")
        _check(self.schedule in ("constant", "linear", "cosine"), "train.schedule",
               self.schedule, "use constant, linear or cosine")
        _check(_num(self.epochs) and self.epochs >= 0, "train.epochs", self.epochs,
               "use a number >= 0")
        _check(self.max_steps > 0 or self.epochs > 0, "train.max_steps", self.max_steps,
               "set --max-steps > 0 or --epochs > 0")
        _check(isinstance(self.max_grad_accum, int) and (
            self.max_grad_accum == 0 or self.max_grad_accum >= self.grad_accum),
            "train.max_grad_accum", self.max_grad_accum,
            "use 0 (fixed accumulation) or a value >= grad_accum")
        _check(_num(self.max_grad_norm) and self.max_grad_norm >= 0, "train.max_grad_norm",
               self.max_grad_norm, "use a number > 0, or 0 to turn clipping off")
        _check(not (self.bf16 and self.fp16), "train.fp16", self.fp16,
               "choose one of --bf16 and --fp16")


#: auto's candidates under --fp16 when none are given (train.precision._fp16_refused)
FP16_AUTO_CANDIDATES = "allreduce,fp16"


@dataclass
class CommConfig:
    strategy: str = _f("auto", "gradient-sync strategy: " + ", ".join(
                       n for n in catalog.names() if n != "none") + " (auto measures the "
                       "network and picks, the default here and in lorasync.hf.attach; none = "
                       "no sync: the "
                       "compute ceiling; `lorasync train --list-strategies` describes them)",
                       flag="--comm")
    options: dict = _f(dict, "strategy options as key=value pairs, e.g. period=8",
                       flag="--comm-opt")
    bucket_mb: float = _f(1.0, "DDP bucket size in MB: the 3.7 MB default adapter in 1 MB "
                          "buckets overlaps most of its sync with the backward pass; larger "
                          "buckets cost fewer round trips but expose more sync",
                          flag="--bucket-mb")
    broadcast_buffers: bool = _f(False, "re-broadcast module buffers from rank 0 before every "
                                 "forward (DDP's default; not needed here: the model's buffers, "
                                 "rotary tables, never change)", flag="--broadcast-buffers")
    hierarchy: str = _f("auto", "layout across nodes: auto (hierarchical where several nodes "
                        "hold several ranks each), flat (every collective over all ranks) or "
                        "node (exact all-reduce inside each node, the strategy across node "
                        "leaders)", flag="--hierarchy")
    cross_node: str = _f("auto", "how a hierarchical local SGD or DiLoCo outer sync crosses "
                         "nodes: shards (local rank j of every node carries 1/G of it, G "
                         "connections per node at once), leaders (one rank per node carries "
                         "all of it) or auto (shards); per-step strategies cross by their "
                         "leaders", flag="--cross-node")
    ranks_per_node: int = _f(0, "take consecutive blocks of this many ranks as nodes (0: detect "
                             "nodes from host, boot id and network namespace)",
                             flag="--ranks-per-node")
    allreduce_algo: str = _f("ring", "all-reduce algorithm: ring (the backend's own), "
                             "recursive_doubling (lorasync's, from point-to-point sends; gloo) "
                             "or auto (per message, from the cost model and a probe of the "
                             "link)", flag="--allreduce-algo")

    def __post_init__(self):
        _check(isinstance(self.strategy, str) and self.strategy, "comm.strategy",
               self.strategy, "name a strategy, e.g. allreduce")
        _check(isinstance(self.options, dict), "comm.options", self.options,
               "give a mapping of option names to values")
        for key, value in self.options.items():
            # a 400-digit integer overflows every float conversion downstream
            _check(not _int(value) or abs(value) < 2**63, _option_field(key), value,
                   "use a number of at most 19 digits")
        if self.strategy in catalog.names():   # an unknown name: the launcher's preflight says so
            catalog.parse_options(self.strategy, self.options)
        _check(_num(self.bucket_mb) and 0 < self.bucket_mb <= 1024, "comm.bucket_mb",
               self.bucket_mb, "use a number of MB in (0, 1024]")
        _check(self.hierarchy in catalog.HIERARCHIES, "comm.hierarchy", self.hierarchy,
               _use_either(catalog.HIERARCHIES))
        _check(self.cross_node in catalog.CROSS_NODE, "comm.cross_node",
               self.cross_node, _use_either(catalog.CROSS_NODE))
        _check(self.cross_node != "shards" or self.strategy in catalog.PERIODIC
               or self.strategy == "auto", "comm.cross_node", self.cross_node,
               f"shards apply to local and diloco (and auto's), not {self.strategy}, which "
               "crosses nodes by its leaders; use auto or leaders")
        _check(isinstance(self.ranks_per_node, int) and not isinstance(self.ranks_per_node, bool)
               and self.ranks_per_node >= 0, "comm.ranks_per_node", self.ranks_per_node,
               "use an integer >= 1, or 0 to detect the nodes")
        _check(self.allreduce_algo in catalog.ALLREDUCE_ALGOS,
               "comm.allreduce_algo", self.allreduce_algo, _use_either(catalog.ALLREDUCE_ALGOS))


@dataclass
class RunConfig:
    output_dir: str = _f("", "run directory (default: runs/<date>-<time>)", flag="--output-dir")
    nproc: int = _f(2, "worker processes started on this node", flag="--nproc")
    backend: str = _f("auto", "torch.distributed backend: auto (nccl with CUDA, else gloo), "
                      "gloo or nccl", flag="--backend")
    threads: int = _f(0, "torch threads per worker (0: cores / local workers)", flag="--threads")
    progress: bool = _f(True, "live progress bar on rank 0", flag="--progress")
    report_to: list = _f(lambda: ["none"], "where rank 0 also logs its metrics (names as the "
                         "Hugging Face Trainer's: train/loss, train/learning_rate, eval/loss, "
                         "lorasync's own under lorasync/): any of tensorboard (RUN/tensorboard), "
                         "wandb (WANDB_MODE=offline works offline), mlflow (MLFLOW_TRACKING_URI, "
                         "else a file store in RUN/mlruns), comma-separated, or none",
                         flag="--report-to")
    tensorboard: bool = _f(False, "deprecated alias of --report-to tensorboard (adds it)",
                           flag="--tensorboard")
    init_adapter: str = _f("", "start from this PEFT adapter directory (adapter_config.json + "
                           "weights): its weights replace the fresh adapter's; its r, target "
                           "modules, alpha and base model must match this run's",
                           flag="--init-adapter")
    metrics_port: int = _f(0, "serve Prometheus metrics (aggregated over ranks) on this port "
                           "of rank 0 (0: off)", flag="--metrics-port")
    metrics_host: str = _f("127.0.0.1", "address the Prometheus endpoint binds to (0.0.0.0 "
                           "to let a remote Prometheus scrape it)", flag="--metrics-host")
    max_restarts: int = _f(3, "restarts of the worker group after a failure (torchrun "
                           "--max-restarts); each resumes from the newest checkpoint every rank "
                           "holds", flag="--max-restarts")
    nnodes: str = _f("", "nodes, N or MIN:MAX (torchrun's c10d rendezvous): with MIN below MAX "
                     "the run goes on when a node does not come back after a failure and takes "
                     "in a node that joins later; with --emulate or --rdzv-endpoint",
                     flag="--nnodes")
    rdzv_endpoint: str = _f("", "HOST:PORT of the c10d rendezvous (node 0's address) to run "
                            "the same command on several machines", flag="--rdzv-endpoint")
    fault_timeout: float = _f(30.0, "seconds a peer may stay silent before it counts as "
                              "failed, at least: the bound is max(this, --fault-steps x the "
                              "median step time)", flag="--fault-timeout")
    fault_steps: float = _f(10.0, "steps of silence that count as a failure when steps are "
                            "slower than --fault-timeout / this", flag="--fault-steps")

    def __post_init__(self):
        _check(isinstance(self.nproc, int) and 1 <= self.nproc <= 256, "run.nproc", self.nproc,
               "use an integer between 1 and 256")
        _check(self.backend in ("auto", "gloo", "nccl"), "run.backend", self.backend,
               "use auto, gloo or nccl")
        _check(_int(self.threads) and 0 <= self.threads <= 1024, "run.threads",
               self.threads, "use an integer between 0 (cores / local workers) and 1024")
        if isinstance(self.report_to, str):
            self.report_to = [t.strip() for t in self.report_to.split(",") if t.strip()]
        _check(isinstance(self.report_to, list) and self.report_to
               and all(t in REPORT_TO for t in self.report_to)
               and not ("none" in self.report_to and len(set(self.report_to)) > 1),
               "run.report_to", self.report_to, "give none or a comma-separated list of "
               "tensorboard, wandb, mlflow, e.g. tensorboard,wandb")
        if self.tensorboard and "tensorboard" not in self.report_to:   # the older flag
            self.report_to = [t for t in self.report_to if t != "none"] + ["tensorboard"]
        self.report_to = list(dict.fromkeys(self.report_to))
        _check(isinstance(self.init_adapter, str), "run.init_adapter", self.init_adapter,
               "give the path of a PEFT adapter directory, or leave it empty")
        _check(isinstance(self.metrics_port, int) and 0 <= self.metrics_port <= 65535,
               "run.metrics_port", self.metrics_port, "use a port 1-65535, or 0 for none")
        _check(isinstance(self.max_restarts, int) and not isinstance(self.max_restarts, bool)
               and 0 <= self.max_restarts <= 1000, "run.max_restarts", self.max_restarts,
               "use an integer between 0 (fail on the first fault) and 1000")
        self.nnodes = str(self.nnodes).strip()
        _check(self.nnodes == "" or parse_nnodes(self.nnodes) is not None, "run.nnodes",
               self.nnodes, "give N or MIN:MAX with 1 <= MIN <= MAX, e.g. 2 or 1:3")
        if self.rdzv_endpoint:
            parse_endpoint(self.rdzv_endpoint, "run.rdzv_endpoint")
        _check(_num(self.fault_timeout) and 1 <= self.fault_timeout <= 3600,
               "run.fault_timeout", self.fault_timeout, "use a number of seconds in [1, 3600]")
        _check(_num(self.fault_steps) and 2 <= self.fault_steps <= 1000, "run.fault_steps",
               self.fault_steps, "use a number of steps in [2, 1000]")


#: the metric sinks ``--report-to`` knows (besides ``none``)
REPORT_TO = ("tensorboard", "wandb", "mlflow", "none")


def parse_endpoint(text: str, field: str = "--rdzv-endpoint") -> tuple[str, int]:
    """``"10.0.0.1:29400"``, ``"[fd00::1]:29400"`` -> (host, port); a ConfigError
    naming ``field`` when the host is missing or the port is not 1-65535."""
    return parse_hostport(text, field)


def parse_nnodes(text: str) -> tuple[int, int] | None:
    """``"2"`` -> (2, 2), ``"1:3"`` -> (1, 3); None when malformed."""
    lo, _, hi = str(text).partition(":")
    hi = hi or lo
    if not all(x.strip().isascii() and x.strip().isdigit() and len(x.strip()) < 10
               for x in (lo, hi)):
        return None
    lo_n, hi_n = int(lo), int(hi)
    return (lo_n, hi_n) if 1 <= lo_n <= hi_n else None


SECTIONS = {"model": ModelConfig, "lora": LoraSettings, "data": DataConfig,
            "train": TrainConfig, "comm": CommConfig, "run": RunConfig}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    run: RunConfig = field(default_factory=RunConfig)


def _num(v) -> bool:
    """A finite number (inf and NaN pass no range check the way they should; an
    int beyond float range overflows every float conversion)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= sys.float_info.max


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def iter_fields():
    """(section, field) for every option, in declaration order."""
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            yield section, f


def _coerce(section: str, f: dataclasses.Field, value):
    """YAML/CLI value -> the field's type, or a ConfigError naming it."""
    name = f"{section}.{f.name}"
    default = getattr(SECTIONS[section](), f.name)
    if value is None:
        raise ConfigError(name, value, "give a value (null is not allowed)")
    if isinstance(default, bool):
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        if isinstance(value, bool):
            return value
        raise ConfigError(name, value, "use true or false")
    if isinstance(default, int):
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise ConfigError(name, value, "use an integer") from None
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(name, value, "use an integer")
        return value
    if isinstance(default, float):
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ConfigError(name, value, "use a number") from None
        if not _num(value):
            raise ConfigError(name, value, "use a number")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(name, value, "use a string")
        value = str(value)
    if isinstance(value, str) and "\0" in value:   # no path, host or name holds one
        raise ConfigError(name, value, "remove the NUL character")
    return value


def parse_options(pairs, section: str = "comm") -> dict[str, Any]:
    """['period=8', 'ratio=0.01'] -> {'period': 8, 'ratio': 0.01} (YAML scalars);
    errors name ``section.options``."""
    import yaml

    out: dict[str, Any] = {}
    for p in pairs:
        k, eq, v = str(p).partition("=")
        if not eq or not k.strip():
            example = "period=8" if section == "comm" else "init_lora_weights=gaussian"
            raise ConfigError(f"{section}.options", p,
                              f"write options as key=value, e.g. {example}")
        try:
            out[k.strip()] = yaml.safe_load(v)
        except (yaml.YAMLError, RecursionError, ValueError) as exc:   # ValueError: 5000 digits
            raise ConfigError(_option_field(k.strip(), section), v,
                              f"not a value ({_yaml_why(exc)}); write a number, true/false "
                              "or a word, e.g. period=8") from None
    return out


def _option_field(key, section: str = "comm") -> str:
    """``comm.options.period``; a key that is no name quoted (it may hold a line break)."""
    return (f"{section}.options.{key}" if str(key).isidentifier()
            else f"{section}.options[{key!r}]")


def _yaml_why(exc: BaseException) -> str:
    """What PyYAML (or the recursion limit) objected to, on one line."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    why = getattr(exc, "problem", None) or getattr(exc, "reason", None) or \
        str(exc).split(";")[0]   # not Python's advice on sys.set_int_max_str_digits
    return " ".join(str(why).split())


def load_config(yaml_path: str | None = None, overrides: dict[str, dict[str, Any]] | None = None
                ) -> Config:
    """Defaults <- YAML file <- CLI overrides ({section: {key: value}}), validated."""
    import yaml

    raw: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    if yaml_path:
        if not os.path.isfile(yaml_path):
            raise ConfigError("--config", yaml_path, "file not found; give a path to a YAML file")
        try:
            with open(yaml_path, encoding="utf-8") as fh:
                data = yaml.safe_load(fh) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{yaml_path}:{mark.line + 1}" if mark else yaml_path
            raise LorasyncError(f"{where}: not valid YAML ({_yaml_why(exc)}); "
                                "fix the syntax") from None
        except UnicodeDecodeError as exc:
            raise ConfigError("--config", yaml_path, f"not UTF-8 text (byte {exc.start}); "
                              "save the file as UTF-8") from None
        except RecursionError:
            raise ConfigError("--config", yaml_path, "nested too deeply; a config is sections "
                              "of keys and values (model, lora, data, ...)") from None
        except ValueError as exc:   # a date 2020-13-45, an integer of 5000 digits
            raise ConfigError("--config", yaml_path, f"holds a value YAML cannot convert "
                              f"({_yaml_why(exc)}); fix it") from None
        except OSError as exc:
            raise ConfigError("--config", yaml_path, f"cannot read it ({exc.strerror}); give a "
                              "readable YAML file") from None
        if not isinstance(data, dict):
            raise ConfigError(yaml_path, type(data).__name__,
                              "the file must be a mapping of sections (model, lora, data, ...)")
        for section, values in data.items():
            if section not in SECTIONS:
                raise UnknownKey(f"{yaml_path}", section, SECTIONS)
            if values is None:
                continue
            if not isinstance(values, dict):
                raise ConfigError(f"{yaml_path}: {section}", values,
                                  "a section must be a mapping of keys to values")
            known = [f.name for f in fields(SECTIONS[section])]
            for k, v in values.items():
                if k not in known:
                    raise UnknownKey(f"{yaml_path}: {section}", k, known)
                raw[section][k] = v
    for section, values in (overrides or {}).items():
        raw[section].update(values)
    built = {}
    for section, cls in SECTIONS.items():
        kwargs = {}
        for f in fields(cls):
            if f.name in raw[section]:
                kwargs[f.name] = _coerce(section, f, raw[section][f.name])
        built[section] = cls(**kwargs)
    comm = built["comm"]
    if built["train"].fp16 and comm.strategy == "auto" and "candidates" not in comm.options:
        # the default strategy under --fp16: auto among the per-step strategies that keep
        # nothing across steps (loss scaling and error feedback do not mix; local SGD and
        # DiLoCo give each rank its own loss scale, which a later switch would mix)
        comm.options = {**comm.options, "candidates": FP16_AUTO_CANDIDATES}
    return Config(**built)


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)
