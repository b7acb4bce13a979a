"""Real clients of lorasync.hf, run by tests/dist/test_hf.py under torchrun or
accelerate launch (tiny model, generated data, gloo on CPU).

    python -m torch.distributed.run --nproc-per-node 2 _hf_clients.py JOB DUMP_DIR [ARGS]

JOB:
  sft SPEC...       examples/hf_sft.py's main() once per SPEC "NAME:STRATEGY[:KEY=VALUE,...]"
  trainer SPEC...   a plain transformers.Trainer + PEFT script once per SPEC
                    "NAME:STRATEGY[:opts]" (see job_trainer); env HF_RESUME
  accelerate        an accelerate loop with lorasync.hf.attach(accelerator, ...) and one
                    with lorasync.attach(accelerator.prepare(model), ...)
  exit SPEC...      the trainer job, then the script ends as users' scripts do: no barrier,
                    no destroy_process_group (tests/dist/test_hf_exits.py, bench/hf_exits.py)

Each run leaves DUMP_DIR/NAME/rank-R.pt: this rank's adapter, log history,
lorasync stats and per-step records (and, on a resume, the strategy state
right after lorasync loaded it).
"""

import functools
import importlib.util
import os
import sys
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
warnings.filterwarnings("ignore")

#: the exit job's runs, one per strategy (tests/dist/test_hf_exits.py, bench/hf_exits.py):
#: (id, "STRATEGY[:KEY=VALUE,...]")
EXIT_STRATEGIES = [
    ("allreduce", "allreduce"),
    ("fp16", "fp16"),
    ("bf16", "bf16"),
    ("int8", "int8"),
    ("onebit", "onebit:warmup_steps=2"),
    ("topk", "topk"),
    ("powersgd", "powersgd"),
    ("local", "local:period=2"),
    ("diloco", "diloco:period=2"),
    ("diloco-streaming", "diloco:period=2,streaming=true"),
    ("auto", "auto:probe=live,measure_steps=1,interval=2"),
]
#: the strategy the issue saw abort at exit
EXIT_AT_RISK = "diloco-streaming"


def exit_spec(name, strategy_opts, steps=6):
    """The exit job's spec NAME:STRATEGY:OPTS,steps=STEPS."""
    strategy, _, opts = strategy_opts.partition(":")
    return f"{name}:{strategy}:" + ",".join(o for o in (opts, f"steps={steps}") if o)


def exit_clean(returncode, output, ranks=2):
    """What is wrong with an exit job's run (empty: a clean exit): its exit code,
    lines of an abort or a traceback, lorasync's exit guard reporting trouble,
    a rank that did not reach the end."""
    bad = [] if returncode == 0 else [f"exit code {returncode}"]
    bad += [line.strip() for line in output.splitlines()
            if any(m in line for m in ("terminate called", "Fatal Python error", "Traceback",
                                       "SIGABRT", "lorasync: at exit"))]
    if output.count("trained, leaving") != ranks:
        bad.append(f"{output.count('trained, leaving')} of {ranks} ranks reached the end")
    return bad


def rank() -> int:
    import torch.distributed as dist

    # before the Trainer exists the process group may not be up yet
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def adapter_of(model):
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def dump(dump_dir, name, **data):
    d = os.path.join(dump_dir, name)
    os.makedirs(d, exist_ok=True)
    torch.save(data, os.path.join(d, f"rank-{rank()}.pt"))


def parse_spec(spec):
    from lorasync.config import parse_options

    name, strategy, *rest = spec.split(":", 2)
    opts = parse_options([kv for kv in rest[0].split(",") if kv]) if rest else {}
    return name, strategy, opts


def _grab_state_after_resume(handle):
    """A callback after lorasync's: the strategy state once lorasync loaded it."""
    from transformers import TrainerCallback

    class Grab(TrainerCallback):
        state = None

        def on_train_begin(self, args, state, control, **kw):
            if state.global_step > 0 and handle.sync is not None:
                Grab.state = handle.state_dict()

    return Grab


# --------------------------------------------------------------------------- TRL SFT (example)

def job_sft(dump_dir, specs):
    from trl import ModelConfig, SFTConfig

    spec = importlib.util.spec_from_file_location("hf_sft", os.path.join(ROOT, "examples",
                                                                          "hf_sft.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for s in specs:
        name, strategy, opts = parse_spec(s)
        demo = example.DemoArguments(dataset_size=400, lorasync_strategy=strategy,
                                     lorasync_option=[f"{k}={v}" for k, v in opts.items()])
        targs = SFTConfig(output_dir=os.path.join(dump_dir, name, "out"), max_steps=24,
                          per_device_train_batch_size=4, learning_rate=5e-3, max_length=64,
                          logging_steps=4, save_strategy="no", report_to=[], disable_tqdm=True,
                          seed=0, use_cpu=True)
        margs = ModelConfig(model_name_or_path="tiny", use_peft=True, lora_r=8, lora_alpha=16,
                            lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        trainer = example.main(demo, targs, margs)
        handle = next(cb.h for cb in trainer.callback_handler.callbacks if hasattr(cb, "h"))
        dump(dump_dir, name, adapter=adapter_of(trainer.model), log_history=trainer.state.log_history,
             stats=handle.stats(), records=handle.records, startup_bytes=handle.startup_bytes)


# --------------------------------------------------------------------------- plain Trainer

def _collator(tok):
    from lorasync.train.data import Example, collate

    def collate_fn(batch):
        return collate([Example(b["input_ids"], b["labels"]) for b in batch], tok.pad_token_id)
    return collate_fn


def job_trainer(dump_dir, specs, *, results=True):
    """Options of a spec besides the strategy's: ga (micro-batches per step),
    steps, save (checkpoint every N steps; with env HF_RESUME=DIR resume from
    DIR/NAME/out/checkpoint-N), perturb (rank 1 changes one frozen base weight first: a start-up
    broadcast would undo it), attach (false: plain Trainer DDP, no lorasync),
    keep_token_average (attach's);
    a NAME starting with "bad" expects attach/train to fail (message dumped).
    ``results=False`` dumps nothing after training (the exit job ends at once)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    import lorasync.hf
    from lorasync.train.data import demo_rows, encode_rows
    from lorasync.train.model import ModelSource, load_base

    resume = os.environ.get("HF_RESUME", "")
    for s in specs:
        name, strategy, opts = parse_spec(s)
        ga = int(opts.pop("ga", 1))
        save_steps = int(opts.pop("save", 0))
        max_steps = int(opts.pop("steps", 16))
        perturb = bool(opts.pop("perturb", False))
        use_lorasync = bool(opts.pop("attach", True))
        keep_avg = bool(opts.pop("keep_token_average", False))
        base, tok = load_base(ModelSource.resolve("tiny"))
        frozen = base.model.layers[0].mlp.up_proj.weight
        if perturb and rank() == 1:
            with torch.no_grad():
                frozen[0, 0] += 0.5
        torch.manual_seed(0)   # the same adapter init on every rank: no start-up broadcast
        model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                target_modules=["q_proj", "k_proj", "v_proj",
                                                                "o_proj"],
                                                task_type="CAUSAL_LM"))
        rows, _ = demo_rows(400, 0)
        train = [{"input_ids": e.input_ids, "labels": e.labels}
                 for e in encode_rows(rows, tok, 64)]
        out = os.path.join(dump_dir, name, "out")
        args = TrainingArguments(
            output_dir=out, max_steps=max_steps, per_device_train_batch_size=4,
            gradient_accumulation_steps=ga, learning_rate=5e-3, logging_steps=2,
            save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
            report_to=[], disable_tqdm=True, seed=0, use_cpu=True, remove_unused_columns=False,
            max_grad_norm=0.0 if strategy == "onebit" else 1.0)
        trainer = Trainer(model=model, args=args, train_dataset=train,
                          data_collator=_collator(tok))
        handle, grab = None, None
        try:
            if use_lorasync:
                handle = lorasync.hf.attach(trainer, strategy, keep_token_average=keep_avg,
                                            **opts)
                grab = _grab_state_after_resume(handle)
                trainer.add_callback(grab)
            ckpt = os.path.join(resume, name, "out", f"checkpoint-{save_steps}") if resume \
                else None
            trainer.train(resume_from_checkpoint=ckpt)
        except ValueError as e:
            if not name.startswith("bad"):
                raise
            dump(dump_dir, name, error=f"{type(e).__name__}: {e}")
            continue
        if not results:
            continue
        dump(dump_dir, name, adapter=adapter_of(trainer.model),
             frozen=frozen.detach().clone(), log_history=trainer.state.log_history,
             stats=handle.stats() if handle else None, records=handle.records if handle else [],
             startup_bytes=handle.startup_bytes if handle else None,
             token_average=trainer.args.average_tokens_across_devices,
             resumed_state=grab.state if grab else None,
             state_keys=sorted(handle.state_dict()) if handle and handle.sync else None)


# --------------------------------------------------------------------------- accelerate

def job_accelerate(dump_dir, specs):
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model

    import lorasync
    import lorasync.hf
    from lorasync.train.data import demo_rows, encode_rows
    from lorasync.train.model import ModelSource, load_base

    rows, _ = demo_rows(200, 0)
    for mode in ("helper", "prepared"):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)  # CPU: gloo
        base, tok = load_base(ModelSource.resolve("tiny"))
        torch.manual_seed(accelerator.process_index)   # different inits: rank 0's must win
        model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj",
                                                                                    "v_proj"],
                                                task_type="CAUSAL_LM"))
        exs = encode_rows(rows, tok, 64)
        data = [{"input_ids": e.input_ids, "labels": e.labels} for e in exs]
        loader = torch.utils.data.DataLoader(data, batch_size=4, collate_fn=_collator(tok))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                      lr=5e-3)
        if mode == "helper":
            sync = lorasync.hf.attach(accelerator, "int8")    # before prepare
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        else:
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            sync = lorasync.attach(model, "int8")
        losses = []
        for i, batch in enumerate(loader):
            if i == 16:
                break
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                if mode == "helper":
                    sync.after_step()   # does nothing on accumulation micro-steps
                elif accelerator.sync_gradients:
                    sync.after_step()
            losses.append(float(loss))
        sync.finish()
        inner = accelerator.unwrap_model(model)
        dump(dump_dir, mode, adapter=adapter_of(inner), stats=sync.stats(), losses=losses,
             startup_bytes=getattr(sync, "startup_bytes", None))

    # a Trainer under accelerate launch as well
    job_trainer(dump_dir, specs)


# --------------------------------------------------------------------------- bad input

def job_bad(dump_dir, specs):
    """Each bad input, on a real Trainer (one process; the test sets up a
    one-rank process group so that TrainingArguments accepts fsdp)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import lorasync.hf
    from lorasync.train.model import ModelSource, load_base

    def make(peft=True, **kw):
        base, tok = load_base(ModelSource.resolve("tiny"))
        model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"],
                                                task_type="CAUSAL_LM")) if peft else base
        args = TrainingArguments(output_dir=os.path.join(dump_dir, "bad-out"), max_steps=1,
                                 report_to=[], use_cpu=True, remove_unused_columns=False,
                                 disable_tqdm=True, per_device_train_batch_size=1, **kw)
        data = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}] * 4
        return Trainer(model=model, args=args, train_dataset=data,
                       data_collator=_collator(tok))

    out = {}

    def expect(case, fn):
        try:
            fn()
            out[case] = None
        except ValueError as e:
            out[case] = f"{type(e).__name__}: {e}"

    expect("unknown_strategy", lambda: lorasync.hf.attach(make(), "fastest"))
    expect("unknown_option", lambda: lorasync.hf.attach(make(), "int8", blocks=128))
    expect("no_peft", lambda: lorasync.hf.attach(make(peft=False), "int8"))
    expect("fsdp", lambda: lorasync.hf.attach(make(fsdp="full_shard"), "int8"))

    def deepspeed():
        # DeepSpeed is not installed here, so TrainingArguments cannot be built
        # with it: set the field the Trainer reads on a built one
        t = make()
        t.args.deepspeed = {"zero_optimization": {"stage": 2}}
        lorasync.hf.attach(t, "int8")
    expect("deepspeed", deepspeed)

    def while_training():
        t = make()

        class AttachLate(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                lorasync.hf.attach(t, "int8")
        t.add_callback(AttachLate())
        t.train()
    expect("while_training", while_training)

    def after_training():
        t = make()
        t.train()
        lorasync.hf.attach(t, "int8")
    expect("after_training", after_training)

    def twice():
        t = make()
        lorasync.hf.attach(t, "int8")
        lorasync.hf.attach(t, "int8")
    expect("twice", twice)
    expect("not_a_trainer", lambda: lorasync.hf.attach(object(), "int8"))
    os.makedirs(dump_dir, exist_ok=True)
    import json
    with open(os.path.join(dump_dir, "bad.json"), "w") as fh:
        json.dump(out, fh, indent=1)


def main():
    job, dump_dir, *specs = sys.argv[1:]
    torch.set_num_threads(1)
    {"sft": job_sft, "trainer": job_trainer, "accelerate": job_accelerate,
     "bad": job_bad, "exit": functools.partial(job_trainer, results=False)}[job](dump_dir, specs)
    if job == "exit":
        # like a user's script: the Trainer leaves the process group to the exit
        print(f"rank {rank()}: trained, leaving", flush=True)
        return
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
