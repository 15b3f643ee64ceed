"""`medusa-spec train --head-type eagle3` with new heads built under speculators' trainer defaults for eagle3
(norm_before_fc, norm_before_residual and norm_output true; its model config defaults them to false, which is what
medusa_spec trained the shipped EAGLE-3 heads with). Everything else as training/smollm2-135m-instruct/eagle3.sh.
Usage: python train_norms.py RUN [extra train flags]   (rerun with --resume to continue)
"""

import sys

from medusa_spec import eagle3
from medusa_spec.cli import main

plain = eagle3.default_spec


def trainer_defaults(*args, **kwargs):
    spec = plain(*args, **kwargs)
    return {**spec, "norm_before_fc": True, "norm_before_residual": True, "norm_output": True}


eagle3.default_spec = trainer_defaults  # this experiment's process only
run, extra = sys.argv[1], sys.argv[2:]
sys.exit(main([
    "train", "--data", "training/data/smollm2-135m-instruct", "--head-type", "eagle3", "--draft-vocab", "4096",
    "--num-heads", "3", "--max-length", "512", "--batch-size", "4", "--max-conversations", "6000",
    "--eval-examples", "40", "--eval-ranks", "8", "--max-steps", "560", "--lr", "1e-3",
    "--warmup-steps", "30", "--save-every", "25", "--log-every", "10", "--mixed-precision", "no",
    "--heads-target", "teacher", "--exclude", "training/smollm2-135m-instruct/held_out_run6.txt",
    "--output", run, *extra]))
