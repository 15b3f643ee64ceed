"""A training checkpoint as an adapter folder: stage 4's tensors (runs/eagle3-stage4) with those the checkpoint holds
(the trainable ones) in their place. Usage: python checkpoint_adapter.py RUN STEP OUT"""
import json
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

run, step, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
tensors = load_file("runs/eagle3-stage4/medusa_heads.safetensors")
trained = load_file(run / "checkpoints" / f"step-{step:08d}" / "model.safetensors")
for key, value in trained.items():
    tensors[key.removeprefix("heads.")] = value
print(f"{len(trained)} tensors from the checkpoint: {sorted(trained)}")
save_file(tensors, out / "medusa_heads.safetensors")
config = json.load(open("runs/eagle3-stage4/medusa_config.json"))
config.pop("weights_sha256", None)
(out / "medusa_config.json").write_text(json.dumps(config, indent=2))
shutil.copy("runs/eagle3-stage4/trained_conversations.txt", out)
