"""Training Medusa heads: self-distillation (distill), Medusa-1 / Medusa-2 training (loop), head
accuracy and tree calibration (evaluate). Commands: medusa-spec distill / train / tree."""

from .distill import DistillConfig, distill
from .evaluate import calibrate_tree
from .loop import TrainConfig, train

__all__ = ["DistillConfig", "TrainConfig", "calibrate_tree", "distill", "train"]
