"""Dependent (Hydra-style) heads and the reduced draft vocabulary: drafting, losslessness,
adapters, and training that beats plain Medusa heads where the next token decides the one after."""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch import nn

from medusa_spec import MedusaConfig, MedusaModel, build_tree
from medusa_spec.formats import convert, read_heads
from medusa_spec.propose import draft_with_heads
from medusa_spec.train.data import Example
from medusa_spec.train.draft_vocab import answer_token_counts, coverage, draft_index, frequent_tokens
from medusa_spec.train.loop import train
from test_generate import prompt, reference_generate
from test_sampling import NEW, ROWS, SETTINGS, chi_square_p_value, exact_joint
from test_sampling import TREE as SAMPLING_TREE
from test_training import WORDS, make_tokenizer, small_run, tiny_llama
from tiny_models import ARCHITECTURES, VOCAB, tiny_model

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_heads(model, seed=1, scale=0.5, **config):
    own = {"share_lm_head": False} if config.get("head_type") == "eagle3" else {}  # eagle3's draft owns its LM head
    mm = MedusaModel.from_base(model, MedusaConfig(**{"num_heads": 4, **own, **config}))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in mm.heads.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
    if mm.config.draft_vocab_size:
        token_map = torch.randperm(VOCAB, generator=generator)[: mm.config.draft_vocab_size]
        mm.heads.set_token_map(token_map, model.get_output_embeddings())
    return mm


# --- drafting -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("draft_vocab_size", [None, 40])
def test_dependent_drafting_gives_each_node_its_heads_choice_after_its_own_path(draft_vocab_size):
    model = tiny_model("llama")
    mm = random_heads(model, head_type="dependent", draft_vocab_size=draft_vocab_size)
    tree = build_tree(TREE)
    hidden, root = torch.randn(2, 32), torch.tensor([5, 17])
    with torch.no_grad():
        node_tokens = draft_with_heads(mm.heads, model, root, hidden, tree)
        embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        for b in range(2):
            tokens = {(): int(root[b])}
            for path in tree.choices:  # brute force, node by node, from the root's path down
                parent = path[:-1]
                path_tokens = torch.tensor([tokens[parent[:d]] for d in range(len(parent) + 1)])
                logits = mm.heads.head_logits(len(path) - 1, hidden[b], embed(path_tokens), lm_head)
                tokens[path] = int(mm.heads.token_ids(logits.topk(path[-1] + 1).indices[path[-1]]))
            expected = [tokens[()]] + [tokens[p] for p in tree.choices]
            assert node_tokens[b].tolist() == expected
    if draft_vocab_size:
        assert torch.isin(node_tokens[:, 1:], mm.heads.token_map).all()


def test_medusa_heads_with_a_token_map_propose_only_draft_tokens():
    model = tiny_model("llama")
    mm = random_heads(model, draft_vocab_size=10)
    with torch.no_grad():
        node_tokens = draft_with_heads(mm.heads, model, torch.tensor([3]), torch.randn(1, 32), build_tree(TREE))
    assert torch.isin(node_tokens[:, 1:], mm.heads.token_map).all()


class DependentOracle(nn.Module):
    """Test double for dependent heads that knows the greedy continuation: it finds the reference
    position of a hidden state and reads the path tokens back from their embeddings; it proposes the
    right next token only when the path it was given is the reference's (so wrongly wired paths
    would show up as lost acceptance), and a wrong token at rank 1."""

    dependent = True

    def __init__(self, model, sequence):
        super().__init__()
        with torch.no_grad():
            self.hidden = model(sequence[None], output_hidden_states=True).hidden_states[-1][0]
        self.sequence, self.embedding = sequence.tolist(), model.get_input_embeddings().weight

    def token_ids(self, draft_indices):
        return draft_indices

    def head_logits(self, k, states, path_embeds, lm_head):
        logits = torch.zeros(*states.shape[:-1], VOCAB)
        for index in torch.cartesian_prod(*[torch.arange(n) for n in states.shape[:-1]]).view(-1, states.dim() - 1):
            index = tuple(index.tolist())
            j = int((self.hidden - states[index]).norm(dim=-1).argmin())
            path = torch.cdist(path_embeds[index], self.embedding).argmin(-1).tolist()
            ahead = self.sequence[j + 1: j + k + 3]
            right = len(ahead) == k + 2 and path == ahead[:-1]
            token = ahead[-1] if right else (self.sequence[min(j + 1, len(self.sequence) - 1)] + 7) % VOCAB
            logits[index + (token,)] = 10.0
            logits[index + ((token + 1) % VOCAB,)] = 5.0
        return logits


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_greedy_identity_with_dependent_heads_that_draft_long_runs(arch):
    model = tiny_model(arch)
    ids = prompt(seed=1)
    expected = reference_generate(model, ids, max_new_tokens=40, eos_token_id=None)
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=4, head_type="dependent"))
    mm.heads = DependentOracle(model, expected[0])
    out = mm.generate(ids, max_new_tokens=40, eos_token_id=[], tree=TREE)
    assert torch.equal(out.sequences, expected)
    assert out.stats.tokens_per_step > 3.0, out.stats  # depth-4 paths drafted level by level were accepted
    assert out.stats.accepted_at_depth[3] > 0


@pytest.mark.parametrize("arch", ARCHITECTURES)
# Eagle heads take no context layer: their draft layer attends over the text itself.
@pytest.mark.parametrize(("head_type", "context_heads"), [("medusa", 0), ("medusa", 2), ("dependent", 0),
                                                          ("dependent", 2), ("eagle", 0), ("eagle3", 0)],
                         ids=["medusa", "medusa-context", "dependent", "dependent-context", "eagle", "eagle3"])
@pytest.mark.parametrize("feature_layers", [[], [0, 1]], ids=["", "fused"])
def test_greedy_identity_with_random_heads_and_a_reduced_vocabulary(arch, head_type, context_heads, feature_layers):
    model = tiny_model(arch)
    ids = prompt(batch=2)
    expected = reference_generate(model, ids, max_new_tokens=20, eos_token_id=None)
    mm = random_heads(model, head_type=head_type, draft_vocab_size=24, context_heads=context_heads,
                      feature_layers=feature_layers, scale=0.1)
    assert torch.equal(mm.generate(ids, max_new_tokens=20, eos_token_id=[], tree=TREE).sequences, expected)
    if feature_layers:  # and with a lookup chain in the same pass
        assert torch.equal(mm.generate(ids, max_new_tokens=20, eos_token_id=[], tree=TREE, lookup_tokens=3).sequences,
                           expected)


@pytest.mark.parametrize("head_type", ["dependent", "eagle", "eagle3"])
@pytest.mark.parametrize("sampling", SETTINGS[1:4], ids=str)
def test_sampling_with_dependent_heads_and_a_reduced_vocabulary_matches_the_base(sampling, head_type):
    model = tiny_model("llama", vocab_size=6)
    ids = torch.tensor([[3, 5, 4, 1]])
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2, head_type=head_type, draft_vocab_size=4,
                                                   share_lm_head=head_type != "eagle3"))
    mm.heads.set_token_map(torch.tensor([4, 1, 0, 3]), model.get_output_embeddings())
    assert_samples_follow_the_base(mm, ids, sampling)


def assert_samples_follow_the_base(mm, ids, sampling, tree=SAMPLING_TREE):
    """The first three sampled tokens of ROWS rows (a 6-token vocabulary) against their exact joint law."""
    torch.manual_seed(0)
    out = mm.generate(ids.expand(ROWS, -1), max_new_tokens=NEW, do_sample=True, temperature=sampling.temperature,
                      top_k=sampling.top_k, top_p=sampling.top_p, eos_token_id=[], tree=tree)
    new = out.sequences[:, ids.shape[1]:]
    counts = torch.bincount(new[:, 0] * 36 + new[:, 1] * 6 + new[:, 2], minlength=216).double()
    assert out.stats.accepted_at_depth[1] > ROWS // 20, "too little acceptance to test the tree path"
    assert chi_square_p_value(counts, exact_joint(mm.base_model, ids, sampling)) > 1e-3


# --- adapters -----------------------------------------------------------------------------------------------------

def assert_round_trips(mm, path, weight_name: str):
    """mm's heads saved to `path` load onto a fresh tiny llama with every tensor (`weight_name` among them) equal,
    and generate the same tokens."""
    mm.save_heads(path)
    loaded = MedusaModel.from_pretrained(tiny_model("llama"), path)
    state, loaded_state = mm.heads.state_dict(), loaded.heads.state_dict()
    assert state.keys() == loaded_state.keys() and weight_name in state
    assert all(torch.equal(state[k], loaded_state[k]) for k in state)
    ids = prompt()
    assert torch.equal(mm.generate(ids, max_new_tokens=12, tree=TREE).sequences,
                       loaded.generate(ids, max_new_tokens=12, tree=TREE).sequences)


@pytest.mark.parametrize("share_lm_head", [True, False])
def test_dependent_heads_with_a_token_map_round_trip(tmp_path, share_lm_head):
    model = tiny_model("llama")
    mm = random_heads(model, head_type="dependent", draft_vocab_size=30, share_lm_head=share_lm_head, scale=0.1)
    mm.save_heads(tmp_path)
    config = json.loads((tmp_path / "medusa_config.json").read_text())
    assert (config["head_type"], config["draft_vocab_size"]) == ("dependent", 30)
    loaded = MedusaModel.from_pretrained(tiny_model("llama"), tmp_path)
    state, loaded_state = mm.heads.state_dict(), loaded.heads.state_dict()
    assert state.keys() == loaded_state.keys() and "token_map" in state and "inputs.3.weight" in state
    assert all(torch.equal(state[k], loaded_state[k]) for k in state)
    ids = prompt()
    assert torch.equal(mm.generate(ids, max_new_tokens=12, tree=TREE).sequences,
                       loaded.generate(ids, max_new_tokens=12, tree=TREE).sequences)


@pytest.mark.parametrize("share_lm_head", [True, False])
def test_token_map_exports_to_vllm_as_truncated_vocabulary(tmp_path, share_lm_head):
    model = tiny_model("llama")
    mm = random_heads(model, num_heads=2, draft_vocab_size=30, share_lm_head=share_lm_head)
    mm.save_heads(tmp_path / "own")
    convert(tmp_path / "own", tmp_path / "vllm", to="vllm", base_model=model)
    meta = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert (meta["vocab_size"], meta["truncated_vocab_size"]) == (VOCAB, 30)
    config, state_dict = read_heads(tmp_path / "vllm", model.get_output_embeddings())
    assert (config.draft_vocab_size, config.vocab_size, config.share_lm_head) == (30, VOCAB, share_lm_head)
    assert torch.equal(state_dict["token_map"], mm.heads.token_map)
    convert(tmp_path / "vllm", tmp_path / "back", to="medusa_spec", base_model=model)
    back = MedusaModel.from_pretrained(model, tmp_path / "back")
    ids = prompt()
    assert torch.equal(mm.generate(ids, max_new_tokens=12, tree=TREE[:3]).sequences,
                       back.generate(ids, max_new_tokens=12, tree=TREE[:3]).sequences)
    assert torch.equal(back.heads.token_map, mm.heads.token_map)


def test_formats_without_dependent_heads_or_token_maps_refuse_them(tmp_path):
    model = tiny_model("llama")
    random_heads(model, num_heads=2, head_type="dependent").save_heads(tmp_path / "dep")
    with pytest.raises(ValueError,
                       match="holds plain Medusa heads only, not dependent heads; keep them in medusa_spec"):
        convert(tmp_path / "dep", tmp_path / "vllm", to="vllm", base_model=model)
    random_heads(model, num_heads=2, draft_vocab_size=10).save_heads(tmp_path / "map")
    with pytest.raises(ValueError, match=r"has no reduced draft vocabulary \(token_map\); export with --to vllm"):
        convert(tmp_path / "map", tmp_path / "medusa", to="medusa")


def test_bad_head_types_and_token_maps_are_named():
    with pytest.raises(ValueError, match="head_type must be one of medusa, dependent, eagle, eagle3, got 'hydra'"):
        MedusaConfig(head_type="hydra")
    with pytest.raises(ValueError, match=r"draft_vocab_size \(200\) exceeds vocab_size \(96\)"):
        MedusaConfig(vocab_size=96, draft_vocab_size=200)
    mm = random_heads(tiny_model("llama"), num_heads=2, draft_vocab_size=10)
    with pytest.raises(ValueError, match=r"token_map must hold 10 token ids"):
        mm.heads.set_token_map(torch.arange(5), mm.base_model.get_output_embeddings())


def test_out_of_range_token_map_is_refused_on_load(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_model("llama")
    random_heads(model, num_heads=2, draft_vocab_size=10).save_heads(tmp_path)
    config = json.loads((tmp_path / "medusa_config.json").read_text())
    del config["weights_sha256"]  # as saved before checksums, which would catch the edits below first
    (tmp_path / "medusa_config.json").write_text(json.dumps(config))
    weights = load_file(tmp_path / "medusa_heads.safetensors")
    weights["token_map"][0] = VOCAB + 5
    save_file(weights, tmp_path / "medusa_heads.safetensors")
    with pytest.raises(ValueError, match=r"token_map holds ids outside the base vocabulary \[0, 96\)"):
        MedusaModel.from_pretrained(model, tmp_path)
    weights["token_map"][0] = weights["token_map"][1]
    save_file(weights, tmp_path / "medusa_heads.safetensors")
    with pytest.raises(ValueError, match="token_map repeats token ids"):
        MedusaModel.from_pretrained(model, tmp_path)


# --- the draft vocabulary -------------------------------------------------------------------------------------------

def test_draft_vocabulary_takes_the_most_frequent_answer_tokens():
    rows = [[Example([1, 5, 5, 7, 7, 7, 2], [False, True, True, True, True, True, False])],
            [Example([7, 9], [True, True])]]
    counts = answer_token_counts(rows, vocab_size=12)
    assert counts.tolist() == [0, 0, 0, 0, 0, 2, 0, 4, 0, 1, 0, 0]  # prompt tokens 1 and 2 are not counted
    token_map = frequent_tokens(counts, 3)
    assert token_map.tolist() == [7, 5, 9]
    assert coverage(counts, [1, 2, 3]) == {1: round(4 / 7, 4), 2: round(6 / 7, 4), 3: 1.0}
    assert draft_index(token_map, 12)[[7, 5, 9, 1]].tolist() == [0, 1, 2, -1]
    with pytest.raises(ValueError, match="--draft-vocab must be between 1 and the vocabulary size 12, got 13"):
        frequent_tokens(counts, 13)


# --- training -------------------------------------------------------------------------------------------------------

PAIR = {a: (a * 7 + 3) % WORDS for a in range(WORDS)}  # the word that always follows a "pick"


@pytest.fixture(scope="module")
def pair_data(tmp_path_factory):
    """Answers made of pairs (a, PAIR[a]) with `a` random: the token after a pick is fixed by the pick,
    which a head that cannot see the pick has no way to know."""
    tokenizer = make_tokenizer()
    model = tiny_llama(tokenizer)
    base = tmp_path_factory.mktemp("pair-base")
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    rng = random.Random(0)
    lines = []
    for i in range(120):
        picks = [rng.randrange(WORDS) for _ in range(8)]
        answer = " ".join(f"w{a} w{PAIR[a]}" for a in picks)
        lines.append(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": "count from w1"},
                                                             {"role": "assistant", "content": answer}]}))
    data = tmp_path_factory.mktemp("pair-data") / "pairs.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return base, data, tokenizer


def head0_accuracy(adapter, base, tokenizer, answers: list[str], positions, head: int = 0) -> float:
    """Head 0's (or `head`'s) top-1 accuracy on the data's own path (teacher forced) over `answers`, each the reply
    to "count from w1": at each t in positions(start), start being the answer's first token, its guess
    for the token at t + 2 (+ head)."""
    from medusa_spec.train.load import load_model_and_tokenizer
    from medusa_spec.train.module import TrainModule

    base_model, _ = load_model_and_tokenizer(base)
    mm = MedusaModel.from_pretrained(base_model, adapter)
    module = TrainModule(base_model, mm.heads, mm.spec.bool_mask, mm.spec.takes_logits_to_keep)
    user = {"role": "user", "content": "count from w1"}
    start = len(tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=True, return_dict=False))
    hits = total = 0
    for text in answers:
        answer = {"role": "assistant", "content": text}
        ids = torch.tensor([tokenizer.apply_chat_template([user, answer], tokenize=True, return_dict=False)])
        with torch.no_grad():
            out = module(ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids))
        head_logits = mm.heads.project(out.head_states, base_model.get_output_embeddings())
        guesses = mm.heads.token_ids(head_logits[0, :, head].argmax(-1))
        for t in positions(start):
            hits += int(guesses[t] == ids[0, t + 2 + head])
            total += 1
    return hits / total


def pair_accuracy(adapter, base, tokenizer, head: int = 0) -> float:
    """At t = the word `head` + 1 before a pick, head `head` guesses the pick's pair word."""
    rng = random.Random(1)
    picks = [[rng.randrange(WORDS) for _ in range(8)] for _ in range(20)]
    answers = [" ".join(f"w{a} w{PAIR[a]}" for a in row) for row in picks]
    # ids[t + 1 + head] is a pick, ids[t + 2 + head] its pair word
    return head0_accuracy(adapter, base, tokenizer, answers,
                          lambda start: range(start - 1 - head, start + 2 * 8 - 2 - head, 2), head)


def test_dependent_heads_learn_what_plain_heads_cannot(pair_data, tmp_path):
    base, data, tokenizer = pair_data
    accuracy = {}
    for head_type in ("medusa", "dependent"):
        out = tmp_path / head_type
        summary = train(small_run(base, data, out, head_type=head_type, num_heads=2, draft_vocab=20, max_steps=120,
                                  max_length=96, eval_examples=4))
        assert summary["draft_vocab"]["size"] == 20 and 0 < summary["draft_vocab"]["coverage"][20] < 1
        accuracy[head_type] = pair_accuracy(out, base, tokenizer)
    # Plain heads can only guess the pair word of an unseen pick (chance: about 1/20 of the draft vocabulary).
    assert accuracy["dependent"] > 0.7 and accuracy["medusa"] < 0.2, accuracy
