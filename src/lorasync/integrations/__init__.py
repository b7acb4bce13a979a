"""lorasync inside training frameworks as they are, without changing their code.

* :mod:`lorasync.integrations.switch`: the environment switch.  With
  ``LORASYNC_STRATEGY=NAME`` set (options in ``LORASYNC_OPTIONS=k=v,...``),
  every Hugging Face ``Trainer`` (TRL's, LLaMA-Factory's and axolotl's are
  subclasses) that starts in that environment runs ``lorasync.hf.attach``
  before it prepares the model, on every rank.  A start-up hook file
  (``lorasync-switch.pth``, installed into site-packages with the package)
  loads it, and only when the variable is set.
* ``lorasync run`` (:mod:`lorasync.integrations.run_cli`): sets the switch's
  environment and execs a command (torchrun, accelerate launch,
  llamafactory-cli, trl, axolotl).
* :mod:`lorasync.integrations.axolotl`: axolotl's plugin,
  ``lorasync.integrations.axolotl.LorasyncPlugin`` (YAML keys
  ``lorasync_strategy``, ``lorasync_options``).

docs/integrations.md has each framework's recipe.
"""

__all__: list[str] = []
