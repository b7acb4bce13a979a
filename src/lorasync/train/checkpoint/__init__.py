"""Atomic, verified checkpoints of a run, and which one a restarted group resumes from.

* format.py: a checkpoint on disk (the ``checkpoint-N`` layout, atomic
  writes and fsync, verified state files, pruning, loading);
* resume.py: which checkpoint every rank agrees to resume from
  (``inventory``, ``choose``, ``ResumePlan``);
* component.py: the trainer's ``Checkpointer`` and its ``Progress``;
* adapter.py: the PEFT adapter other tools read (``export_adapter``) and
  ``--init-adapter``.
"""

from lorasync.train.checkpoint.adapter import (check_init_adapter, export_adapter,
                                               load_init_adapter)
from lorasync.train.checkpoint.component import (REPLICATED_SYNC_STATE, Checkpointer, Progress,
                                                 rng_state, seed_rngs, set_rng_state)
from lorasync.train.checkpoint.format import (SLOW_DISK_BPS, STATE_DIR, intact, latest,
                                              load_file, load_rank, read_meta, save, verified)
from lorasync.train.checkpoint.resume import ResumePlan, choose, inventory

__all__ = ["save", "latest", "load_rank", "load_file", "read_meta", "verified", "intact",
           "inventory", "choose", "ResumePlan", "Checkpointer", "Progress", "rng_state",
           "set_rng_state", "seed_rngs", "REPLICATED_SYNC_STATE", "export_adapter",
           "check_init_adapter", "load_init_adapter", "STATE_DIR", "SLOW_DISK_BPS"]
