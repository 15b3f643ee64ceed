"""runs/eagle3-aux29's checkpoint STEP as an adapter folder OUT (the frozen lm_head and token map from stage 4)."""
import json
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

step, out = int(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
tensors = load_file("runs/eagle3-stage4/medusa_heads.safetensors")
trained = load_file(f"runs/eagle3-aux29/checkpoints/step-{step:08d}/model.safetensors")
for key, value in trained.items():
    tensors[key.removeprefix("heads.")] = value
save_file(tensors, out / "medusa_heads.safetensors")
config = json.load(open("runs/eagle3-stage4/medusa_config.json"))
config["feature_layers"] = [2, 15, 29]
config.pop("weights_sha256", None)
(out / "medusa_config.json").write_text(json.dumps(config, indent=2))
shutil.copy("runs/eagle3-stage4/trained_conversations.txt", out)
