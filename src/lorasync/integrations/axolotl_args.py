"""axolotl config keys of :class:`lorasync.integrations.axolotl.LorasyncPlugin`
(pydantic only, so that the keys can be checked without axolotl installed).

axolotl (0.19.0, ``axolotl/integrations/config.py``, ``merge_input_args``) mixes
a plugin's input-args model into its ``AxolotlInputConfig``; the validators
below therefore see the whole YAML and reject, at config validation, before
any model loads: an unknown strategy or option (attach's message), options
without a strategy, DeepSpeed or FSDP (sharded training: lorasync syncs the
adapter between DDP replicas), and a run without a LoRA adapter.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, Field, model_validator

__all__ = ["LorasyncArgs"]

#: axolotl's adapter values that give the model a PEFT LoRA adapter
LORA_ADAPTERS = ("lora", "qlora")


class LorasyncArgs(BaseModel):
    """Input args of the lorasync plugin."""

    lorasync_strategy: Optional[str] = Field(
        default=None,
        json_schema_extra={"description": "lorasync sync strategy: allreduce, fp16, bf16, int8, "
                           "onebit, topk, powersgd, local, diloco or auto; unset: no lorasync"})
    lorasync_options: Optional[dict[str, Any]] = Field(
        default=None,
        json_schema_extra={"description": "the strategy's options, e.g. {period: 8}; also "
                           "keep_token_average: true (keep the Trainer's token average)"})

    @model_validator(mode="before")
    @classmethod
    def check_lorasync(cls, data):
        if not isinstance(data, dict):
            return data
        strategy, options = data.get("lorasync_strategy"), data.get("lorasync_options")
        if not strategy:
            if options:
                raise ValueError("lorasync_options: set without lorasync_strategy; add "
                                 "lorasync_strategy: NAME (e.g. auto) or remove the options")
            return data
        if options is not None and not isinstance(options, dict):
            raise ValueError(f"lorasync_options: {options!r} is not a mapping; write it as "
                             "key: value lines, e.g. lorasync_options: {period: 8}")
        from lorasync.errors import LorasyncError
        from lorasync.integrations import switch

        opts = dict(options or {})
        keep = opts.pop("keep_token_average", False)
        if not isinstance(keep, bool):
            raise ValueError(f"lorasync_options.keep_token_average: {keep!r}: use true or false")
        try:
            switch.check(str(strategy), opts)
        except LorasyncError as exc:
            raise ValueError(f"lorasync_strategy: {exc}") from None
        for key, what in (("deepspeed", "DeepSpeed"), ("fsdp", "FSDP"), ("fsdp_config", "FSDP")):
            if data.get(key):
                raise ValueError(
                    f"lorasync_strategy: {what} is on ({key}); lorasync syncs the adapter between "
                    f"DDP replicas and does not work with sharded training: remove {key} (a LoRA "
                    "adapter fits on every device) or remove lorasync_strategy")
        if data.get("adapter") not in LORA_ADAPTERS:
            raise ValueError(
                f"lorasync_strategy: adapter is {data.get('adapter')!r}; lorasync syncs a LoRA "
                f"adapter only: set adapter: lora (or qlora) or remove lorasync_strategy")
        return data
