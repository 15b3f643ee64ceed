"""Load write_drafts.py's folders with speculators 0.9.0 itself (DFlashDraftModel.from_pretrained) and compare the
blocks its training forward drafts at anchors 1-8 with medusa_spec's.

Usage, from the repository root, in the scratch venv of tests/fixtures/eagle3/make_fixtures.py:
    ~/specvenv/bin/python experiments/2026-12-07-dflash/read_with_speculators.py OUT
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from speculators.models.dflash import DFlashDraftModel  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

VERIFIER = Path("tests/fixtures/eagle3/tiny-verifier").resolve()


def main(out: Path) -> None:
    verifier = AutoModelForCausalLM.from_pretrained(VERIFIER).eval()
    for name in ("reduced", "full"):
        model = DFlashDraftModel.from_pretrained(out / name).eval()
        expected = json.loads((out / f"{name}.json").read_text())
        text = torch.tensor([expected["text"]])
        length = text.shape[1]
        with torch.no_grad():
            states = verifier(input_ids=text, output_hidden_states=True).hidden_states
            _, logits, _, _, _ = model._backbone_forward(
                hidden_states=torch.cat([states[i] for i in (1, 2, 3)], -1), input_ids=text,
                loss_mask=torch.ones(1, length, dtype=torch.long),
                verifier_last_hidden_states=torch.zeros(1, length, 32),
                document_ids=torch.zeros(1, length, dtype=torch.long), max_anchors=length - 4)
        logits = logits[0].unflatten(0, (length - 4, 4))
        worst = max((logits[a] - torch.tensor(expected["logits"][str(a)])).abs().max().item() for a in range(1, 9))
        print(f"{name}: block_size {model.config.block_size}, draft vocabulary {model.config.draft_vocab_size}, "
              f"largest difference of the block logits {worst:.2e}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
