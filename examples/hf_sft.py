"""LoRA fine-tuning with TRL's SFTTrainer, in the shape of TRL's own SFT example
(trl/scripts/sft.py), with lorasync syncing the adapter: one extra line.

Offline: the model is the embedded SmolLM2-135M-Instruct (or ``tiny``, or a
local model directory) and the data is lorasync's generated demo task
(addition, sorting, reversing words) as prompt/completion rows.

    # 2 processes on one machine
    torchrun --nproc-per-node 2 examples/hf_sft.py --output_dir runs/sft \\
        --use_peft --lora_r 8 --lora_alpha 16 --lora_target_modules q_proj k_proj v_proj o_proj \\
        --max_steps 60 --per_device_train_batch_size 4 --learning_rate 2e-3 --max_length 128 \\
        --lorasync_strategy auto

    # the same with accelerate
    accelerate launch --multi_gpu --num_processes 2 examples/hf_sft.py --output_dir runs/sft ...

    # two machines: run on each, NODE=0 on the first, 1 on the other
    torchrun --nnodes 2 --node-rank $NODE --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint FIRST_HOST:29400 examples/hf_sft.py --output_dir runs/sft ...

Strategy options: ``--lorasync_option KEY=VALUE [KEY=VALUE ...]``, e.g.
``--lorasync_strategy diloco --lorasync_option period=8 streaming=true``.
On a machine without GPUs add ``--use_cpu`` (DDP over gloo).
"""

from dataclasses import dataclass, field


@dataclass
class DemoArguments:
    dataset_size: int = field(default=2000, metadata={"help": "generated training rows"})
    lorasync_strategy: str = field(
        default="auto", metadata={"help": "allreduce, fp16, bf16, int8, onebit, topk, powersgd, "
                                          "local, diloco or auto"})
    lorasync_option: list[str] = field(
        default_factory=list, metadata={"help": "strategy options: KEY=VALUE [KEY=VALUE ...]"})


def main(demo_args, training_args, model_args):
    from datasets import Dataset
    from trl import SFTTrainer, get_peft_config

    import lorasync.hf
    from lorasync.config import parse_options
    from lorasync.train.data import demo_rows
    from lorasync.train.model import ModelSource, load_base

    # the embedded SmolLM2 (default), "tiny" (tests) or a local model directory
    source = ModelSource.resolve(model_args.model_name_or_path or "smollm2-135m")
    model, tokenizer = load_base(source)
    train_rows, eval_rows = demo_rows(demo_args.dataset_size, 32)

    trainer = SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=Dataset.from_list(train_rows),
        eval_dataset=Dataset.from_list(eval_rows) if training_args.eval_strategy != "no" else None,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    lorasync.hf.attach(trainer, demo_args.lorasync_strategy,
                       **parse_options(demo_args.lorasync_option))   # the one extra line

    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"adapter saved to {training_args.output_dir}")
    return trainer


if __name__ == "__main__":
    from trl import ModelConfig, SFTConfig, TrlParser

    parser = TrlParser((DemoArguments, SFTConfig, ModelConfig))
    demo_args, training_args, model_args = parser.parse_args_and_config()
    main(demo_args, training_args, model_args)
