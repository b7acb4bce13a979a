"""Evaluation of the adapter during and after training, and the run's ``evals.jsonl``.

``evaluate`` computes eval loss per token and exact-match of greedy
generations on the held-out examples, sharded over ranks (one 32-byte
all-reduce at the end).  ``Evaluator`` is the trainer's component: it owns
``RUN/evals.jsonl`` (rank 0 appends one record per evaluation) and hands each
record to the live sinks.

Between the outer syncs of local SGD and DiLoCo every rank holds its own
replica, and each evaluates its own on its share of the examples.  With
``mean_replicas`` (``--eval-mean``) the evaluation is of the replicas' mean
instead, what ``finish()`` would return if training stopped here (an outer
update still in flight is left out): the adapter is all-reduced in fp32,
evaluated, and each rank's own put back, so training goes on unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from lorasync.train.watchdog import Pace

__all__ = ["evaluate", "Evaluator"]


def evaluate(model, examples, tok, device, *, rank, world, max_new_tokens, batch=16,
             pace: Pace | None = None):
    """(eval loss per token, exact-match count, examples checked): sharded over ranks.

    ``pace`` (the watchdog) hears of every batch done and of the all-reduce at
    the end: a rank that stops making progress in an evaluation is named by
    the ranks waiting for it there."""
    import torch
    import torch.distributed as dist

    from lorasync.train.data import collate

    pace = pace or Pace()
    mine = examples[rank::world]
    was_training = model.training
    model.eval()
    loss_sum = tok_count = correct = checked = 0.0
    with torch.no_grad():
        for i in range(0, len(mine), batch):
            chunk = mine[i:i + batch]
            b = {k: v.to(device) for k, v in collate(chunk, tok.pad_token_id).items()}
            out = model(**b)
            # out.loss is a mean over the label tokens of the batch: weight it back
            n = int((b["labels"][:, 1:] != -100).sum())
            loss_sum += float(out.loss) * n
            tok_count += n
            gen = [e for e in chunk if e.gen_prompt_ids is not None]
            if not gen:
                pace.tick("batch")
                continue
            width = max(len(e.gen_prompt_ids) for e in gen)
            ids = torch.full((len(gen), width), tok.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, e in enumerate(gen):  # left padding for generation
                ids[j, width - len(e.gen_prompt_ids):] = torch.tensor(e.gen_prompt_ids)
                mask[j, width - len(e.gen_prompt_ids):] = 1
            outs = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                  max_new_tokens=max_new_tokens, do_sample=False,
                                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            for j, e in enumerate(gen):
                text = tok.decode(outs[j, width:], skip_special_tokens=True).strip()
                correct += float(text == e.answer)
                checked += 1
            pace.tick("batch")
    # on the model's device: NCCL reduces only GPU tensors (32 bytes, once per evaluation)
    t = torch.tensor([loss_sum, tok_count, correct, checked], dtype=torch.float64, device=device)
    with pace.waiting("the evaluation's all-reduce"):
        dist.all_reduce(t)
    if was_training:
        model.train()
    loss_sum, tok_count, correct, checked = t.tolist()
    return (loss_sum / tok_count if tok_count else float("nan")), int(correct), int(checked)


class Evaluator:
    """Evaluates the model on ``examples`` (a collective) and records the result.

    ``records`` are ``{"step", "eval_loss", "exact_match", "correct", "n",
    "time"}``; rank 0 appends them to ``RUN/evals.jsonl``.
    """

    def __init__(self, model, examples, tok, device, *, rank: int, world: int,
                 max_new_tokens: int, run_dir: str, sinks, sync=None,
                 mean_replicas: bool = False, pace: Pace | None = None):
        self.pace = pace or Pace()
        self.model, self.examples, self.tok, self.device = model, examples, tok, device
        self.rank, self.world, self.max_new_tokens = rank, world, max_new_tokens
        self.path = os.path.join(run_dir, "evals.jsonl")
        self.sinks = sinks
        # the sync strategy (a callable returning it): whether replicas differ now
        self.sync, self.mean_replicas = sync, mean_replicas

    @contextlib.contextmanager
    def _replicas_mean(self):
        """The mean of the ranks' adapters in place while evaluating, when
        asked for and they may differ (a collective: the answer is the same on
        every rank); yields whether it did."""
        sync = self.sync() if callable(self.sync) else self.sync
        if not (self.mean_replicas and self.world > 1 and sync is not None
                and sync.replicas_may_differ):
            yield False
            return
        import torch
        import torch.distributed as dist

        params = [p for p in self.model.parameters() if p.requires_grad]
        with torch.no_grad():
            own = [p.detach().clone() for p in params]
            flat = torch.cat([p.detach().reshape(-1).float() for p in params])
            with self.pace.waiting("the all-reduce of the replicas' mean"):
                dist.all_reduce(flat)
            flat.div_(self.world)
            off = 0
            for p in params:
                p.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()
        try:
            yield True
        finally:
            with torch.no_grad():
                for p, o in zip(params, own):
                    p.copy_(o)

    def forget_after(self, step: int) -> None:
        """On resume, rank 0 drops the evaluations after ``step``: they will run again."""
        if self.rank != 0:
            return
        from lorasync.monitor.metrics import read_jsonl_records

        kept = [r for r in read_jsonl_records(self.path) if r["step"] <= step]
        with open(self.path, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in kept)

    def __call__(self, step: int) -> dict:
        with self._replicas_mean() as mean:
            loss, correct, n = evaluate(self.model, self.examples, self.tok, self.device,
                                        rank=self.rank, world=self.world,
                                        max_new_tokens=self.max_new_tokens, pace=self.pace)
        rec = {"step": step, "eval_loss": loss, "exact_match": correct / n if n else None,
               "correct": correct, "n": n, "time": time.time()}
        if mean:
            rec["replicas"] = "mean"
        if self.rank == 0:
            self.pace.tick("record")
            with open(self.path, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            if self.sinks is not None:
                self.sinks.write(rec)
        return rec
