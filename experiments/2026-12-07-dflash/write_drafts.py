"""Write two DFlash drafts with medusa_spec's save_dflash (a reduced and a full vocabulary) for the EAGLE-3 fixtures'
tiny verifier, and the blocks medusa_spec drafts with them, for read_with_speculators.py to compare with what
speculators 0.9.0 drafts after loading the folders itself.

Usage, from the repository root: .venv/bin/python experiments/2026-12-07-dflash/write_drafts.py OUT
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from medusa_spec.dflash import block_logits, context_features, new_dflash, save_dflash

VERIFIER = Path("tests/fixtures/eagle3/tiny-verifier").resolve()  # speculators loads the verifier by this name


def main(out: Path) -> None:
    base = AutoModelForCausalLM.from_pretrained(VERIFIER).eval()
    torch.manual_seed(3)
    for name, token_ids in (("reduced", torch.arange(5, 60)), ("full", None)):
        draft = new_dflash(base, 2, 4, [1, 2, 3], 5, token_ids, base_name=str(VERIFIER))
        with torch.no_grad():  # away from the initial weights, so that every tensor counts
            for param in draft.parameters():
                if param.requires_grad:
                    param.add_(0.3 * torch.randn_like(param))
        save_dflash(draft, out / name)
        text = torch.randint(3, 96, (1, 13), generator=torch.Generator().manual_seed(1))
        features = context_features(base, draft, text)
        logits = {a: block_logits(draft.eval(), features[:, :a], text[0, a: a + 1])[0].tolist() for a in range(1, 9)}
        (out / f"{name}.json").write_text(json.dumps({"text": text[0].tolist(), "logits": logits}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
