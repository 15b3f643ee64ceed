# One-off: compiled eagle drafting against eager drafting, both beside the compiled verify pass, one process.
# Needs compiled_drafting.patch applied (git apply) on 44315ff's parent, 362833f. Usage: python drafting_ab.py N_PROMPTS
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import MedusaModel, default_model, propose
from medusa_spec.loop import StepTimer

path = default_model.prepare()
tok = AutoTokenizer.from_pretrained(path)
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
qs = [json.loads(line) for line in open("medusa_spec/data/mt_bench_question.jsonl")]
seen, prompts = set(), []
for q in qs:
    if q["category"] not in seen:
        seen.add(q["category"])
        prompts.append(q["turns"][0])
prompts = prompts[: int(sys.argv[1])]


def ids_of(p):
    ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
    return ids if torch.is_tensor(ids) else ids["input_ids"]


P = propose.DraftLayerProposer
compiled_draft, compiled_top = P.draft, P.top


def eager_draft(self, states, next_embeds, allowed, positions, cache, fuse=False):
    if fuse:
        states = self.heads.features(states)
    n = positions.shape[1]
    past = allowed.shape[-1] - n
    room = cache.layers[0].max_cache_len
    mask = torch.nn.functional.pad(allowed, (0, room - allowed.shape[-1]), value=False)[:, None]
    cache.layers[0].cumulative_length.fill_(past)
    return self.heads.draft_layer(states, next_embeds, mask, positions, cache)


def eager_top(self, *a, **k):
    c = self.compiled
    self.compiled = None
    try:
        return compiled_top(self, *a, **k)
    finally:
        self.compiled = c


t = time.perf_counter()
for tree in ([], None):
    mm.generate(ids_of(prompts[0]), max_new_tokens=128, tree=tree, compile=True)
print("warm-up s", round(time.perf_counter() - t), flush=True)
print("tree", mm._trees.compiled_trees, flush=True)
res = {}
for p in prompts:
    ids = ids_of(p)
    ref = None
    for name, kw, mode in (
        ("off", dict(tree=[]), None),
        ("heads-compiled-draft", dict(), "c"),
        ("heads-eager-draft", dict(), "e"),
    ):
        P.draft, P.top = (compiled_draft, compiled_top) if mode != "e" else (eager_draft, eager_top)
        timer = StepTimer()
        t = time.perf_counter()
        out = mm.generate(ids, max_new_tokens=128, compile=True, timer=timer, **kw)
        dt = time.perf_counter() - t
        new = out.sequences[0, ids.shape[1] :]
        ref = new if ref is None else ref
        r = res.setdefault(name, dict(secs=0, toks=0, steps=0, same=0, st={}))
        r["secs"] += dt
        r["toks"] += new.numel()
        r["steps"] += timer.steps
        r["same"] += int(torch.equal(new, ref))
        for k, v in timer.seconds.items():
            r["st"][k] = r["st"].get(k, 0) + v
for name, r in res.items():
    print(
        name,
        f"{r['toks'] / r['secs']:.1f} tok/s  tok/step {r['toks'] / r['steps']:.2f} same {r['same']}",
        {k: round(1000 * v / r["steps"], 1) for k, v in r["st"].items()},
        flush=True,
    )
