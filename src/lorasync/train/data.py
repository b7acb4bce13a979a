"""Training data: the bundled demo task, JSONL files, tokenization, sharding.

The demo task is generated, deterministic and exactly checkable: a mix of
3-digit addition, sorting five 2-digit numbers and reversing four words.  A
base model scores near 0% exact-match and a LoRA adapter learns it in a few
minutes on CPU, while leaving room to see a sync strategy that hurts.  The
eval split is fixed (independent of the run seed) and disjoint from the
training split, so runs with different seeds or strategies are comparable.

Order and sharding are pure functions of (seed, step): the batch of step s is
known without replaying steps 1..s-1, which makes resume exact.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

from lorasync.errors import ConfigError, DataError

__all__ = ["Example", "demo_rows", "read_jsonl", "encode_rows", "load_datasets",
           "batches_at", "steps_per_epoch", "collate"]

IGNORE = -100

_WORDS = ("apple river stone cloud tiger lemon piano rocket garden silver candle forest "
          "window bridge planet copper meadow falcon harbor violet marble winter summer "
          "autumn spring castle dragon pepper butter ladder mirror pencil rabbit saddle "
          "thunder valley walnut yellow zebra anchor basket cactus dolphin engine feather "
          "guitar helmet island jacket kettle lantern magnet napkin orange parrot quartz "
          "ribbon shadow tomato umbrella velvet wagon").split()


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]           # IGNORE on prompt and padding
    gen_prompt_ids: list[int] | None = None  # prompt to generate from, for exact-match
    answer: str | None = None   # expected completion, for exact-match


def _demo_row(rng: random.Random) -> dict:
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        return {"prompt": f"Add: {a} + {b}", "completion": str(a + b)}
    if kind == 1:
        nums = [rng.randint(10, 99) for _ in range(5)]
        return {"prompt": "Sort ascending: " + " ".join(map(str, nums)),
                "completion": " ".join(map(str, sorted(nums)))}
    words = rng.sample(_WORDS, 4)
    return {"prompt": "Reverse the words: " + " ".join(words),
            "completion": " ".join(reversed(words))}


def demo_rows(n_train: int, n_eval: int) -> tuple[list[dict], list[dict]]:
    """Deterministic (train, eval) rows of the demo task; eval prompts never in train."""
    erng = random.Random(20261130)
    eval_rows, seen = [], set()
    while len(eval_rows) < n_eval:
        r = _demo_row(erng)
        if r["prompt"] not in seen:
            seen.add(r["prompt"])
            eval_rows.append(r)
    trng = random.Random(7)
    train_rows = []
    while len(train_rows) < n_train:
        r = _demo_row(trng)
        if r["prompt"] not in seen:
            train_rows.append(r)
    return train_rows, eval_rows


def _text(value: str, where: str, field: str) -> str:
    """``value``, unless it holds an unpaired surrogate (a ``\\ud800`` escape
    without its pair): valid JSON, but no tokenizer can encode it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(f"{where}: field {field!r} holds an unpaired UTF-16 surrogate "
                        f"({value[exc.start]!r} at character {exc.start}); write the character "
                        "itself or its full surrogate pair") from None
    return value


def _check_row(row, path: str, lineno: int) -> dict:
    where = f"{path}:{lineno}"
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}; each line "
                        'must be {"prompt","completion"}, {"text"} or {"messages"}')
    keys = set(row)
    if {"prompt", "completion"} <= keys:
        for k in ("prompt", "completion"):
            if not isinstance(row[k], str):
                raise DataError(f"{where}: field {k!r} must be a string, got "
                                f"{type(row[k]).__name__}")
            _text(row[k], where, k)
        return {"prompt": row["prompt"], "completion": row["completion"]}
    if "text" in keys:
        if not isinstance(row["text"], str) or not row["text"]:
            raise DataError(f"{where}: field 'text' must be a non-empty string")
        return {"text": _text(row["text"], where, "text")}
    if "messages" in keys:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: field 'messages' must be a non-empty list of "
                            '{"role", "content"} objects')
        for i, m in enumerate(msgs):
            if (not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant")
                    or not isinstance(m.get("content"), str)):
                raise DataError(f"{where}: messages[{i}] must be {{\"role\": "
                                "system|user|assistant, \"content\": string}")
            _text(m["content"], where, f"messages[{i}].content")
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{where}: 'messages' has no assistant turn, so nothing to learn; "
                            "add the assistant's reply")
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in msgs]}
    if "prompt" in keys or "completion" in keys:
        missing = "completion" if "prompt" in keys else "prompt"
        raise DataError(f"{where}: row has no {missing!r} field; give both prompt and completion")
    raise DataError(f"{where}: unknown row format with keys {sorted(keys)}; use "
                    '{"prompt","completion"}, {"text"} or {"messages"}')


def read_jsonl(path: str, field: str = "data.path") -> list[dict]:
    """Validated rows of a JSONL file; DataError names file, line and fix
    (``field``: the option that named the file)."""
    if not os.path.isfile(path):
        raise DataError(f"{field}: file {path!r} not found; give "
                        + ("'demo' or " if field == "data.path" else "") + "a JSONL file")
    rows = []
    try:
        with open(path, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                try:   # line by line, so that the error names the line
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as exc:
                    raise DataError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[exc.start]:02x} "
                                    f"at column {exc.start + 1}); save the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column "
                                    f"{exc.colno}); fix or remove the line") from None
                except RecursionError:
                    raise DataError(f"{path}:{lineno}: JSON nested too deeply; a row is one "
                                    'object such as {"prompt": ..., "completion": ...}') from None
                except ValueError as exc:   # e.g. an integer of more than 4300 digits
                    raise DataError(f"{path}:{lineno}: not usable JSON ({exc}); fix or remove "
                                    "the line") from None
                rows.append(_check_row(row, path, lineno))
    except OSError as exc:
        raise DataError(f"{field}: cannot read {path!r} ({exc.strerror}); give a readable "
                        "JSONL file") from None
    if not rows:
        raise DataError(f"{path}: file has no rows; add JSONL rows")
    return rows


class _Formatter:
    """Turns rows into token ids, with prompt tokens masked out of the loss."""

    def __init__(self, tok, seq_len: int):
        self.tok, self.seq_len = tok, seq_len
        self.chat = bool(getattr(tok, "chat_template", None))
        self.eos = tok.eos_token or ""
        self._known: dict[str, list[int]] = {}     # text -> ids (prefetch)
        self._rendered: dict[str, str] = {}        # prompt -> chat-rendered text

    def _ids(self, text: str) -> list[int]:
        ids = self._known.get(text)
        return list(ids) if ids is not None else \
            self.tok(text, add_special_tokens=False)["input_ids"]

    def prefetch(self, rows: list[dict]) -> None:
        """Tokenize the texts of text and prompt/completion rows in one batched call
        (a fast tokenizer's per-call overhead dominates on short rows: 4,000 demo
        rows took a second one by one); ``encode`` then looks them up."""
        texts = set()
        for row in rows:
            if "text" in row:
                texts.add(row["text"] + self.eos)
            elif "prompt" in row:
                texts.add(self.prompt_text(row["prompt"]))
                texts.add(row["completion"] + self.eos)
        texts -= self._known.keys()
        if texts:
            batch = sorted(texts)
            self._known.update(zip(batch, self.tok(batch, add_special_tokens=False)["input_ids"]))

    def _render(self, msgs, add_generation_prompt: bool) -> str:
        if self.chat:
            return self.tok.apply_chat_template(msgs, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)
        out = "".join(f"{m['role']}: {m['content']}\n" for m in msgs)
        return out + ("assistant: " if add_generation_prompt else "")

    def prompt_text(self, prompt: str) -> str:
        if not self.chat:
            return prompt + "\n"
        text = self._rendered.get(prompt)
        if text is None:
            text = self._rendered[prompt] = self._render([{"role": "user", "content": prompt}],
                                                         True)
        return text

    def encode(self, row: dict) -> Example:
        if "text" in row:
            ids = self._ids(row["text"] + self.eos)[: self.seq_len]
            return Example(ids, list(ids))
        if "prompt" in row:
            p = self._ids(self.prompt_text(row["prompt"]))
            c = self._ids(row["completion"] + self.eos)
            ids = (p + c)[: self.seq_len]
            labels = ([IGNORE] * len(p) + c)[: self.seq_len]
            return Example(ids, labels, p, row["completion"].strip())
        # chat rows: loss on every assistant turn; exact-match on the last one
        msgs = row["messages"]
        ids: list[int] = []
        labels: list[int] = []
        prev = ""
        gen_prompt, answer = None, None
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                head = self._render(msgs[:i], True)
                full = self._render(msgs[: i + 1], False)
                if not full.startswith(head) or not head.startswith(prev):
                    raise DataError("data: the tokenizer's chat template does not render "
                                    "conversations incrementally; use prompt/completion rows")
                h = self._ids(head[len(prev):])
                body = self._ids(full[len(head):])
                ids += h + body
                labels += [IGNORE] * len(h) + body
                prev = full
                gen_prompt, answer = list(ids[: len(ids) - len(body)]), m["content"].strip()
        return Example(ids[: self.seq_len], labels[: self.seq_len], gen_prompt, answer)


def encode_rows(rows: list[dict], tok, seq_len: int) -> list[Example]:
    fmt = _Formatter(tok, seq_len)
    fmt.prefetch(rows)
    out = [fmt.encode(r) for r in rows]
    return [e for e in out if any(t != IGNORE for t in e.labels)]


def _first_examples(rows: list[dict], tok, seq_len: int, need: int) -> list[Example]:
    """At least ``need`` examples of ``rows`` (all of them, if fewer), encoding
    only as many rows as that takes."""
    out: list[Example] = []
    chunk = max(64, need)
    for i in range(0, len(rows), chunk):
        out += encode_rows(rows[i:i + chunk], tok, seq_len)
        if len(out) >= need:
            break
    return out


def load_datasets(data_cfg, tok, need: int | None = None
                  ) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples for a DataConfig; DataError on bad input.

    ``need``: encode only until that many training examples are found (the
    launcher's check that the data fills a global batch; every row is still
    read and validated), and no eval examples."""
    if data_cfg.path == "demo":
        train_rows, eval_rows = demo_rows(data_cfg.demo_size, data_cfg.eval_size)
    else:
        if data_cfg.eval_path and os.path.isfile(data_cfg.eval_path) \
                and os.path.isfile(data_cfg.path) \
                and os.path.samefile(data_cfg.eval_path, data_cfg.path):
            raise ConfigError("data.eval_path", data_cfg.eval_path,
                              "is the training file: evaluating on the rows the adapter trains "
                              "on measures nothing; give a held-out JSONL file, or drop "
                              "--eval-data to hold out the last rows of --data")
        rows = read_jsonl(data_cfg.path)
        if data_cfg.eval_path:
            train_rows = rows
            eval_rows = read_jsonl(data_cfg.eval_path, "data.eval_path")[: data_cfg.eval_size]
        else:
            # hold out the last rows, at most a fifth of the file
            n_eval = min(data_cfg.eval_size, len(rows) // 5)
            train_rows, eval_rows = rows[: len(rows) - n_eval], rows[len(rows) - n_eval:]
    check_only = need is not None
    train = _first_examples(train_rows, tok, data_cfg.seq_len, max(1, need)) if check_only \
        else encode_rows(train_rows, tok, data_cfg.seq_len)
    if not train:
        raise DataError(f"data.path: no example of {data_cfg.path!r} keeps a trainable token "
                        f"within seq_len={data_cfg.seq_len}; raise --seq-len")
    return train, [] if check_only else encode_rows(eval_rows, tok, data_cfg.seq_len)


def steps_per_epoch(n: int, global_batch: int) -> int:
    return n // global_batch


def _permutation(seed: int, epoch: int, n: int):
    import numpy as np

    return np.random.default_rng([seed, epoch]).permutation(n)


def batches_at(offset: int, *, n: int, seed: int, rank: int, world: int, batch_size: int,
               grad_accum: int) -> list[list[int]]:
    """This rank's micro-batches of the global batch that starts at sample ``offset``.

    The data is an endless stream of permutations, one per epoch, seeded by
    (seed, epoch); a step takes the next world*batch*accum samples of it and
    rank r gets every world-th one, so the union over ranks is exactly one
    global batch.  Only the offset (samples consumed so far) is needed to
    know what comes next, which makes resume exact, also when the number of
    micro-batches per step changes during the run (adaptive accumulation).
    """
    g = world * batch_size * grad_accum
    idx: list[int] = []
    pos = offset
    while len(idx) < g:
        epoch, off = divmod(pos, n)
        take = min(g - len(idx), n - off)
        idx += _permutation(seed, epoch, n)[off:off + take].tolist()
        pos += take
    mine = idx[rank::world]
    return [mine[i * batch_size:(i + 1) * batch_size] for i in range(grad_accum)]


def collate(examples: list[Example], pad_id: int):
    """Right-padded tensors: input_ids, attention_mask, labels."""
    import torch

    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        k = len(e.input_ids)
        ids[i, :k] = torch.tensor(e.input_ids)
        labels[i, :k] = torch.tensor(e.labels)
        mask[i, :k] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
