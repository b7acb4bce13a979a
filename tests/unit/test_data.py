import json

import pytest

from lorasync.errors import DataError
from lorasync.train.data import (IGNORE, batches_at, collate, demo_rows, encode_rows,
                                 read_jsonl)
from lorasync.train.model import ModelSource, load_base


@pytest.fixture(scope="module")
def tok():
    return load_base(ModelSource.resolve("tiny"))[1]


def test_demo_is_deterministic_and_eval_is_held_out():
    tr1, ev1 = demo_rows(500, 40)
    tr2, ev2 = demo_rows(500, 40)
    assert tr1 == tr2 and ev1 == ev2
    assert not {r["prompt"] for r in ev1} & {r["prompt"] for r in tr1}
    kinds = {r["prompt"].split(":")[0] for r in tr1}
    assert kinds == {"Add", "Sort ascending", "Reverse the words"}
    for r in tr1[:50]:  # answers are exactly checkable
        head, body = r["prompt"].split(": ", 1)
        if head == "Add":
            a, b = body.split(" + ")
            assert int(r["completion"]) == int(a) + int(b)
        elif head == "Sort ascending":
            assert r["completion"].split() == sorted(body.split(), key=int)
        else:
            assert r["completion"].split() == body.split()[::-1]


def test_prompt_tokens_are_masked(tok):
    (ex,) = encode_rows([{"prompt": "Add: 1 + 2", "completion": "3"}], tok, 64)
    trained = [i for i, l in zip(ex.input_ids, ex.labels) if l != IGNORE]
    assert tok.decode(trained) == "3" + tok.eos_token
    assert ex.labels[: len(ex.gen_prompt_ids)] == [IGNORE] * len(ex.gen_prompt_ids)
    assert ex.answer == "3"


def test_text_and_chat_rows(tok):
    text, chat = encode_rows([
        {"text": "hello"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                      {"role": "user", "content": "again"},
                      {"role": "assistant", "content": "ok"}]}], tok, 128)
    assert all(l != IGNORE for l in text.labels)
    trained = tok.decode([i for i, l in zip(chat.input_ids, chat.labels) if l != IGNORE])
    # the fallback without a chat template: each assistant turn ends with EOS, so
    # that the model learns to stop; only the assistant's turns carry labels
    assert trained == "yo<eos>\nok<eos>\n"
    assert chat.answer == "ok"


@pytest.mark.parametrize("line, msg", [
    ('{"prompt": "a", "completion": "b"', "not valid JSON"),
    ('{"prompt": "a"}', "no 'completion'"),
    ('{"prompt": 1, "completion": "b"}', "'prompt' must be a string"),
    ('{"foo": 1}', "unknown row format"),
    ('[1, 2]', "expected a JSON object"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant turn"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path, line, msg):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError) as e:
        read_jsonl(str(p))
    assert f"{p}:2" in str(e.value) and msg in str(e.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_jsonl(str(tmp_path / "nope.jsonl"))
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no rows"):
        read_jsonl(str(tmp_path / "e.jsonl"))


@pytest.mark.parametrize("world, bs, accum", [(1, 4, 1), (2, 4, 1), (3, 2, 2)])
def test_sharding_partitions_each_global_batch(world, bs, accum):
    n, g = 50, world * bs * accum
    spe = n // g
    seen_epoch = []
    for step in range(1, spe + 1):
        parts = [batches_at((step - 1) * g, n=n, seed=3, rank=r, world=world, batch_size=bs,
                            grad_accum=accum) for r in range(world)]
        flat = [i for p in parts for mb in p for i in mb]
        assert len(flat) == g == len(set(flat))
        assert all(len(p) == accum and all(len(mb) == bs for mb in p) for p in parts)
        seen_epoch += flat
    assert len(set(seen_epoch)) == spe * g  # no example twice within an epoch
    # a pure function of (seed, offset): resume needs no replay
    assert batches_at(g, n=n, seed=3, rank=0, world=world, batch_size=bs, grad_accum=accum) \
        == batches_at(g, n=n, seed=3, rank=0, world=world, batch_size=bs, grad_accum=accum)


def test_collate_pads_right_and_masks(tok):
    exs = encode_rows([{"prompt": "a", "completion": "bb"}, {"text": "hello world"}], tok, 64)
    b = collate(exs, tok.pad_token_id)
    assert b["input_ids"].shape == b["labels"].shape == b["attention_mask"].shape
    short = 0 if len(exs[0].input_ids) < len(exs[1].input_ids) else 1
    k = len(exs[short].input_ids)
    assert (b["labels"][short, k:] == IGNORE).all() and (b["attention_mask"][short, k:] == 0).all()


def test_batched_tokenization_equals_one_row_at_a_time(tok):
    """encode_rows tokenizes all texts in one call; the examples are the ones a
    row-by-row encode gives (demo rows and text rows, truncation included)."""
    from lorasync.train.data import _Formatter

    rows = demo_rows(300, 0)[0] + [{"text": "hello world " * 40}, {"text": "hi"}]
    fmt = _Formatter(tok, 48)
    one_by_one = [e for e in map(fmt.encode, rows) if any(t != IGNORE for t in e.labels)]
    assert len(one_by_one) > 250 and encode_rows(rows, tok, 48) == one_by_one


def test_the_launchers_bare_tiny_tokenizer_encodes_the_same(tok):
    """The launcher checks the data with the tiny tokenizer without transformers;
    it must find the very examples the workers' tokenizer makes."""
    from lorasync.train.model import _tiny_tokenizer

    rows = demo_rows(200, 0)[0] + [{"text": "hello world " * 40}, {"prompt": "", "completion": ""}]
    bare = _tiny_tokenizer(bare=True)
    assert bare.eos_token == tok.eos_token and bare.pad_token_id == tok.pad_token_id
    assert encode_rows(rows, bare, 48) == encode_rows(rows, tok, 48)


def test_the_launchers_check_encodes_only_what_it_needs(tok, tmp_path):
    from lorasync.config import DataConfig
    from lorasync.train.data import load_datasets

    cfg = DataConfig(demo_size=4000, eval_size=8)
    train, ev = load_datasets(cfg, tok, need=16)
    full, _ = load_datasets(cfg, tok)
    assert 16 <= len(train) < len(full) and ev == [] and train == full[:len(train)]
    # every row of a file is still read and validated, the last one too
    bad = tmp_path / "d.jsonl"
    bad.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(30)) + "{oops\n")
    with pytest.raises(DataError, match="d.jsonl:31"):
        load_datasets(DataConfig(path=str(bad), eval_size=0), tok, need=2)
