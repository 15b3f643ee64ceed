"""Training Medusa heads: self-distillation (distill), Medusa-1 / Medusa-2 training (config, module, loop), head
accuracy and tree calibration (evaluate). Commands: medusa-spec distill / train / tree."""

from .config import TrainConfig
from .dflash_loop import train_dflash
from .distill import DistillConfig, distill
from .evaluate import calibrate_tree
from .loop import train

__all__ = ["DistillConfig", "TrainConfig", "calibrate_tree", "distill", "train", "train_dflash"]
