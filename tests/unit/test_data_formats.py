"""The data formats people have: JSONL/JSON/CSV/TSV/Parquet files, datasets'
save_to_disk directories and cached Hub ids; prompt/completion, text,
messages, Alpaca and ShareGPT rows; column mapping; chat templates with loss
on the assistant only; packing; the warning on cut and dropped examples."""

from __future__ import annotations

import json
import os

import pytest

from _bad_input import Guard, refused
from lorasync.config import DataConfig, load_config
from lorasync.errors import ConfigError, DataError
from lorasync.train.data import (IGNORE, Example, collate, encode_rows, load_datasets, pack,
                                 read_rows)
from lorasync.train.model import ModelSource, _tiny_tokenizer, load_base

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """datasets' cache (prepared Arrow files) and the hub cache under tmp_path."""
    import datasets
    import huggingface_hub.constants as hub

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    return tmp_path


@pytest.fixture(scope="module")
def tok():
    return _tiny_tokenizer(bare=True)


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ---------------------------------------------------------------- row formats

def test_alpaca_json_array_becomes_prompt_completion(tmp_path):
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps([
        {"instruction": "Add", "input": "1 + 2", "output": "3"},
        {"instruction": "Say hi", "input": "", "output": "hi"},
        {"instruction": "Be brief", "input": "", "output": "ok", "system": "You are terse."}]))
    rows, held = read_rows(str(path))
    assert held is None
    assert rows[0] == {"prompt": "Add\n\n1 + 2", "completion": "3"}
    assert rows[1] == {"prompt": "Say hi", "completion": "hi"}
    assert rows[2]["messages"][0] == {"role": "system", "content": "You are terse."}
    assert rows[2]["messages"][-1] == {"role": "assistant", "content": "ok"}


def test_sharegpt_rows_map_their_roles(tmp_path):
    path = jsonl(tmp_path / "sg.jsonl", [{"conversations": [
        {"from": "system", "value": "s"}, {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "yo"}]}])
    (rows, _) = read_rows(path)
    assert rows == [{"messages": [{"role": "system", "content": "s"},
                                  {"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": "yo"}]}]


@pytest.mark.parametrize("row, fmt, needle", [
    ({"conversations": [{"from": "human", "value": "a"}, {"from": "tool", "value": "b"}]},
     "auto", "conversations[1].from is 'tool'"),
    ({"messages": [{"role": ["user"], "content": "a"}]}, "auto", "messages[0] must be"),
    ({"conversations": [{"from": "human", "value": "a"}]}, "auto", "no assistant turn"),
    ({"instruction": "a"}, "auto", "no 'output' field"),
    ({"instruction": "a", "output": 3}, "auto", "'output' must be a string"),
    ({"prompt": "a", "completion": "b"}, "alpaca", "--data-format alpaca"),
    ({"question": "a", "answer": "b"}, "auto", "--data-columns"),
])
def test_bad_rows_name_file_line_and_field(tmp_path, row, fmt, needle):
    good = {"instruction": "a", "output": "b"} if fmt == "alpaca" else {"text": "fine"}
    path = jsonl(tmp_path / "d.jsonl", [good, row])
    with pytest.raises(DataError) as e:
        read_rows(path, fmt=fmt)
    assert f"{path}:2" in str(e.value) and needle in str(e.value)
    assert "\n" not in str(e.value)


def test_column_mapping_and_csv_cells_stay_text(tmp_path):
    path = tmp_path / "qa.csv"
    path.write_text('question,answer,note\n"Zip code, padded?",007,x\n"two\nlines",,y\n')
    cols = {"prompt": "question", "completion": "answer"}
    rows, _ = read_rows(str(path), columns=cols)
    # '007' stays '007' (not the number 7), an empty cell is an empty completion
    assert rows == [{"prompt": "Zip code, padded?", "completion": "007"},
                    {"prompt": "two\nlines", "completion": ""}]
    with pytest.raises(DataError, match=r"qa.csv: no column 'q' .*question, answer, note"):
        read_rows(str(path), columns={"prompt": "q", "completion": "answer"})
    with pytest.raises(DataError, match=r"qa.csv: row 1: unknown row format"):
        read_rows(str(path))
    # the same mapping on JSONL rows
    path = jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "a"}])
    assert read_rows(path, columns=cols)[0] == [{"prompt": "q", "completion": "a"}]


def test_tsv_and_malformed_csv(tmp_path):
    (tmp_path / "d.tsv").write_text("text\tid\nhello, world\t1\n")
    assert read_rows(str(tmp_path / "d.tsv"))[0] == [{"text": "hello, world"}]
    (tmp_path / "bad.csv").write_text("prompt,completion\na,b\nc,d,e\n")
    with pytest.raises(DataError) as e:
        read_rows(str(tmp_path / "bad.csv"))
    assert str(e.value).startswith(f"{tmp_path / 'bad.csv'}: cannot read it as CSV")
    assert "line 3" in str(e.value) and "\n" not in str(e.value)


def test_parquet_and_saved_dataset_directory(tmp_path):
    import datasets

    chats = datasets.Dataset.from_list([{"messages": [
        {"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(10)])
    chats.to_parquet(str(tmp_path / "chat.parquet"))
    rows, _ = read_rows(str(tmp_path / "chat.parquet"))
    assert len(rows) == 10 and rows[3]["messages"][1] == {"role": "assistant", "content": "a3"}
    # save_to_disk with a test split: trained on train, evaluated on test
    datasets.DatasetDict({"train": chats, "test": chats.select(range(7, 10))}).save_to_disk(
        str(tmp_path / "saved"))
    rows, held = read_rows(str(tmp_path / "saved"))
    assert len(rows) == 10 and [r["messages"][0]["content"] for r in held] == ["u7", "u8", "u9"]
    train, ev = load_datasets(DataConfig(path=str(tmp_path / "saved"), eval_size=2),
                              _tiny_tokenizer(bare=True))
    assert len(train) == 10 and [e.answer for e in ev] == ["a7", "a8"]
    with pytest.raises(DataError, match="no split 'dev'; choose one of train, test"):
        read_rows(str(tmp_path / "saved"), split="dev")


def test_hub_dataset_from_the_local_cache_only(tmp_path):
    # what `hf download me/toy --repo-type dataset` leaves in the hub cache
    repo = tmp_path / "hf-hub" / "datasets--me--toy"
    snap = repo / "snapshots" / ("a" * 40) / "data"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    jsonl(snap / "train.jsonl", [{"prompt": f"p{i}", "completion": "c"} for i in range(7)])
    rows, _ = read_rows("me/toy")
    assert rows[6] == {"prompt": "p6", "completion": "c"}
    with pytest.raises(DataError) as e:
        read_rows("me/absent")
    assert "`hf download me/absent --repo-type dataset`" in str(e.value)
    assert "\n" not in str(e.value)


def test_other_files_are_read_as_jsonl(tmp_path):
    """As before the other formats: a file that is not a table is JSONL."""
    (tmp_path / "d.txt").write_text('{"text": "hello"}\nhello\n')
    with pytest.raises(DataError, match=r"d.txt:2: not valid JSON"):
        read_rows(str(tmp_path / "d.txt"))
    with pytest.raises(DataError, match="file .*nope.txt' not found"):
        read_rows(str(tmp_path / "nope.txt"))


# ---------------------------------------------------------------- config

def test_data_columns_and_format_options():
    cfg = load_config(None, {"data": {"columns": "prompt=question, completion=answer",
                                      "format": "prompt_completion", "packing": "true"}})
    assert cfg.data.columns == {"prompt": "question", "completion": "answer"}
    assert cfg.data.packing is True
    assert load_config(None, {"data": {"columns": {"text": "body"}}}).data.columns == \
        {"text": "body"}
    for bad, needle in [("prompt", "FIELD=COLUMN"), ("answer=x", "map one of the format's"),
                        ("prompt=a,completion=a", "one field only"),
                        ("prompt=a,prompt=b", "mapped twice")]:
        with pytest.raises(ConfigError, match=needle) as e:
            DataConfig(columns=bad)
        assert e.value.field == "data.columns"
    with pytest.raises(ConfigError, match="use auto, prompt_completion"):
        DataConfig(format="chatml")


@pytest.mark.parametrize("files, flags, needles", [
    ({"d.csv": "question,answer\n" + "q,a\n" * 20},
     ["--data", "d.csv", "--data-columns", "prompt=question,completion=reply"],
     ("d.csv", "no column 'reply'", "question, answer")),
    ({}, ["--data", "someone/uncached"],
     ("data.path", "`hf download someone/uncached --repo-type dataset`")),
    ({"d.jsonl": json.dumps({"prompt": "p", "completion": "c"}) + "\n"},
     ["--data", "d.jsonl", "--data-format", "sharegpt"],
     ("d.jsonl:1", "'conversations'", "--data-format sharegpt")),
    # 20 short rows pack into fewer rows than a global batch of 2 x 4
    ({"d.jsonl": "".join(json.dumps({"text": f"r{i}"}) + "\n" for i in range(20))},
     ["--data", "d.jsonl", "--packing", "--eval-size", "0", "--batch-size", "4"],
     ("data.path", "fewer than one global batch")),
])
def test_bad_data_is_refused_before_any_worker(monkeypatch, tmp_path, capsys, files, flags,
                                               needles):
    work = tmp_path / "w"   # datasets' cache (the fixture's) lies beside it
    work.mkdir()
    monkeypatch.chdir(work)
    Guard(monkeypatch)
    for name, text in files.items():
        (work / name).write_text(text)
    refused(capsys, work, ["train", "--model", "tiny", "--no-progress", *flags,
                           "--output-dir", "r"], *needles)


# ---------------------------------------------------------------- chat templates, lengths

def test_chat_template_puts_the_loss_on_assistant_tokens_only():
    tok = load_base(ModelSource.resolve("tiny"))[1]
    tok.chat_template = CHATML
    (chat, pc) = encode_rows([
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "yo"}, {"role": "user", "content": "2"},
                      {"role": "assistant", "content": "ok"}]},
        {"prompt": "Add: 1 + 2", "completion": "3"}], tok, 512)
    trained = tok.decode([i for i, l in zip(chat.input_ids, chat.labels) if l != IGNORE])
    assert trained == "yo<|im_end|>\nok<|im_end|>\n"
    assert tok.decode(chat.input_ids).startswith("<|im_start|>system\ns<|im_end|>")
    assert tok.decode(chat.gen_prompt_ids).endswith("<|im_start|>user\n2<|im_end|>\n"
                                                    "<|im_start|>assistant\n")
    # prompt/completion: the prompt as a user turn, the loss on the completion and EOS
    trained = tok.decode([i for i, l in zip(pc.input_ids, pc.labels) if l != IGNORE])
    assert trained == "3<eos>" and tok.decode(pc.gen_prompt_ids).startswith("<|im_start|>user")


def test_a_template_that_refuses_a_conversation_names_the_row():
    tok = load_base(ModelSource.resolve("tiny"))[1]
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ "
                         "raise_exception('System role not supported') }}{% endif %}{% endfor %}"
                         + CHATML)
    user, bot = {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}
    rows = [{"messages": [user, bot]},
            {"messages": [{"role": "system", "content": "s"}, user, bot]}]
    with pytest.raises(DataError, match="data.path: row 2: the tokenizer's chat template "
                                        "refused .*System role not supported"):
        encode_rows(rows, tok, 64)
    with pytest.raises(DataError, match="row 1: the conversation starts with the assistant"):
        encode_rows([{"messages": [bot, user, bot]}], tok, 64)


def test_cut_and_dropped_examples_are_counted_once(tmp_path, tok):
    """The issue's case: 48 rows, half with a prompt longer than seq_len, became
    24 examples without a word."""
    rows = [{"prompt": "x" * (100 if i % 2 else 5), "completion": "yes"} for i in range(48)]
    path = jsonl(tmp_path / "d.jsonl", rows + [{"text": "held out"}] * 12)
    said = []
    train, _ = load_datasets(DataConfig(path=path, seq_len=64, eval_size=12), tok,
                             warn=said.append)
    assert len(train) == 24 and len(said) == 1
    assert "24 of 48 training rows are longer than seq_len=64" in said[0]
    assert "24 of them kept no trainable token" in said[0] and "--seq-len" in said[0]
    said.clear()
    load_datasets(DataConfig(path=path, seq_len=128, eval_size=12), tok, warn=said.append)
    assert said == []


# ---------------------------------------------------------------- packing

def _examples(tok, n=12):
    rows = [{"prompt": f"Add: {i} + {i}", "completion": str(2 * i)} if i % 3 else
            {"text": "word " * (i + 1)} for i in range(n)]
    return encode_rows(rows, tok, 64)


def test_packing_keeps_examples_whole_and_masks_boundaries(tok):
    exs = _examples(tok)
    packed = pack(exs, 64)
    assert len(packed) < len(exs) and all(len(p.input_ids) <= 64 for p in packed)
    # every example appears once, whole: split each row at its position restarts
    pieces = []
    for p in packed:
        starts = [i for i, q in enumerate(p.position_ids) if q == 0] + [len(p.input_ids)]
        assert p.position_ids == [q for a, b in zip(starts, starts[1:]) for q in range(b - a)]
        for a, b in zip(starts, starts[1:]):
            pieces.append((p.input_ids[a:b], p.labels[a:b]))
            assert p.labels[a] == IGNORE   # never predicted across a boundary
    want = sorted((e.input_ids, [IGNORE] + e.labels[1:]) for e in exs)
    assert sorted(pieces) == want


def test_a_packed_batch_computes_what_each_example_alone_does():
    """Attention stays inside each packed example: per-token logits and the
    summed loss equal those of the examples one by one."""
    import torch

    model, tok = load_base(ModelSource.resolve("tiny"))
    model.eval()
    exs = _examples(tok, 9)
    packed = pack(exs, 64)
    batch = collate(packed, tok.pad_token_id)
    assert "attention_mask" not in batch and batch["position_ids"].shape == batch["labels"].shape
    with torch.no_grad():
        # as the trainer calls it: without a KV cache (transformers masks packed
        # examples apart only then)
        out = model(**batch, use_cache=False).logits
        loss_sum = 0.0
        for row, p in enumerate(packed):
            starts = [i for i, q in enumerate(p.position_ids) if q == 0] + [len(p.input_ids)]
            for a, b in zip(starts, starts[1:]):
                alone = model(input_ids=torch.tensor([p.input_ids[a:b]])).logits[0]
                assert torch.allclose(out[row, a:b], alone, atol=1e-5)
        logits, labels = out[:, :-1], batch["labels"][:, 1:]
        loss_sum = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
        one_by_one = 0.0
        for e in exs:
            lg = model(input_ids=torch.tensor([e.input_ids])).logits[0, :-1]
            one_by_one += torch.nn.functional.cross_entropy(
                lg, torch.tensor(e.labels[1:]), reduction="sum", ignore_index=IGNORE)
    assert torch.allclose(loss_sum, one_by_one, rtol=1e-5)


def test_load_datasets_packs_train_only(tmp_path, tok):
    path = jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "completion": f"c{i}"}
                                        for i in range(40)])
    plain, ev = load_datasets(DataConfig(path=path, eval_size=8, seq_len=64), tok)
    packed, ev2 = load_datasets(DataConfig(path=path, eval_size=8, seq_len=64, packing=True),
                                tok)
    assert ev == ev2 and all(e.position_ids is None for e in ev)
    assert len(packed) < len(plain)
    assert sum(len(e.input_ids) for e in packed) == sum(len(e.input_ids) for e in plain)
    # the launcher's check: packed rows count against the global batch; it packs only
    # when the bound tokens / seq_len does not show there are enough
    cfg = DataConfig(path=path, eval_size=8, seq_len=64, packing=True)
    tokens = sum(len(e.input_ids) for e in plain)
    assert len(load_datasets(cfg, tok, need=tokens // 64)[0]) >= tokens // 64
    assert len(load_datasets(cfg, tok, need=len(packed) + 1)[0]) == len(packed)


def test_collate_without_packing_is_unchanged(tok):
    b = collate([Example([5, 6, 7], [IGNORE, 6, 7]), Example([5], [5])], 0)
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["labels"].tolist() == [[IGNORE, 6, 7], [5, IGNORE, IGNORE]]
    assert set(b) == {"input_ids", "attention_mask", "labels"}
    assert not os.environ.get("LOCAL_RANK")
