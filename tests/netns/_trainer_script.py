"""A user's Trainer script in miniature: transformers.Trainer + PEFT LoRA on the
tiny random-weight model, gloo on CPU, optionally with lorasync.hf.attach.

    lorasync cluster launch --emulate nodes=2,rate=10mbit -- \\
        tests/netns/_trainer_script.py OUT [--strategy fp16|none] [--steps 8]

It ends as example scripts of transformers do: ``trainer.save_metrics("train",
...)`` and ``trainer.save_state()`` (OUT/trainer_state.json with the whole log
history, OUT/train_results.json), after one evaluation.  Every rank also writes
OUT/rank-R.json (world size, interface, a user variable) for the tests.

tests/netns/test_cluster_script.py runs it; the fixtures of
tests/unit/test_report_trainer.py were written by it (see that file).
"""

import argparse
import json
import os
import warnings

warnings.filterwarnings("ignore")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--strategy", default="none", help="lorasync strategy, or none: plain DDP")
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    from lorasync.train.data import Example, collate, demo_rows, encode_rows
    from lorasync.train.model import ModelSource, load_base

    base, tok = load_base(ModelSource.resolve("tiny"))
    torch.manual_seed(0)   # the same adapter on every rank
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                            target_modules=["q_proj", "k_proj", "v_proj",
                                                            "o_proj"], task_type="CAUSAL_LM"))
    rows, _ = demo_rows(400, 0)
    data = [{"input_ids": e.input_ids, "labels": e.labels} for e in encode_rows(rows, tok, 64)]

    def collate_fn(batch):
        return collate([Example(b["input_ids"], b["labels"]) for b in batch], tok.pad_token_id)

    args = TrainingArguments(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, learning_rate=5e-3, logging_steps=2, save_strategy="no",
        report_to=[], disable_tqdm=True, seed=0, use_cpu=True, remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=data[16:], eval_dataset=data[:16],
                      data_collator=collate_fn)
    if a.strategy != "none":
        import lorasync.hf

        lorasync.hf.attach(trainer, a.strategy)
    result = trainer.train()
    trainer.evaluate()
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    rank = trainer.args.process_index
    with open(os.path.join(a.out, f"rank-{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "world": trainer.args.world_size,
                   "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
                   "user_var": os.environ.get("LSYNC_TEST_VAR"),
                   "steps": trainer.state.global_step}, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
