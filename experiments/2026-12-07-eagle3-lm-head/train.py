"""The EAGLE-3 heads' fifth stage again (../2026-12-07-eagle3-stage5/: eagle3-continue2.sh from runs/eagle3-stage4,
the same conversations in the same order, the same held-out ones) with one change: the draft's LM head (4,096 rows
over [576]) trains with the rest, where speculators freezes it (its model.py) and `medusa-spec train` follows it. The
folder's format is unchanged (vLLM reads lm_head.weight whatever trained it). A one-off patch, not a library option:
nn.Module.requires_grad_(False) leaves the draft's LM head trainable in this process.
Usage: python experiments/2026-12-07-eagle3-lm-head/train.py RUN MINUTES   # from the repository root; again to resume
"""

import sys
from pathlib import Path

from torch import nn

from medusa_spec import eagle3
from medusa_spec.cli import main

run, minutes = sys.argv[1], sys.argv[2]
init = eagle3.Eagle3Draft.__init__
freeze = nn.Module.requires_grad_


def init_marked(self, *args, **kwargs):
    init(self, *args, **kwargs)
    vars(self.lm_head)["keep_trainable"] = True


def requires_grad_(self, requires_grad: bool = True):
    if not requires_grad and vars(self).get("keep_trainable"):
        return self
    return freeze(self, requires_grad)


eagle3.Eagle3Draft.__init__ = init_marked
nn.Module.requires_grad_ = requires_grad_
main(["train", "--data", "training/data/smollm2-135m-instruct", "--init-heads", "runs/eagle3-stage4",
      "--exclude", "runs/eagle3-stage4/trained_conversations.txt", "training/smollm2-135m-instruct/held_out_run6.txt",
      "--max-length", "512", "--batch-size", "4", "--max-conversations", "8000", "--eval-examples", "40",
      "--eval-ranks", "8", "--max-steps", "1100", "--time-limit", minutes, "--lr", "5e-4", "--warmup-steps", "20",
      "--save-every", "25", "--log-every", "10", "--mixed-precision", "no", "--heads-target", "teacher",
      "--output", run, *(["--resume"] if (Path(run) / "checkpoints").is_dir() else [])])
