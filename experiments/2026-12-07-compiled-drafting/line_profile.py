"""Line by line, where eager drafting goes (issue 57): line_profiler over the dynamic tree proposer's propose and update
(and DynamicSizing's), generate(tree=DynamicTree(8)) with the shipped eagle heads, eagerly, 3 MT-bench prompts, 128 new
tokens. Needs `pip install line_profiler`. Usage: python line_profile.py"""
from line_profiler import LineProfiler

from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, encode, read_eval_prompts
from medusa_spec.propose import DraftLayerProposer, DynamicDraftLayerProposer, DynamicSizing
from medusa_spec.train.load import load_model_and_tokenizer
from medusa_spec.tree import DynamicTree

base, tok = load_model_and_tokenizer(str(default_model.prepare()))
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
prompts = [encode(tok, t) for _, t in read_eval_prompts([str(MT_BENCH)], per_category=1)][:3]
lp = LineProfiler()
for f in (DynamicDraftLayerProposer.propose, DraftLayerProposer.update, DynamicSizing.update,
          DynamicDraftLayerProposer.complete, DynamicSizing.chosen_size):
    lp.add_function(f)
mm.generate(prompts[0], max_new_tokens=16, tree=DynamicTree(8))
lp.enable()
for ids in prompts:
    mm.generate(ids, max_new_tokens=128, tree=DynamicTree(8))
lp.disable()
lp.print_stats(output_unit=1e-3)
