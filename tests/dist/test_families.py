"""Model families from the Hugging Face cache through ``lorasync train``.

Five architectures (Llama, Qwen2, Mistral, Gemma, Phi-3), each built offline
from its transformers config class at a tiny size with random weights, saved
with the tiny character tokenizer in the Hub cache layout
(``models--org--name/snapshots/<commit>``, ``refs/main``) under a temporary
``HF_HUB_CACHE``, then trained for two steps on 2 gloo ranks by its Hub id
with ``--lora-targets all-linear`` (DoRA on Gemma, rsLoRA on Qwen2): the id
resolves from the cache, PEFT finds every linear layer but the head, and the
ranks end with one adapter.
"""

import hashlib
import json
import os

import pytest
import torch

from conftest import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

ORG = "tiny-random"
#: family -> (transformers config class, its extra tiny settings)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {}),
    "gemma": ("GemmaConfig", {"head_dim": 8}),
    "phi3": ("Phi3Config", {}),
}
#: PEFT's variants ride along on some runs (same cost): family -> extra flags
VARIANT = {"qwen2": ["--use-rslora"], "gemma": ["--use-dora"]}
RUN = ["--nproc", "2", "--lora-targets", "all-linear", "--max-steps", "2", "--batch-size", "2",
       "--seq-len", "64", "--demo-size", "64", "--eval-size", "4", "--max-new-tokens", "2",
       "--no-eval-before", "--ckpt-interval", "0", "--no-progress", "--comm", "allreduce"]


def save_in_hub_cache(cache, repo_id: str, model, tok) -> str:
    """Write ``model`` and ``tok`` where ``hf download repo_id`` would: a
    snapshot folder named by a commit hash, and refs/main naming it."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snap = os.path.join(repo, "snapshots", commit)
    model.save_pretrained(snap)
    tok.save_pretrained(snap)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as fh:
        fh.write(commit)
    return snap


def tiny_family_model(family: str, tok):
    import transformers
    from transformers import AutoModelForCausalLM

    cls, extra = FAMILIES[family]
    cfg = getattr(transformers, cls)(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A Hub cache holding the five tiny models; family -> its linear layers' names."""
    from lorasync.train.model import _tiny_tokenizer

    cache = str(tmp_path_factory.mktemp("hub"))
    tok = _tiny_tokenizer()
    linear = {}
    for family in FAMILIES:
        model = tiny_family_model(family, tok)
        save_in_hub_cache(cache, f"{ORG}/{family}", model, tok)
        linear[family] = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                          if isinstance(m, torch.nn.Linear)}
    return cache, linear


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_trains_by_hub_id_on_two_ranks(hub_cache, tmp_path, family):
    cache, linear = hub_cache
    run = tmp_path / "r"
    p = run_cli("train", "--model", f"{ORG}/{family}", *RUN, *VARIANT.get(family, []),
                "--output-dir", run, HF_HUB_CACHE=cache, HF_HUB_OFFLINE="1")
    assert p.returncode == 0, p.stderr[-3000:]
    with open(run / "adapter" / "adapter_config.json") as fh:
        adapter = json.load(fh)
    assert adapter["use_dora"] == ("--use-dora" in VARIANT.get(family, []))
    assert adapter["use_rslora"] == ("--use-rslora" in VARIANT.get(family, []))
    # all-linear: every linear layer but the output head, as PEFT resolved it
    assert {t.rsplit(".", 1)[-1] for t in adapter["target_modules"]} == \
        linear[family] - {"lm_head"}
    with open(run / "metrics.jsonl") as fh:
        losses = [json.loads(line)["loss"] for line in fh if '"loss"' in line]
    assert len(losses) == 4 and all(loss == loss and 0 < loss < 100 for loss in losses)
    ckpt = run / "checkpoint-2" / "lorasync"
    a = torch.load(ckpt / "rank0.pt", weights_only=False)["adapter"]
    b = torch.load(ckpt / "rank1.pt", weights_only=False)["adapter"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if "--use-dora" in VARIANT.get(family, []):
        assert any("lora_magnitude_vector" in k for k in a)
    # trained: B leaves its zero init in every adapted layer kind
    moved = {k.split(".")[-4] for k in a if "lora_B" in k and a[k].abs().sum() > 0}
    assert moved == linear[family] - {"lm_head"}
