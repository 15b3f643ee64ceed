"""The README's Python API, end to end, on a tiny random Llama built offline (a few seconds on a CPU).

    python examples/quickstart.py

tests/test_examples.py runs it and checks that the README's API block is taken from it, so both stay true.
"""

import shutil
import tempfile

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from medusa_spec import MedusaConfig, MedusaModel

# Any decoder-only causal LM; a real one comes from AutoModelForCausalLM.from_pretrained(path).
config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
torch.manual_seed(0)
base = AutoModelForCausalLM.from_config(config).eval()
input_ids = torch.randint(3, 512, (1, 16))

heads_dir = tempfile.mkdtemp()   # any folder
mm = MedusaModel.from_base(base, MedusaConfig(num_heads=4, num_layers=1))
mm.save_heads(heads_dir)         # medusa_config.json + medusa_heads.safetensors (heads only)
mm = MedusaModel.from_pretrained(base, heads_dir)
shutil.rmtree(heads_dir)

out = mm.generate(input_ids, attention_mask=None, max_new_tokens=128,
                  do_sample=None, temperature=None, top_k=None, top_p=None,
                  eos_token_id=None, pad_token_id=None, tree=None, streamer=None)
out.sequences   # LongTensor [batch, prompt + new], prompt included, as transformers' generate
out.stats       # GenerationStats: steps, new_tokens (per row), row_steps, accepted_at_depth,
                # tokens_per_step (bonus token included), tokens_per_second, wall_time

# The same tokens as the base model's own greedy decoding; untrained heads rarely guess right (about one token
# per step): `medusa-spec train` makes heads that do.
expected = base.generate(input_ids, max_new_tokens=128, do_sample=False)
print(f"identical to transformers greedy: {torch.equal(out.sequences, expected)}; "
      f"{out.stats.tokens_per_step:.2f} tokens/step, {out.stats.steps} steps")
sampled = mm.generate(input_ids, max_new_tokens=32, do_sample=True, temperature=0.7, top_p=0.9)
print(f"sampled {sampled.sequences.shape[1] - input_ids.shape[1]} tokens at temperature 0.7, top-p 0.9")
if not torch.equal(out.sequences, expected):
    raise SystemExit("speculative greedy output differs from transformers' greedy output")
