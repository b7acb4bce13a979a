"""bench/gpu_check.py without a GPU: the model it builds has the shape it claims,
its results read from a run directory, and it stops with one line and exit 2
when there is no CUDA device (the GPU runs themselves are the script's job)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


def test_the_qwen_shape_has_the_real_models_parameter_count(gpu_check):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    values = gpu_check.shape_config("qwen2.5-0.5b")
    assert (values["hidden_size"], values["num_hidden_layers"], values["num_attention_heads"],
            values["num_key_value_heads"], values["intermediate_size"],
            values["vocab_size"]) == (896, 24, 14, 2, 4864, 151936)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**values))
    # Qwen2.5-0.5B: 0.49B parameters, the embedding tied to the output head
    assert sum(p.numel() for p in model.parameters()) == 494_032_768


def test_the_dry_run_model_loads_as_lorasync_train_loads_it(gpu_check, tmp_path):
    from lorasync.train.model import ModelSource, load_base

    info = gpu_check.build_model("qwen2.5-0.5b", str(tmp_path), tiny=True)
    model, tok = load_base(ModelSource.resolve(str(tmp_path)), log=lambda *_: None)
    cfg = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM" and cfg.num_hidden_layers == 2
    attn = model.model.layers[0].self_attn
    assert tuple(attn.q_proj.weight.shape) == (128, 128)
    assert tuple(attn.k_proj.weight.shape) == (64, 128)   # 2 KV heads of head_dim 32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert len(tok) <= cfg.vocab_size == 1024
    assert max(tok("Sort: 12 7 99")["input_ids"]) < cfg.vocab_size
    assert tok.pad_token_id == cfg.pad_token_id and tok.eos_token_id == cfg.eos_token_id
    assert info["params"] == sum(p.numel() for p in model.parameters())


def test_results_are_read_per_rank_without_the_first_step(gpu_check, tmp_path):
    recs = [{"step": s, "rank": r, "step_s": [9.0, 1.0, 3.0][s - 1] + r, "compute_s": 0.5,
             "comm_s": 0.1, "encode_s": 0.0, "wire_bytes": 100, "tokens": 40, "samples": 4,
             "peak_mem_bytes": 1000 * s + r, "loss": 2.0 / s}
            for s in (1, 2, 3) for r in (0, 1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "summary.json").write_text(json.dumps(
        {"peak_mem_bytes": [3000, 3001], "peak_mem_kind": "cuda_allocated"}))
    got = gpu_check.read_run(str(tmp_path))
    assert [p["step_s_median"] for p in got["per_rank"]] == [2.0, 3.0]   # steps 2 and 3
    assert got["step_s_median"] == 3.0   # the slowest rank's
    assert [p["peak_mem_bytes"] for p in got["per_rank"]] == [3000, 3001]
    assert got["peak_mem_bytes"] == [3000, 3001] and got["peak_mem_kind"] == "cuda_allocated"


def test_without_cuda_it_stops_with_one_line_and_exit_2(gpu_check, monkeypatch, capsys,
                                                        tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--json", str(tmp_path / "out.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA device" in err and "--dry-run-cpu" in err
    assert not (tmp_path / "out.json").exists()


def test_quick_is_the_default(gpu_check):
    quick, full = gpu_check.parse_args([]), gpu_check.parse_args(["--full"])
    assert (quick.full, quick.train_steps, quick.budget_s) == (False, 6, 450)
    assert (full.full, full.train_steps) == (True, 20)
    dry = gpu_check.parse_args(["--dry-run-cpu"])
    assert (dry.train_steps, dry.seq_len, dry.budget_s) == (2, 128, 0)


def test_the_outer_syncs_encode_share_is_measured_and_tabled(gpu_check):
    """The codecs section's share of a step (the issue's 5% bar), here on the
    CPU with the small preset: every variant timed, its share computed from
    the preset's GPU step, and the table the result file turns into."""
    d = gpu_check.outer_codecs("cpu", 1, ["smollm2-h200"])
    [w] = d["workloads"]
    assert w["adapter_values"] == 921_600 and w["workload"]["gpu_step_s"] == 0.18
    assert [r["variant"] for r in w["rows"]] == [v for v, _ in gpu_check.encode_share.VARIANTS]
    for r in w["rows"]:
        assert r["ms_per_sync"] > 0
        assert r["share_of_step"] == pytest.approx(r["ms_per_sync"] / 8 / 180)
        assert r["within_bar"] == (r["share_of_step"] <= 0.05)
    text = gpu_check.markdown({"device": "cpu", "encode_share": d})
    assert "int2, top 3% (SparseLoCo-style)" in text and "share of a GPU step" in text
