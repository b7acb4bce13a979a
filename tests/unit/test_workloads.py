"""Target workloads: adapter sizes held against PEFT, and the link dilation they give."""

import pytest

from lorasync.bench.profiles import dilate
from lorasync.bench.workloads import PRESETS, dilation, get_workload
from lorasync.errors import ConfigError


def _peft_adapter_params(w) -> int:
    """Trainable values PEFT gives the workload's model shape and LoRA
    settings, on a model built on the meta device (no weights, no download)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    s = w.shape
    cfg = LlamaConfig(hidden_size=s.hidden, num_hidden_layers=s.layers,
                      num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                      head_dim=s.head_dim, intermediate_size=s.intermediate,
                      vocab_size=s.vocab)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    peft = get_peft_model(model, LoraConfig(r=w.lora_r, lora_alpha=2 * w.lora_r,
                                            target_modules=[f"{t}_proj" for t in w.targets]))
    return sum(p.numel() for p in peft.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_adapter_size_matches_peft(name):
    w = PRESETS[name]
    assert w.adapter_params == _peft_adapter_params(w)
    assert w.sync_bytes == 4 * w.adapter_params


def test_presets_hold_the_issue_figures():
    # the embedded default's adapter, as lorasync train reports it
    assert PRESETS["smollm2-h200"].adapter_params == 921_600
    # "a 7B model with r=16 on all linear layers syncs about 160 MB a step"
    assert PRESETS["llama2-7b-r16-h100"].sync_bytes == pytest.approx(160e6, rel=0.01)
    assert not PRESETS["llama2-7b-r16-h100"].measured and "NeMo" in \
        PRESETS["llama2-7b-r16-h100"].source


def test_dilation_matches_bytes_per_second_of_compute():
    w = PRESETS["llama2-7b-r16-h100"]
    d = dilation(w, cpu_step_s=2.6, adapter_params_here=921_600)
    here = 4 * 921_600 / 2.6
    there = w.sync_bytes / w.gpu_step_s
    # a user link of 1 Gbit/s becomes 1e9 / rate_div here: the same bytes a
    # second of compute fill the same share of it
    assert d.rate_div == pytest.approx(there / here)
    assert d.delay_mul == pytest.approx(2.6 / 0.65)
    # the same model here and there: rate and delay scale alike, by the step ratio
    s = dilation(PRESETS["smollm2-h200"], 2.7, 921_600)
    assert s.rate_div == pytest.approx(2.7 / 0.18) == pytest.approx(s.delay_mul)
    assert "smollm2-h200" in s.text() and "rate / 15.0" in s.text()


def test_dilate_scales_rate_and_delay_apart():
    assert dilate("100mbit", "50ms", 10.0) == ("10000000bit", "500.000ms")
    assert dilate("100mbit", "50ms", 100.0, delay_mul=4.0) == ("1000000bit", "200.000ms")
    assert dilate("10mbit", "", 20.0, delay_mul=3.0) == ("500000bit", "")


def test_unknown_workload_names_the_presets():
    with pytest.raises(ConfigError) as e:
        get_workload("gpt5-b300")
    assert "smollm2-h200" in str(e.value) and "--workload" in str(e.value)
    with pytest.raises(ConfigError):
        dilation(PRESETS["smollm2-h200"], 0.0, 921_600)


def test_headline_gpu_says_a_peer_stopped_before_its_first_average(tmp_path, monkeypatch):
    """A LocalSGD row capped before step 8 never averaged: its share is of steps
    without any sync, so the headline says so instead of printing it."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import tables

    w = {"workload": {"name": "smollm2-h200", "description": "d", "sync_bytes": 3686400,
                      "gpu_step_s": 0.18, "source": "s"},
         "cpu_step_s": 1.2, "rate_div": 6.5, "delay_mul": 6.5}
    for prof, capped in (("1mbit", 7), ("10mbit", 23)):
        cells = [{"key": "auto", "efficiency": 0.98, "final_strategy": "diloco"},
                 {"key": "localsgd_8", "efficiency": 0.87, "capped_steps": capped}]
        d = tmp_path / f"gpu-eq-{prof}"
        d.mkdir()
        (d / "results.json").write_text(json.dumps({
            "workload": w, "args": {},
            "results": {prof: {"cells": cells, "link": "user link, emulated as 0.157 Mbit/s"}}}))
    monkeypatch.setattr(tables, "REF", tmp_path)
    rows = {line.split(" (")[0]: line for line in tables.headline_gpu().splitlines()
            if line.startswith("| 1")}
    assert "no sync within the cap (7 steps)" in rows["| 1 Mbit/s"]
    assert "87% (23 steps, capped)" in rows["| 10 Mbit/s"]
