"""Training data: the bundled demo task, the data people have, tokenization,
packing, sharding.

Sources: JSONL (read here, line by line), JSON, CSV/TSV, Parquet, datasets'
save_to_disk directories and Hub datasets in the local cache (through the
``datasets`` library, offline).  Rows: prompt/completion, text, messages,
Alpaca and ShareGPT, detected per row or named (``--data-format``), with the
user's column names mapped (``--data-columns``); all become the three forms
``encode_rows`` takes.  Chat templates come from the tokenizer, with the loss
on the assistant's tokens only; docs/data.md has the fallback without one.

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

__all__ = ["Example", "demo_rows", "read_jsonl", "read_rows", "encode_rows", "pack",
           "load_datasets", "batches_at", "steps_per_epoch", "collate", "batch_tokens"]

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
    position_ids: list[int] | None = None   # packed: restarts at 0 for each example in it


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


_ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant",
          "gpt": "assistant"}
_FORMATS_HINT = ('{"prompt","completion"}, {"text"}, {"messages"}, Alpaca '
                 '{"instruction","input","output"} or ShareGPT {"conversations"}')
#: what each explicit --data-format needs (the others are optional: Alpaca's input, system)
_NEEDS = {"prompt_completion": ("prompt", "completion"), "text": ("text",),
          "messages": ("messages",), "alpaca": ("instruction", "output"),
          "sharegpt": ("conversations",)}


def _string(row: dict, key: str, where: str, empty_ok: bool = True) -> str:
    value = row[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    if not empty_ok and not value:
        raise DataError(f"{where}: field {key!r} must be a non-empty string")
    return _text(value, where, key)


def _conversation(turns, where: str, key: str) -> list[dict]:
    """A ``messages`` (role/content) or ShareGPT ``conversations`` (from/value)
    list as role/content messages with the roles system, user and assistant."""
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: field {key!r} must be a non-empty list of "
                        '{"role", "content"} objects')
    out = []
    for i, m in enumerate(turns):
        rk, ck = ("from", "value") if isinstance(m, dict) and m.get("role") is None \
            and m.get("from") is not None else ("role", "content")
        name = m.get(rk) if isinstance(m, dict) else None
        role = _ROLES.get(name) if isinstance(name, str) else None
        if isinstance(name, str) and role is None:
            raise DataError(f"{where}: {key}[{i}].{rk} is {name[:40]!r}, a role lorasync does "
                            "not train on; use system, user or assistant (ShareGPT: system, "
                            "human or gpt)")
        if role is None or not isinstance(m.get(ck), str):
            raise DataError(f"{where}: {key}[{i}] must be {{\"role\": system|user|assistant, "
                            '"content": string} (ShareGPT: {"from": system|human|gpt, '
                            '"value": string})')
        out.append({"role": role, "content": _text(m[ck], where, f"{key}[{i}].{ck}")})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: {key!r} has no assistant turn, so nothing to learn; "
                        "add the assistant's reply")
    return out


def _detect(keys: set) -> str | None:
    """The row format of a row with these (non-null) fields, or None."""
    if {"prompt", "completion"} <= keys:
        return "prompt_completion"
    if {"instruction", "output"} <= keys:
        return "alpaca"
    if "text" in keys:
        return "text"
    if "messages" in keys:
        return "messages"
    if "conversations" in keys:
        return "sharegpt"
    return None


def _normalize(row, where: str, fmt: str = "auto") -> dict:
    """One row in the canonical form ``encode_rows`` takes ({prompt, completion},
    {text} or {messages}); DataError naming ``where`` (file and line or row),
    the field and the fix."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}; each "
                        f"row must be {_FORMATS_HINT}")
    keys = {k for k, v in row.items() if v is not None}   # a table's empty cell is None
    kind = _detect(keys) if fmt == "auto" else fmt
    if kind is None:
        for pair in (("prompt", "completion"), ("instruction", "output")):
            if keys & set(pair):
                missing = pair[1] if pair[0] in keys else pair[0]
                raise DataError(f"{where}: row has no {missing!r} field; give both "
                                f"{pair[0]} and {pair[1]}")
        raise DataError(f"{where}: unknown row format with keys {sorted(map(str, keys))}; use "
                        f"{_FORMATS_HINT}, or name your columns with --data-columns, e.g. "
                        "prompt=question,completion=answer")
    missing = [k for k in _NEEDS[kind] if k not in keys]
    if missing:
        raise DataError(f"{where}: row has no {missing[0]!r} field, which --data-format {kind} "
                        f"needs (fields: {', '.join(sorted(map(str, keys)))}); map your column "
                        f"with --data-columns {missing[0]}=COLUMN")
    if kind == "prompt_completion":
        return {"prompt": _string(row, "prompt", where),
                "completion": _string(row, "completion", where)}
    if kind == "text":
        return {"text": _string(row, "text", where, empty_ok=False)}
    if kind == "alpaca":
        instruction = _string(row, "instruction", where)
        extra = _string(row, "input", where) if "input" in keys else ""
        prompt = f"{instruction}\n\n{extra}" if extra else instruction
        output = _string(row, "output", where)
        system = _string(row, "system", where) if "system" in keys else ""
        if system:
            return {"messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": prompt},
                                 {"role": "assistant", "content": output}]}
        return {"prompt": prompt, "completion": output}
    key = "messages" if kind == "messages" else "conversations"
    return {"messages": _conversation(row[key], where, key)}


def _check_row(row, path: str, lineno: int) -> dict:
    return _normalize(row, f"{path}:{lineno}")


def _rename(row, columns: dict, where: str):
    """``row`` with the user's columns under the format's field names
    (``columns``: field -> column, from --data-columns)."""
    if not columns or not isinstance(row, dict):
        return row
    out = {k: v for k, v in row.items() if k not in columns.values()}
    for field, column in columns.items():
        if column not in row:
            raise DataError(f"{where}: no column {column!r} (--data-columns maps "
                            f"{field}={column}); the row has {sorted(map(str, row))}")
        out[field] = row[column]
    return out


def read_jsonl(path: str, field: str = "data.path", fmt: str = "auto",
               columns: dict | None = None) -> list[dict]:
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
                where = f"{path}:{lineno}"
                rows.append(_normalize(_rename(row, columns or {}, where), where, fmt))
    except OSError as exc:
        raise DataError(f"{field}: cannot read {path!r} ({exc.strerror}); give a readable "
                        "JSONL file") from None
    if not rows:
        raise DataError(f"{path}: file has no rows; add JSONL rows")
    return rows


# ---------------------------------------------------------------- other sources, via datasets

_JSONL = (".jsonl", ".ndjson")
_TABLES = {".json": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}


def _datasets():
    """The ``datasets`` library, offline: lorasync never downloads at run time
    (set on the library, not in the environment the workers inherit)."""
    try:
        import datasets
    except ImportError:
        raise DataError("data.path: reading CSV, Parquet, JSON, dataset directories and Hub "
                        "datasets needs the datasets library: pip install 'lorasync[hf]' (or "
                        "give a JSONL file)") from None
    datasets.config.HF_HUB_OFFLINE = True
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _why(exc: BaseException) -> str:
    """The innermost cause of a datasets error, on one line (the outer one says
    only 'An error occurred while generating the dataset')."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]


def _is_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return 1 <= len(parts) <= 2 and all(
        p and p[0].isalnum() and all(c.isalnum() or c in "-_." for c in p) for p in parts) \
        and os.path.splitext(spec)[1].lower() not in (*_JSONL, *_TABLES)


def _load_table(spec: str, field: str, split: str):
    """(dataset of the split, the dataset's held-out split or None, what to call
    it in messages) for a file, a directory or a cached Hub dataset id."""
    ext = os.path.splitext(spec)[1].lower()
    if not os.path.exists(spec) and not _is_hub_id(spec):
        raise DataError(f"{field}: file {spec!r} not found; give "
                        + ("'demo', " if field == "data.path" else "")
                        + "a data file, a dataset directory or a cached Hub dataset id")
    ds = _datasets()
    try:
        if os.path.isfile(spec):
            kw = {}
            if _TABLES[ext] == "csv":   # every cell as written: '007' stays '007', '' stays ''
                kw = _csv_options(spec, ext)
            loaded = ds.load_dataset(_TABLES[ext], data_files=spec, split="train", **kw)
        elif os.path.isdir(spec):
            saved = any(os.path.isfile(os.path.join(spec, f)) for f in
                        ("dataset_info.json", "state.json", "dataset_dict.json"))
            loaded = ds.load_from_disk(spec) if saved else ds.load_dataset(spec)
        else:
            loaded = _load_hub(ds, spec, field)
    except DataError:
        raise
    except Exception as exc:   # pyarrow, pandas, json, OS: any of them says why in one line
        kind = _TABLES.get(ext, "a dataset").upper() if os.path.isfile(spec) else "a dataset"
        raise DataError(f"{spec}: cannot read it as {kind} ({_why(exc)}); fix the file") \
            from None
    if isinstance(loaded, ds.DatasetDict):
        if split not in loaded:
            raise DataError(f"data.split: {spec!r} has no split {split!r}; choose one of "
                            f"{', '.join(loaded)} with --data-split")
        held = next((loaded[s] for s in ("validation", "test") if s in loaded and s != split),
                    None)
        return loaded[split], held
    return loaded, None


def _csv_options(path: str, ext: str) -> dict:
    import csv

    from datasets import Features, Value

    sep = "\t" if ext == ".tsv" else ","
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            header = next(csv.reader(fh, delimiter=sep), None)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte {exc.start}); save the file as UTF-8") \
            from None
    if not header:
        raise DataError(f"{path}: file has no header row; the first line names the columns, "
                        "e.g. prompt,completion")
    if len(set(header)) != len(header):
        raise DataError(f"{path}: the header names a column twice ({header}); give each "
                        "column its own name")
    return {"sep": sep, "keep_default_na": False,
            "features": Features({c: Value("string") for c in header})}


def _load_hub(ds, repo: str, field: str):
    """A Hub dataset from the local cache only: the snapshot `hf download` left,
    else what an earlier ``load_dataset`` prepared."""
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(repo, repo_type="dataset", local_files_only=True)
    except Exception:   # not in the hub cache (or no hub cache at all)
        local = None
    if local is not None:
        return ds.load_dataset(local)
    try:
        return ds.load_dataset(repo)
    except Exception:
        raise DataError(f"{field}: {repo!r} is no file or directory here, nor a dataset in the "
                        "local Hugging Face cache, and lorasync downloads nothing while it "
                        f"runs; fetch it once with `hf download {repo} --repo-type dataset`, "
                        "or give a local file") from None


def read_rows(spec: str, field: str = "data.path", fmt: str = "auto",
              columns: dict | None = None, split: str = "train"
              ) -> tuple[list[dict], list[dict] | None]:
    """(validated rows, the held-out rows of a dataset with a validation or
    test split, else None) of any source ``--data`` takes."""
    ext = os.path.splitext(spec)[1].lower()
    # JSONL, and any other file that is not a table (read as JSONL, as lorasync always did:
    # its errors name the line)
    if ext in _JSONL or (os.path.isfile(spec) and ext not in _TABLES) or \
            (not os.path.exists(spec) and ext not in _TABLES and not _is_hub_id(spec)):
        return read_jsonl(spec, field, fmt, columns), None
    table, held = _load_table(spec, field, split)
    return _table_rows(table, spec, fmt, columns), \
        (_table_rows(held, spec, fmt, columns) if held is not None else None)


def _table_rows(table, spec: str, fmt: str, columns: dict | None) -> list[dict]:
    columns = columns or {}
    for field_, column in columns.items():
        if column not in table.column_names:
            raise DataError(f"{spec}: no column {column!r} (--data-columns maps "
                            f"{field_}={column}); its columns are "
                            f"{', '.join(table.column_names)}")
    if columns:
        drop = [c for c in columns if c in table.column_names and c not in columns.values()]
        table = table.remove_columns(drop).rename_columns(
            {c: f for f, c in columns.items() if c != f})
    if len(table) == 0:
        raise DataError(f"{spec}: no rows; add rows")
    # rows numbered from 1, after a CSV's header
    return [_normalize(r, f"{spec}: row {i}", fmt) for i, r in enumerate(table.to_list(), 1)]


class _Formatter:
    """Turns rows into token ids, with prompt tokens masked out of the loss.

    With a chat template (``tokenizer.chat_template``), a prompt is rendered as
    a user turn with the generation prompt, and conversations turn by turn so
    that only the assistant's tokens (its reply and the template's end of turn)
    carry labels.  Without one, the documented fallback: a prompt is followed
    by a newline, a conversation is written as ``role: content`` lines, and
    every completion and assistant turn ends with the EOS token, so that the
    model learns to stop."""

    def __init__(self, tok, seq_len: int):
        self.tok, self.seq_len = tok, seq_len
        self.chat = bool(getattr(tok, "chat_template", None))
        self.eos = tok.eos_token or ""
        self._known: dict[str, list[int]] = {}     # text -> ids (prefetch)
        self._rendered: dict[str, str] = {}        # prompt -> chat-rendered text
        self.truncated = 0      # examples longer than seq_len
        self.longest = 0        # tokens of the longest example, before truncation

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
        out = "".join(f"{m['role']}: {m['content']}"
                      + (self.eos if m["role"] == "assistant" else "") + "\n" for m in msgs)
        return out + ("assistant: " if add_generation_prompt else "")

    def prompt_text(self, prompt: str) -> str:
        if not self.chat:
            return prompt + "\n"
        text = self._rendered.get(prompt)
        if text is None:
            text = self._rendered[prompt] = self._render([{"role": "user", "content": prompt}],
                                                         True)
        return text

    def _cut(self, ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
        self.longest = max(self.longest, len(ids))
        if len(ids) > self.seq_len:
            self.truncated += 1
        return ids[: self.seq_len], labels[: self.seq_len]

    def encode(self, row: dict) -> Example:
        if "text" in row:
            ids = self._ids(row["text"] + self.eos)
            return Example(*self._cut(ids, list(ids)))
        if "prompt" in row:
            p = self._ids(self.prompt_text(row["prompt"]))
            c = self._ids(row["completion"] + self.eos)
            return Example(*self._cut(p + c, [IGNORE] * len(p) + c), p,
                           row["completion"].strip())
        # chat rows: loss on every assistant turn; exact-match on the last one
        msgs = row["messages"]
        ids: list[int] = []
        labels: list[int] = []
        prev = ""
        gen_prompt, answer = None, None
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                if i == 0:
                    raise DataError("the conversation starts with the assistant, so it has no "
                                    "prompt; start it with a user (or system) turn")
                try:
                    head = self._render(msgs[:i], True)
                    full = self._render(msgs[: i + 1], False)
                except Exception as exc:   # jinja's TemplateError, raise_exception(...)
                    raise DataError("the tokenizer's chat template refused this conversation "
                                    f"({' '.join(str(exc).split())[:200]}); make it fit the "
                                    "template (e.g. alternate user and assistant turns)") from None
                if not full.startswith(head) or not head.startswith(prev):
                    raise DataError("the tokenizer's chat template does not render "
                                    "conversations incrementally, so the assistant's tokens "
                                    "cannot be told apart; use prompt/completion rows")
                h = self._ids(head[len(prev):])
                body = self._ids(full[len(head):])
                ids += h + body
                labels += [IGNORE] * len(h) + body
                prev = full
                gen_prompt, answer = list(ids[: len(ids) - len(body)]), m["content"].strip()
        return Example(*self._cut(ids, labels), gen_prompt, answer)


def _trainable(e: Example) -> bool:
    return any(t != IGNORE for t in e.labels)


def encode_rows(rows: list[dict], tok, seq_len: int, stats: dict | None = None,
                field: str = "data.path") -> list[Example]:
    """Examples of ``rows``, less those that keep no trainable token within
    ``seq_len``; ``stats`` (if given) adds up rows, truncated, dropped and the
    longest example's tokens."""
    fmt = _Formatter(tok, seq_len)
    fmt.prefetch(rows)
    out = []
    for i, r in enumerate(rows, 1):
        try:
            out.append(fmt.encode(r))
        except DataError as exc:
            raise DataError(f"{field}: row {i}: {exc}") from None
    kept = [e for e in out if _trainable(e)]
    if stats is not None:
        stats["rows"] = stats.get("rows", 0) + len(rows)
        stats["truncated"] = stats.get("truncated", 0) + fmt.truncated
        stats["dropped"] = stats.get("dropped", 0) + len(out) - len(kept)
        stats["longest"] = max(stats.get("longest", 0), fmt.longest)
    return kept


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


def pack(examples: list[Example], seq_len: int) -> list[Example]:
    """Examples packed into sequences of at most ``seq_len`` tokens with TRL's
    best-fit-decreasing packer (whole examples, none split).

    Each packed example restarts its ``position_ids`` at 0: transformers reads
    the restarts as sequence boundaries and masks attention across them (a
    block-diagonal causal mask when no attention mask is given, see
    ``collate``).  The first token of each example gets no label, so the
    previous example's last token is never trained to predict it (unpacked,
    that label is never used either: the model shifts labels by one)."""
    try:
        from datasets import Dataset
        from trl import pack_dataset
    except ImportError:
        raise DataError("data.packing: --packing needs TRL and datasets: pip install "
                        "'lorasync[hf]'") from None
    _datasets()   # quiet: no progress bar per packing
    table = Dataset.from_dict({
        "input_ids": [e.input_ids for e in examples],
        "labels": [[IGNORE] + e.labels[1:] for e in examples]})
    packed = pack_dataset(table, seq_len, strategy="bfd")
    out = []
    for row in packed.to_list():
        pos = [p for n in row["seq_lengths"] for p in range(n)]
        out.append(Example(row["input_ids"], row["labels"], position_ids=pos))
    return out


def _warn_lengths(stats: dict, seq_len: int, what: str, warn) -> None:
    if warn is None or not (stats.get("truncated") or stats.get("dropped")):
        return
    msg = (f"data: {stats['truncated']} of {stats['rows']} {what} rows are longer than "
           f"seq_len={seq_len} tokens and were cut (the longest has {stats['longest']})")
    if stats["dropped"]:
        msg += (f"; {stats['dropped']} of them kept no trainable token (the prompt filled "
                "seq_len) and were left out")
    warn(msg + f"; raise --seq-len (e.g. {min(32768, _round_up(stats['longest']))}) "
               "to keep them whole")


def _round_up(n: int) -> int:
    p = 64
    while p < n:
        p *= 2
    return p


def load_datasets(data_cfg, tok, need: int | None = None, warn=None
                  ) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples for a DataConfig; DataError on bad input.

    ``need``: encode only until that many training examples are found (the
    launcher's check that the data fills a global batch; every row is still
    read and validated), and no eval examples.  ``warn``: called once with a
    line that counts the examples cut to seq_len and those left out (rank 0's
    log).  With ``data_cfg.packing`` the training examples are packed
    sequences (``pack``); evaluation stays one example per row."""
    cfg = data_cfg
    fmt, columns, split = (getattr(cfg, "format", "auto"), getattr(cfg, "columns", {}),
                           getattr(cfg, "split", "train"))
    if cfg.path == "demo":
        train_rows, eval_rows = demo_rows(cfg.demo_size, cfg.eval_size)
    else:
        if cfg.eval_path and os.path.exists(cfg.eval_path) and os.path.exists(cfg.path) \
                and os.path.samefile(cfg.eval_path, cfg.path):
            raise ConfigError("data.eval_path", cfg.eval_path,
                              "is the training file: evaluating on the rows the adapter trains "
                              "on measures nothing; give held-out data, or drop "
                              "--eval-data to hold out the last rows of --data")
        rows, held = read_rows(cfg.path, "data.path", fmt, columns, split)
        if cfg.eval_path:
            train_rows = rows
            eval_rows = read_rows(cfg.eval_path, "data.eval_path", fmt, columns,
                                  split)[0][: cfg.eval_size]
        elif held is not None:   # the dataset's own validation or test split
            train_rows, eval_rows = rows, held[: cfg.eval_size]
        else:
            # hold out the last rows, at most a fifth of the file
            n_eval = min(cfg.eval_size, len(rows) // 5)
            train_rows, eval_rows = rows[: len(rows) - n_eval], rows[len(rows) - n_eval:]
    check_only = need is not None
    stats: dict = {}
    if check_only and not cfg.packing:
        train = _first_examples(train_rows, tok, cfg.seq_len, max(1, need))
    else:
        train = encode_rows(train_rows, tok, cfg.seq_len, stats)
    if not train:
        raise DataError(f"data.path: no example of {cfg.path!r} keeps a trainable token "
                        f"within seq_len={cfg.seq_len}; raise --seq-len")
    _warn_lengths(stats, cfg.seq_len, "training", warn)
    if cfg.packing:
        if check_only and -(-sum(len(e.input_ids) for e in train) // cfg.seq_len) >= need:
            # packing makes at least tokens / seq_len rows: enough for sure, and the
            # launcher is spared importing TRL (seconds)
            return train, []
        train = pack(train, cfg.seq_len)
    if check_only:
        return train, []
    stats = {}
    evals = encode_rows(eval_rows, tok, cfg.seq_len, stats, "data.eval_path"
                        if cfg.eval_path else "data.path")
    _warn_lengths(stats, cfg.seq_len, "evaluation", warn)
    return train, evals


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
    """Right-padded tensors: input_ids, attention_mask, labels.

    Packed examples (``position_ids`` set) get position_ids instead of an
    attention mask: transformers then builds a causal mask that is also
    block-diagonal over the examples packed in a row.  Padding continues the
    positions of the row's last example, so it joins that block, after every
    real token (which therefore never sees it), with no labels.  The model must
    run without a KV cache (``use_cache=False``, as the trainer calls it):
    transformers builds that mask only then."""
    import torch

    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    packed = examples[0].position_ids is not None
    pos = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        k = len(e.input_ids)
        ids[i, :k] = torch.tensor(e.input_ids)
        labels[i, :k] = torch.tensor(e.labels)
        mask[i, :k] = 1
        if packed:
            pos[i, :k] = torch.tensor(e.position_ids)
            pos[i, k:] = torch.arange(1, width - k + 1) + (e.position_ids[-1] if k else -1)
    if packed:
        return {"input_ids": ids, "position_ids": pos, "labels": labels}
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def batch_tokens(examples: list[Example]) -> int:
    """Tokens of these examples, padding aside (what a step trained on)."""
    return sum(len(e.input_ids) for e in examples)
