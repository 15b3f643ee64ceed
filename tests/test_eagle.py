"""Eagle heads (a draft layer with its own cache, drafting on its own outputs): the training unroll against
drafting one slot at a time, the proposer's tree and cache against a fresh start on the text, losslessness,
adapters, and training that learns what the draft layer's inputs decide."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from medusa_spec import MedusaConfig, MedusaModel, build_tree
from medusa_spec.context import unit_rms
from medusa_spec.eagle import DraftLayer
from medusa_spec.formats import convert
from medusa_spec.inputs import resolve_sampling
from medusa_spec.kv_cache import new_cache
from medusa_spec.lookup import with_lookup
from medusa_spec.loop import decode
from medusa_spec.propose import DraftLayerProposer, Prompt
from medusa_spec.slots import prefill
from medusa_spec.train.loop import train
from medusa_spec.train.module import causal_within_examples
from test_dependent_heads import (  # noqa: F401, F811 (fixtures)
    TREE,
    assert_round_trips,
    one_thread,
    pair_accuracy,
    pair_data,
    random_heads,
)
from test_generate import left_padded, prompt, reference_generate
from test_training import small_run
from tiny_models import tiny_model


def random_layer(hidden_size=16, seed=0) -> DraftLayer:
    layer = DraftLayer(hidden_size, {"num_attention_heads": 2, "intermediate_size": 24})
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return layer


def run_chain(layer, states, next_embeds, positions, steps):
    """Brute force: the true slots [n, H] as one causal pass into a new cache, then `steps` drafted slots one at
    a time, each the previous output with the next of `next_embeds` -> the outputs of the drafted chain, the
    last true slot's first."""
    n = states.shape[0]
    cache = DynamicCache()
    causal = torch.ones(1, 1, n, n, dtype=torch.bool).tril()
    out = layer(states[None], next_embeds[None, :n], causal, positions[None], cache)[0, -1]
    outputs = [out]
    for i in range(1, steps):
        mask = torch.ones(1, 1, 1, n + i, dtype=torch.bool)
        out = layer(out[None, None], next_embeds[None, n - 1 + i: n + i], mask, positions[None, -1:] + i, cache)[0, 0]
        outputs.append(out)
    return outputs


def test_the_training_unroll_is_drafting_one_slot_at_a_time():
    """Two examples packed in a row; at every position t and depth k the unrolled pass gives what drafting k
    slots down from t gives after the example's true slots up to t."""
    layer = random_layer()
    g = torch.Generator().manual_seed(1)
    states, next_embeds = torch.randn(1, 11, 16, generator=g), torch.randn(1, 11, 16, generator=g)
    segments = torch.tensor([[1] * 6 + [2] * 5])
    positions = torch.tensor([list(range(6)) + list(range(5))])
    with torch.no_grad():
        unrolled = layer.unroll(states, next_embeds, causal_within_examples(segments), positions, steps=3)
        padded = torch.cat([next_embeds[0], torch.zeros(3, 16)])  # tokens past the row's end are zeros
        for t in range(11):
            first = 0 if t < 6 else 6
            chain = run_chain(layer, states[0, first: t + 1], padded[first:], positions[0, first: t + 1], steps=3)
            for k in range(3):
                assert torch.allclose(unrolled[0, t, k], chain[k], atol=1e-5), (t, k)


def eagle_heads(model, seed=1, head_type="eagle", **config):
    """Random eagle heads, or eagle3 heads (EAGLE-3, test_eagle3.py), which draft through the same proposers."""
    own = {"share_lm_head": False} if head_type == "eagle3" else {}
    mm = random_heads(model, seed=seed, scale=0.3, head_type=head_type, **{"num_heads": 4, **own, **config})
    if head_type == "eagle3":  # its LM head the base's rows, as speculators starts it: drafts the base may accept
        mm.heads.init_projections_from(model.get_output_embeddings())
    return mm


def started(mm, input_ids, attention_mask, root, tree):
    """A DraftLayerProposer started after a prefill of input_ids, as the decoding loop starts it."""
    _, hidden, _ = prefill(mm.base_model, mm.spec, input_ids, attention_mask.bool(), new_cache(),
                           feature_layers=mm.heads.feature_layers)
    proposer = DraftLayerProposer(mm.base_model, mm.heads, tree)
    proposer.start(Prompt(input_ids, attention_mask.bool(), hidden, root, None))
    return proposer, hidden


@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
@pytest.mark.parametrize("draft_vocab_size", [None, 40])
def test_drafting_gives_each_node_the_layers_choice_after_its_own_path(draft_vocab_size, head_type):
    """A left-padded batch; the draft layer's output at every node's slot, and each node's token, against the
    layer run down the node's own path alone, row by row."""
    model = tiny_model("llama")
    mm = eagle_heads(model, draft_vocab_size=draft_vocab_size, head_type=head_type)
    tree = build_tree(TREE)
    ids, mask = left_padded([prompt(seed=2)[0, :9], prompt(seed=3)[0, :6]])
    root = torch.tensor([5, 17])
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    levels = []  # the outputs the heads read, level by level: [B, nodes of depth d, H] for d = 0, 1, ...
    draft_logits = mm.heads.draft_logits
    mm.heads.draft_logits = lambda k, outputs, lm_head: levels.append(outputs) or draft_logits(k, outputs, lm_head)
    with torch.no_grad():
        proposer, hidden = started(mm, ids, mask, root, tree)
        node_tokens = proposer.propose(root).node_tokens
        outputs = torch.cat(levels, dim=1)  # [B, N - deepest level, H], node order
        for b in range(2):
            real = mask[b].bool()
            text = torch.cat([ids[b, real], root[b: b + 1]])
            states = mm.heads.features(hidden[b, real])
            positions = torch.arange(len(states))
            tokens = {(): int(root[b])}

            def down(path):
                """The layer's outputs at the root's slot and then at each node of `path` (tokens known)."""
                path_tokens = torch.tensor([tokens[path[:d]] for d in range(1, len(path) + 1)], dtype=torch.long)
                next_embeds = embed(torch.cat([text[1:], path_tokens]))
                return run_chain(mm.heads.draft_layer, states, next_embeds, positions, len(path) + 1)

            for i, path in enumerate([(), *tree.choices]):
                if path:  # its token: the rank path[-1] guess from its parent's output
                    logits = mm.heads.draft_logits(len(path) - 1, down(path[:-1])[-1], lm_head)
                    tokens[path] = int(mm.heads.token_ids(logits.topk(path[-1] + 1).indices[path[-1]]))
                if i < outputs.shape[1]:  # nodes above the deepest level have a slot
                    assert torch.allclose(outputs[b, i], down(path)[-1], atol=1e-5), path
            assert node_tokens[b].tolist() == [tokens[()]] + [tokens[p] for p in tree.choices]
    if draft_vocab_size:
        assert torch.isin(node_tokens[:, 1:], mm.heads.token_map).all()


class Recording(DraftLayerProposer):
    """Keeps the root slot's output after the start and after every step, and each step's accept lengths, by each
    row's place in the batch it started as (a finished row leaves the batch)."""

    def start(self, prompt):
        super().start(prompt)
        self.rows = list(range(prompt.root.shape[0]))
        self.outputs, self.accepted = [self.by_row(self.root_output.clone())], []

    def by_row(self, values) -> dict:
        return dict(zip(self.rows, values))

    def update(self, step):
        super().update(step)
        self.outputs.append(self.by_row(self.root_output.clone()))
        self.accepted.append(self.by_row([a if active else -1
                                          for a, active in zip(step.host.accept_length, step.host.active)]))

    def keep_rows(self, rows):
        super().keep_rows(rows)
        self.rows = [self.rows[r] for r in rows.tolist()]


@pytest.mark.parametrize(("arch", "head_type"), [("llama", "eagle"), ("qwen3", "eagle"), ("llama", "eagle3")])
def test_after_every_step_the_cache_holds_what_a_fresh_start_on_the_text_gives(arch, head_type):
    """Rows of different lengths accept runs of different lengths (a lookup chain into the base's own greedy
    text, beside the layer's tree); after every step, each row's root output equals that of a proposer started
    on the row's text so far: the kept slots are the true ones, and the drafted ones are gone."""
    model = tiny_model(arch)
    mm = eagle_heads(model, head_type=head_type)
    rows = [prompt(seed=4)[0, :8], prompt(seed=5)[0, :5]]
    ids, mask = left_padded(rows)
    new = 24
    texts = [reference_generate(model, row[None], max_new_tokens=new, eos_token_id=None)[0] for row in rows]
    documents = [[text[len(row) + 6:].tolist()] for text, row in zip(texts, rows)]  # found from step ~6 on
    tree = mm.tree(TREE)
    recording = Recording(model, mm.heads, tree)
    proposer = with_lookup(recording, 4, [d for row in documents for d in row], mm.spec.vocab_size)
    out = decode(model, mm.spec, proposer, ids, mask.bool(), new, resolve_sampling(model, False, None, None, None),
                 [], 0)
    for b, row in enumerate(rows):
        assert torch.equal(out.sequences[b, ids.shape[1]:], texts[b][len(row):])
    assert max(max(a.values()) for a in recording.accepted) >= 3, "no long run accepted: commits would go untested"
    assert any(len(a) == 2 and min(a.values()) >= 0 and a[0] != a[1] for a in recording.accepted), \
        "no sync point: rows always kept alike"
    checked = 0
    with torch.no_grad():
        known = [len(row) + 1 for row in rows]  # tokens of each row's text so far: the prompt and the root
        for outputs, accepted in zip(recording.outputs, [*recording.accepted, None]):
            for b, text in enumerate(texts):
                if known[b] < len(text):  # a row that emitted its whole budget is finished: its slots stand still
                    fresh, _ = started(mm, text[None, : known[b] - 1], torch.ones(1, known[b] - 1, dtype=torch.long),
                                       text[known[b] - 1: known[b]], tree)
                    assert torch.allclose(outputs[b], fresh.root_output[0], atol=1e-4), (checked, b)
                    checked += 1
            if accepted is not None:
                known = [k + accepted.get(b, -1) + 1 for b, k in enumerate(known)]  # a row that left: -1
    assert checked > 8


def test_a_step_leaves_the_proposer_it_started_from_as_it_was():
    """--tree auto times steps from shallow copies of one started proposer: each must start where it started."""
    model = tiny_model("llama")
    mm = eagle_heads(model)
    ids = prompt(seed=6)
    root = torch.tensor([7])
    tree = mm.tree(TREE)
    with torch.no_grad():
        proposer, _ = started(mm, ids, torch.ones_like(ids), root, tree)
        candidates = proposer.propose(root)
        _, verified = prefill(model, mm.spec, torch.cat([ids, candidates.node_tokens], dim=1),
                              torch.ones(1, ids.shape[1] + tree.num_nodes, dtype=torch.bool), new_cache())[:2]
        from medusa_spec.autotree import deepest_step
        step = deepest_step(candidates, verified[:, ids.shape[1]:], root)
        drafts = []
        for _ in range(2):
            copied = copy.copy(proposer)
            copied.update(step)
            drafts.append(copied.propose(root).node_tokens)
    assert torch.equal(drafts[0], drafts[1])
    assert proposer.slots.cache.layers[0].keys.shape[2] == ids.shape[1] + sum(
        end - start for start, end in tree.level_bounds[1:-1])  # its own drafted slots, still there


def test_eagle_heads_round_trip_and_other_formats_refuse_them(tmp_path):
    model = tiny_model("llama")
    mm = eagle_heads(model, draft_vocab_size=30, feature_layers=[1])
    assert_round_trips(mm, tmp_path / "eagle", "draft_layer.layer.self_attn.q_proj.weight")
    config = json.loads((tmp_path / "eagle" / "medusa_config.json").read_text())
    assert config["head_type"] == "eagle"
    assert config["draft_layer"] == {"num_attention_heads": 4, "intermediate_size": 64}  # the tiny llama's
    for to in ("vllm", "medusa"):
        with pytest.raises(ValueError, match="eagle"):
            convert(tmp_path / "eagle", tmp_path / to, to=to, base_model=model)


def test_bad_eagle_settings_are_named(tmp_path):
    with pytest.raises(ValueError, match="draft_layer is for head_type 'eagle' and 'eagle3' only"):
        MedusaConfig(head_type="dependent", draft_layer={"num_attention_heads": 2, "intermediate_size": 8})
    with pytest.raises(ValueError, match="no context layer"):
        MedusaConfig(head_type="eagle", context_heads=2)
    with pytest.raises(ValueError, match="positive integers"):
        MedusaConfig(head_type="eagle", draft_layer={"num_attention_heads": 0, "intermediate_size": 8})
    with pytest.raises(ValueError, match="must divide hidden_size"):
        MedusaConfig(head_type="eagle", hidden_size=32, draft_layer={"num_attention_heads": 3, "intermediate_size": 8})
    model = tiny_model("llama")
    eagle_heads(model, num_heads=2).save_heads(tmp_path)
    path = tmp_path / "medusa_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "draft_layer": None, "weights_sha256": None}))
    with pytest.raises(ValueError, match="without draft_layer"):
        MedusaModel.from_pretrained(model, tmp_path)


def test_eagle_heads_learn_what_plain_heads_cannot(pair_data, tmp_path):  # noqa: F811
    """Pairs (a, PAIR[a]) with `a` random: the word after a pick is decided by the pick, which the draft layer
    reads as its slot's next token: head 0 as the root's, head 1 as the drafted slot's, on its own output."""
    base, data, tokenizer = pair_data
    train(small_run(base, data, tmp_path, head_type="eagle", num_heads=2, draft_vocab=20, max_steps=120, max_length=96,
                    eval_examples=4))
    accuracy = [pair_accuracy(tmp_path, base, tokenizer, head) for head in (0, 1)]
    assert min(accuracy) > 0.7, accuracy


def test_a_new_draft_layer_passes_the_state_through():
    """So new eagle heads start where new Medusa heads do: each slot's output guesses the token after its state."""
    layer = DraftLayer(16, {"num_attention_heads": 2, "intermediate_size": 24})
    g = torch.Generator().manual_seed(0)
    states, next_embeds = torch.randn(2, 5, 16, generator=g) * 3, torch.randn(2, 5, 16, generator=g)
    with torch.no_grad():
        out = layer.unroll(states, next_embeds, causal_within_examples(torch.ones(2, 5, dtype=torch.long)),
                           torch.arange(5).expand(2, -1), steps=2)
    assert torch.allclose(out[:, :, 0], unit_rms(states), atol=1e-4)
    assert torch.allclose(out[:, :, 1], unit_rms(states), atol=1e-4)  # and down the drafted path, the same state


def test_the_default_tree_is_timed_with_the_draft_layer_and_stays_lossless():
    """With measured accuracies auto_tree times the draft layer's steps on static trees (copies of one started
    proposer); tree=None takes a dynamic tree (test_dynamic_tree) and generates the base's greedy text."""
    model = tiny_model("llama")
    mm = eagle_heads(model, num_heads=2)
    mm.config.metrics = {"eval": {"rank_accuracy": [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1]]}}
    choices, table = mm.auto_tree(sizes=(1, 2, 4), repeats=1)
    assert all(row["draft_ms"] > 0 for row in table if row["nodes"] > 1), table
    ids = prompt(batch=2)
    expected = reference_generate(model, ids, max_new_tokens=16, eos_token_id=None)
    assert torch.equal(mm.generate(ids, max_new_tokens=16, eos_token_id=[]).sequences, expected)


def test_the_draft_layers_mlp_width_is_a_training_setting(pair_data, tmp_path):  # noqa: F811
    base, data, _ = pair_data
    train(small_run(base, data, tmp_path, head_type="eagle", num_heads=2, draft_layer_mlp=12, max_steps=2,
                    max_length=64, eval_examples=2))
    config = json.loads((tmp_path / "medusa_config.json").read_text())
    assert config["draft_layer"]["intermediate_size"] == 12
    with pytest.raises(ValueError, match="--draft-layer-mlp sets the width of eagle heads"):
        small_run(base, data, tmp_path, head_type="dependent", draft_layer_mlp=12)


def test_eagle_heads_grow_a_head_that_drafts_one_level_deeper(pair_data, tmp_path):  # noqa: F811
    """--init-heads with a larger --num-heads: the draft layer unrolls one more level, read by a copy of the last
    head's block; the saved heads' weights and guesses are kept, and head flags left out take theirs (the
    draft layer's width given alone is theirs, with no --head-type)."""
    base, data, _ = pair_data
    settings = dict(max_length=64, eval_examples=2, lr=0.0, max_steps=1)
    train(small_run(base, data, tmp_path / "first", head_type="eagle", num_heads=2, draft_layer_mlp=12,
                    **{**settings, "lr": 1e-2, "max_steps": 4}))
    first = str(tmp_path / "first")
    same = train(small_run(base, data, tmp_path / "same", init_heads=first, num_heads=None, **settings))
    grown = train(small_run(base, data, tmp_path / "grown", init_heads=first, num_heads=3, draft_layer_mlp=12,
                            **settings))
    assert grown["eval"]["rank_accuracy"][:2] == same["eval"]["rank_accuracy"]
    assert len(grown["eval"]["rank_accuracy"]) == 3
    saved = load_file(tmp_path / "first" / "medusa_heads.safetensors")
    kept = load_file(tmp_path / "grown" / "medusa_heads.safetensors")
    assert all(torch.equal(saved[k], kept[k]) for k in saved)
    assert set(kept) - set(saved) == {"blocks.2.layers.0.weight", "blocks.2.layers.0.bias"}
    assert all(torch.equal(kept[f"blocks.2.layers.0.{w}"], saved[f"blocks.1.layers.0.{w}"]) for w in ("weight", "bias"))
    config = json.loads((tmp_path / "grown" / "medusa_config.json").read_text())
    assert (config["num_heads"], config["head_type"], config["draft_layer"]["intermediate_size"]) == (3, "eagle", 12)
