"""The training step's parts, in one process: the precision, checkpointing
and clipping options, the checks before launch, the token-weighted loss,
clipping where it belongs, the schedule note and peak memory."""

from __future__ import annotations

import types

import pytest
import torch

from _bad_input import Guard, refused
from lorasync.config import LoraSettings, TrainConfig, load_config
from lorasync.errors import ConfigError
from lorasync.train import precision, trainer
from lorasync.train.precision import check_precision
from lorasync.train.schedule import schedule_note
from lorasync.train.trainer import Trainer


# ------------------------------------------------------------------------- options

def test_defaults():
    t = TrainConfig()
    assert (t.bf16, t.fp16, t.gradient_checkpointing, t.max_grad_norm) == (False, False,
                                                                          False, 1.0)


@pytest.mark.parametrize("kw, field, fix", [
    ({"bf16": True, "fp16": True}, "train.fp16", "one of --bf16 and --fp16"),
    ({"max_grad_norm": -1.0}, "train.max_grad_norm", "0 to turn clipping off"),
    ({"max_grad_norm": float("nan")}, "train.max_grad_norm", "0 to turn clipping off"),
])
def test_bad_values(kw, field, fix):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**kw)
    assert field in str(e.value) and fix in str(e.value)


def test_flags_reach_the_config():
    from lorasync.cli import build_parser

    args = build_parser().parse_args(["train", "--bf16", "--gradient-checkpointing",
                                      "--max-grad-norm", "0"])
    from lorasync.train.cli import _overrides

    t = load_config(None, _overrides(args)).train
    assert t.bf16 and t.gradient_checkpointing and t.max_grad_norm == 0.0 and not t.fp16


@pytest.mark.parametrize("strategy", ["int8", "onebit", "topk", "powersgd",
                                      "torch_powersgd"])
def test_fp16_refused_with_error_feedback(strategy):
    cfg = load_config(None, {"train": {"fp16": True}, "comm": {"strategy": strategy}})
    with pytest.raises(ConfigError) as e:
        check_precision(cfg, "cpu")
    assert "train.fp16" in str(e.value) and "--bf16" in str(e.value)
    check_precision(load_config(None, {"train": {"bf16": True},
                                       "comm": {"strategy": strategy}}), "cpu")


@pytest.mark.parametrize("strategy", ["allreduce", "fp16", "bf16", "local", "diloco"])
def test_fp16_runs_on_this_cpu_with_lossless_and_periodic(strategy):
    check_precision(load_config(None, {"train": {"fp16": True},
                                       "comm": {"strategy": strategy}}), "cpu")


def test_fp16_with_auto_runs_among_per_step_strategies():
    cfg = load_config(None, {"train": {"fp16": True}})   # no --comm: the default, auto
    assert cfg.comm.strategy == "auto" and cfg.comm.options == {"candidates": "allreduce,fp16"}
    check_precision(cfg, "cpu")
    assert load_config(None, {"train": {"bf16": True}}).comm.options == {}
    # candidates the user names are kept, and refused if one keeps gradients across steps
    cfg = load_config(None, {"train": {"fp16": True},
                             "comm": {"options": {"candidates": "allreduce,int8"}}})
    assert cfg.comm.options == {"candidates": "allreduce,int8"}
    with pytest.raises(ConfigError, match="candidates=allreduce,fp16"):
        check_precision(cfg, "cpu")


def test_autocast_a_device_lacks_is_named():
    assert precision._autocast_fails("cpu", torch.bfloat16) is None
    why = precision._autocast_fails("cpu", torch.float64)   # torch warns, turns autocast off
    assert why and "\n" not in why


def test_unrunnable_precision_is_one_line_before_launch(monkeypatch, tmp_path, capsys):
    Guard(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(precision, "_autocast_fails", lambda device, dtype: "not on this CPU")
    refused(capsys, tmp_path, ["train", "--model", "tiny", "--no-progress", "--bf16",
                               "--output-dir", "r"], "train.bf16", "not on this CPU",
            "drop --bf16")
    refused(capsys, tmp_path, ["train", "--model", "tiny", "--no-progress", "--fp16",
                               "--comm", "int8", "--output-dir", "r"], "train.fp16",
            "error feedback")


# ---------------------------------------------------------------- schedule, memory

def test_schedule_note():
    assert schedule_note("cosine", 2e-3, 5, 5) is None
    assert schedule_note("cosine", 2e-3, 0, 1) is None
    note = schedule_note("cosine", 2e-3, 5, 3)
    assert note.startswith("note: ") and "\n" not in note
    assert "5 warm-up steps" in note and "3 steps" in note and "0.0012" in note   # 3/5 of it


def test_peak_memory_and_its_summary_row():
    from lorasync.train.summary import format_summary

    peak = trainer.peak_memory_bytes(torch.device("cpu"))
    assert peak > 10 << 20   # this process holds torch: tens of MiB at least
    s = {"world_size": 2, "strategy": "allreduce", "adapter_params": 1, "eval_before": None,
         "eval_after": None, "final_loss": 1.0, "samples_per_s": 1.0, "step_s_median": 1.0,
         "compute_s_mean": 1.0, "comm_s_mean": 0.0, "sync_share": 0.0,
         "wire_bytes_per_step": 4, "fp32_bytes_per_step": 4, "startup_broadcast_bytes": 0,
         "peak_mem_bytes": [3 << 20, 5 << 20], "peak_mem_kind": "max_rss"}
    assert "peak memory per rank (resident)  3 MiB, 5 MiB" in format_summary(s, "run")


# -------------------------------------------------------------------- clipping

def _trainer(strategy="allreduce", *, momentum=False, max_grad_norm=1.0, world=2):
    tr = Trainer.__new__(Trainer)
    tr.sync = types.SimpleNamespace(name=strategy, grads_hold_momentum=momentum)
    tr.tc = TrainConfig(max_grad_norm=max_grad_norm, batch_size=2, grad_accum=2)
    tr.scaler, tr.world, tr.opt = None, world, None
    tr.params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    tr.params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    tr.params[1].grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    return tr


def test_clip_returns_the_norm_before_clipping_and_clips_to_max():
    tr = _trainer(max_grad_norm=1.0)
    assert tr._clip() == pytest.approx(5.0)
    after = torch.nn.utils.get_total_norm([p.grad for p in tr.params])
    assert float(after) == pytest.approx(1.0, rel=1e-5)


def test_no_clipping_at_zero_and_below_max():
    for tr in (_trainer(max_grad_norm=0.0), _trainer(max_grad_norm=10.0)):
        assert tr._clip() == pytest.approx(5.0)
        assert tr.params[0].grad.tolist() == [3.0, 0.0, 0.0]


def test_momentum_of_one_bit_adam_is_neither_measured_nor_clipped():
    tr = _trainer("onebit", momentum=True, max_grad_norm=1.0)
    assert tr._clip() is None
    assert tr.params[0].grad.tolist() == [3.0, 0.0, 0.0]


def test_a_non_finite_norm_is_recorded_as_none():
    tr = _trainer(max_grad_norm=0.0)
    tr.params[0].grad[0] = float("inf")
    assert tr._clip() is None


# --------------------------------------------------------- the loss's denominator

def _weights_trainer(strategy, world=2):
    tr = _trainer(strategy, world=world)
    tr.train_set = [None] * 16
    tr.label_tokens = [i + 1 for i in range(16)]   # example j has j + 1 label tokens
    if strategy == "auto":
        tr.sync.strategy = "local"
    return tr


def test_averaging_strategies_divide_by_every_rank_tokens():
    from lorasync.train.data import batches_at

    tr = _weights_trainer("int8")
    micro = batches_at(0, n=16, seed=0, rank=1, world=2, batch_size=2, grad_accum=2)
    denom, factor, mine = tr._loss_norm(0, micro, 2)
    both = [j for r in range(2) for mb in batches_at(0, n=16, seed=0, rank=r, world=2,
                                                      batch_size=2, grad_accum=2) for j in mb]
    assert len(set(both)) == 8
    assert denom == sum(j + 1 for j in both) and factor == 2.0
    assert mine == sum(j + 1 for mb in micro for j in mb)


@pytest.mark.parametrize("strategy", ["local", "diloco", "none", "auto"])   # auto: on local
def test_replicas_of_their_own_divide_by_their_own_tokens(strategy):
    from lorasync.train.data import batches_at

    tr = _weights_trainer(strategy)
    micro = batches_at(8, n=16, seed=0, rank=0, world=2, batch_size=2, grad_accum=2)
    mine = sum(j + 1 for mb in micro for j in mb)
    assert tr._loss_norm(8, micro, 2) == (mine, 1.0, mine)


def test_label_tokens_count_the_shifted_labels_once():
    ex = [types.SimpleNamespace(labels=[5, -100, 7, 8]), types.SimpleNamespace(labels=[-100, 9])]
    n = trainer._LabelTokens(ex, -100)
    assert (n[0], n[1]) == (2, 1)   # the first label predicts nothing
    ex[0].labels = []
    assert n[0] == 2 and n.known == {0: 2, 1: 1}


@pytest.fixture(scope="module")
def tiny():
    from lorasync.train.model import ModelSource, add_lora, load_base

    base, tok = load_base(ModelSource.resolve("tiny"))
    return add_lora(base, LoraSettings(), seed=0), tok


def _micro_batches(tok):
    from lorasync.train.data import Example, collate

    def ex(prompt, completion):
        p, c = tok(prompt)["input_ids"], tok(completion)["input_ids"]
        return Example(p + c, [-100] * len(p) + c, prompt, completion)

    # different numbers of label tokens per micro-batch: a mean of means is not the token mean
    return [collate([ex("12+30=", "42"), ex("sort 3 1", "1 3")], tok.pad_token_id),
            collate([ex("reverse: a b c d", "d c b a and so on")], tok.pad_token_id)]


@pytest.mark.parametrize("loss_kwargs", [True, False])
def test_accumulated_loss_is_the_token_mean_of_the_whole_batch(tiny, loss_kwargs):
    import contextlib

    model, tok = tiny
    mbs = _micro_batches(tok)
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in mbs]
    assert counts[0] != counts[1]
    tr = Trainer.__new__(Trainer)
    tr.loss_kwargs = loss_kwargs
    with torch.no_grad():
        got = sum(float(tr._micro_loss(model, b, sum(counts), contextlib.nullcontext))
                  for b in mbs)
        width = max(b["input_ids"].shape[1] for b in mbs)

        def pad(t, v):
            return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=v)

        whole = {k: torch.cat([pad(b[k], -100 if k == "labels" else 0) for b in mbs])
                 for k in mbs[0]}
        want = float(model(**whole).loss)
        means = sum(float(model(**b).loss) for b in mbs) / len(mbs)
    assert trainer._accepts_loss_kwargs(model)
    assert got == pytest.approx(want, rel=1e-5)
    assert abs(means - want) > 1e-3   # what the old plain mean of means gave


def test_gradient_checkpointing_gives_the_same_adapter_gradients():
    from lorasync.train.model import ModelSource, add_lora, load_base

    grads = []
    for gc in (False, True):
        base, tok = load_base(ModelSource.resolve("tiny"))
        if gc:
            trainer._enable_checkpointing(base, "tiny")
            assert getattr(base, "is_activation_checkpointing", None) \
                or base.is_gradient_checkpointing
        model = add_lora(base, LoraSettings(), seed=0)
        model.train()
        b = _micro_batches(tok)[0]
        model(**b).loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()
                                if p.requires_grad]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0])


def test_checkpointing_a_model_without_it_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        trainer._enable_checkpointing(types.SimpleNamespace(supports_gradient_checkpointing=False),
                                   "my-model")
    assert "train.gradient_checkpointing" in str(e.value) and "my-model" in str(e.value)
