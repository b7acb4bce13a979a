"""axolotl plugin: lorasync in axolotl's trainer, from the YAML config.

    plugins:
      - lorasync.integrations.axolotl.LorasyncPlugin
    adapter: lora
    lorasync_strategy: diloco
    lorasync_options:
      period: 8

    axolotl train config.yaml            # or: accelerate launch -m axolotl.cli.train config.yaml

Written against axolotl 0.19.0 (``src/axolotl/integrations/base.py``): a
``BasePlugin`` subclass; ``get_input_args()`` names the pydantic model of the
YAML keys (:class:`~lorasync.integrations.axolotl_args.LorasyncArgs`, checked
when axolotl validates the config); ``post_trainer_create(cfg, trainer)``
runs on every rank once axolotl built its Trainer (``axolotl/train.py``),
before ``trainer.train()`` prepares the model: there ``lorasync.hf.attach``.

An error of attach at that point (a Trainer setting it refuses) ends the
process with the message on one line and exit code 2 on every rank.  The
environment switch (``LORASYNC_STRATEGY``) works with axolotl as well; when
both are set the plugin's settings win (the switch leaves an attached Trainer
alone).
"""

from __future__ import annotations

try:
    from axolotl.integrations.base import BasePlugin
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"lorasync.integrations.axolotl is axolotl's plugin and needs axolotl "
                      f"({_exc}); use it from an environment where axolotl is installed") from None

from lorasync.errors import LorasyncError

__all__ = ["LorasyncPlugin", "AXOLOTL_VERSION_READ"]

#: the axolotl version whose plugin interface this was written and tested against
AXOLOTL_VERSION_READ = "0.19.0"


class LorasyncPlugin(BasePlugin):
    """lorasync's sync strategy in axolotl's Trainer (module docstring)."""

    def get_input_args(self) -> str:
        return "lorasync.integrations.axolotl_args.LorasyncArgs"

    def post_trainer_create(self, cfg, trainer) -> None:
        strategy = cfg.get("lorasync_strategy") if hasattr(cfg, "get") else None
        if not strategy:
            return
        import lorasync.hf
        from lorasync.integrations.switch import _fail

        options = dict(cfg.get("lorasync_options") or {})
        keep = bool(options.pop("keep_token_average", False))
        try:
            self.handle = lorasync.hf.attach(trainer, strategy, keep_token_average=keep,
                                             **options)
        except LorasyncError as exc:
            _fail(f"{exc} (axolotl config: lorasync_strategy={strategy!r})")
