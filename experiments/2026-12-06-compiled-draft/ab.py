# One-off: eagle heads' draft layer through compiled graphs (compiled.DraftGraphs) against the same passes eager, both
# on the compiled verify pass, the same priced DynamicTree, one process, the arms in turn per prompt; every output
# compared. The eager arm is the same code with the proposer's graphs left out. Usage: python ab.py [PROMPTS_PER_FILE]
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import medusa_spec
from medusa_spec import MedusaModel, autotree, default_model
from medusa_spec.bench import encode, read_eval_prompts
from medusa_spec.loop import StepTimer

DATA = Path(medusa_spec.__file__).parent / "data"
per_file = int(sys.argv[1]) if len(sys.argv) > 1 else 4
path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path)
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
prompts = []
for name in ("mt_bench_question.jsonl", "other_tasks_question.jsonl"):
    prompts += [encode(tokenizer, text) for _, text in read_eval_prompts(DATA / name, 1)][:per_file]
with_graphs = autotree.heads_proposer


def without_graphs(base_model, heads, tree, packs=None, graphs=None):
    return with_graphs(base_model, heads, tree, packs)


start = time.perf_counter()
mm.generate(prompts[0], max_new_tokens=32, tree=None, compile=True)  # compiles and prices
tree = mm._trees.compiled_trees[next(iter(mm._trees.compiled_trees))]
print(f"warm-up {time.perf_counter() - start:.0f} s; step ms {[round(x, 1) for x in tree.step_ms]}", flush=True)
arms = {"tree=[]": ([], with_graphs), "eager drafting": (tree, without_graphs),
        "compiled drafting": (tree, with_graphs)}
totals = {name: [0.0, 0, 0, StepTimer()] for name in arms}  # seconds, new tokens, steps, stages
same = 0
for i, ids in enumerate(prompts):
    names = list(arms)[i % 3:] + list(arms)[: i % 3]
    outputs, rates = {}, {}
    for name in names:
        tree_of, proposer_of = arms[name]
        autotree.heads_proposer = proposer_of
        start = time.perf_counter()
        out = mm.generate(ids, max_new_tokens=128, tree=tree_of, compile=True)
        seconds = time.perf_counter() - start
        autotree.heads_proposer = with_graphs
        outputs[name] = out.sequences
        rates[name] = (out.sequences.shape[1] - ids.shape[1]) / seconds
        totals[name][0] += seconds
        totals[name][1] += out.sequences.shape[1] - ids.shape[1]
        totals[name][2] += out.stats.steps
    same += all(torch.equal(outputs[name], outputs["tree=[]"]) for name in arms)
    print(f"prompt {i}: " + ", ".join(f"{name} {outputs[name].shape[1] - ids.shape[1]} tokens {rates[name]:.1f} tok/s"
                                      for name in arms), flush=True)
for name, (tree_of, proposer_of) in arms.items():  # where a step's time goes: the first prompt again, timed
    autotree.heads_proposer = proposer_of
    mm.generate(prompts[0], max_new_tokens=128, tree=tree_of, compile=True, timer=totals[name][3])
    autotree.heads_proposer = with_graphs
base_rate = totals["tree=[]"][1] / totals["tree=[]"][0]
for name, (seconds, tokens, steps, timer) in totals.items():
    print(f"{name}: {tokens / seconds:.1f} tok/s ({tokens / seconds / base_rate:.3f}x tree=[]), "
          f"{tokens / steps:.2f} tokens/step, {1000 * seconds / steps:.1f} ms/step; prompt 0 timed: "
          + ", ".join(f"{stage} {1000 * s / timer.steps:.1f}" for stage, s in timer.seconds.items()) + " ms/step")
print(f"outputs identical across arms: {same}/{len(prompts)}")
