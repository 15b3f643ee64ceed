"""The distillation data engine: continuous-batching decode (engine.py) and the chunked
conversation store (store.py)."""

from __future__ import annotations

import functools
import gzip
import json
import subprocess
import sys
from collections import deque

import pytest
import torch

import medusa_spec.train.store
from medusa_spec.accept import Sampling
from medusa_spec.base import cache_argument
from medusa_spec.train.data import read_conversations
from medusa_spec.train.engine import GREEDY, Request, decode_stream
from medusa_spec.train.store import ConversationStore, read_records
from test_sampling import SETTINGS, chi_square_p_value, transformers_probs
from tiny_models import ARCHITECTURES, tiny_model

EOS = 2



def cache_of(kwargs):
    """The engine's cache in a forward's kwargs, under the name the model takes it by (base.cache_argument)."""
    return kwargs.get("cache", kwargs.get("past_key_values"))

def reference(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy answer, through the first eos."""
    # An explicit mask: without one, generate masks every token equal to pad_token_id, e.g. one an answer wrote.
    ids = torch.tensor([ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=EOS, pad_token_id=0)[0, ids.shape[1]:].tolist()
    return out[: next((i + 1 for i, t in enumerate(out) if t == EOS), len(out))]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 14, (n,), generator=g).tolist()
    return [torch.randint(3, 96, (length,), generator=g).tolist() for length in lengths]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_rows_equal_transformers_generate_with_refills(arch):
    """More requests than rows, of mixed lengths and answer limits: every row, refilled or not,
    answers exactly what transformers' generate answers alone."""
    model = tiny_model(arch)
    asks = prompts(9)
    limits = [12, 3, 12, 7, 12, 1, 12, 12, 5]
    requests = deque(Request(i, ids, max_new_tokens=limits[i]) for i, ids in enumerate(asks))
    got = dict(decode_stream(model, requests, {EOS}, rows=3, max_new_tokens=12, capacity=32))
    assert sorted(got) == list(range(9))
    for i, ids in enumerate(asks):
        assert got[i] == reference(model, ids, limits[i]), (arch, i)


def test_the_cache_holds_no_more_rows_than_requests(monkeypatch):
    """--batch-size 2000 with 3 prompts allocated 2000 cache rows (1.5 GB where 0.5 GB do)."""
    from medusa_spec.train import engine

    made = []
    monkeypatch.setattr(engine, "Slots", functools.partial(lambda slots, *args: made.append(args[1]) or slots(*args),
                                                           engine.Slots))
    model, asks = tiny_model("llama"), prompts(3)
    requests = deque(Request(i, ids, max_new_tokens=4) for i, ids in enumerate(asks))
    got = dict(decode_stream(model, requests, {EOS}, rows=2000, max_new_tokens=4))
    assert made == [3]
    assert [got[i] for i in range(3)] == [reference(model, ids, 4) for ids in asks]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_rows_attend_per_block_and_move_with_their_cache_when_resorted(arch, monkeypatch):
    """Rows of very different lengths, two to a block: each block attends up to its own longest row, and rows move
    (cache, pending token, budget, loop watch) to keep blocks of similar lengths; every answer still equals
    transformers' generate alone. The layers of gpt2, gpt_neox and opt name no group size: one block there."""
    from transformers import AttentionInterface

    from medusa_spec.train import engine

    model = tiny_model(arch)
    g = torch.Generator().manual_seed(7)
    asks = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (30, 2, 25, 3, 1, 28, 4, 20, 2, 33, 6, 1)]
    limits = [12, 9, 3, 12, 12, 6, 12, 2, 12, 9, 12, 12]
    blocks, moves = [], []
    attention = engine.row_blocks_attention
    monkeypatch.setitem(AttentionInterface._global_mapping, engine.ROW_BLOCKS_SDPA,
                        lambda *args, **kwargs: blocks.append(kwargs.get("row_blocks")) or attention(*args, **kwargs))
    reorder = engine.Slots.reorder
    monkeypatch.setattr(engine.Slots, "reorder",
                        lambda self, order, kept: moves.append(order) or reorder(self, order, kept))
    requests = deque(Request(i, ids, max_new_tokens=limits[i]) for i, ids in enumerate(asks))
    got = dict(decode_stream(model, requests, set(), rows=6, max_new_tokens=12, capacity=48, chunk_rows=2))
    for i, ids in enumerate(asks):
        expected = reference(model, ids, limits[i])
        assert got[i][:len(expected)] == expected and len(got[i]) == limits[i], (arch, i)
    if not any(hasattr(m, "num_key_value_groups") for m in model.modules()):
        assert not blocks
        return
    steps = [b for b in blocks if b is not None]
    assert moves and any(order != sorted(order) for order in moves)
    assert any(len({w for _, _, w in b}) > 1 for b in steps)  # blocks of different widths in one step
    # Two rows a block, from row 0 through the step's last row (6 while requests wait).
    assert all([(a, e) for a, e, _ in b] == [(a, min(a + 2, b[-1][1])) for a in range(0, b[-1][1], 2)] for b in steps)
    assert steps[0][-1][1] == 6


def test_re_sorted_rows_keep_their_sampling_follow_up_columns_and_the_copied_prompt(monkeypatch):
    """Rows 0-3 take A (2 tokens), C (40), B (2), P (30): blocks of two then read 41 + 31 columns against 41 + 3
    sorted, so the rows are re-sorted to C, P, A, B. Then C ends and P asked again is copied from P's new row; A
    ends and its next turn prefills only what A's new row lacks (3 tokens); B samples the whole distribution and A,
    now in B's old row, stays greedy."""
    from medusa_spec.train import engine

    model = tiny_model("llama", lm_head_scale=1.0)
    g = torch.Generator().manual_seed(11)
    asks = {key: torch.randint(3, 96, (n,), generator=g).tolist() for key, n in (("A", 2), ("C", 40), ("B", 2),
                                                                                  ("P", 30))}
    asks["P again"] = asks["P"]
    budget = {"A": 12, "C": 3, "B": 12, "P": 12, "P again": 6}
    moves, prefills = [], []
    reorder = engine.Slots.reorder
    monkeypatch.setattr(engine.Slots, "reorder",
                        lambda self, order, kept: moves.append(order) or reorder(self, order, kept))
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: prefills.extend([kwargs["input_ids"].shape[1]] * (cache_of(kwargs).row is not None)),
        with_kwargs=True)
    requests = deque(Request(key, asks[key], Sampling(True, 1.0) if key == "B" else GREEDY, budget[key])
                     for key in budget)
    answers = {}
    for key, tokens in decode_stream(model, requests, set(), rows=4, max_new_tokens=12, capacity=64, chunk_rows=2):
        answers[key] = tokens
        if key == "A":
            asks["A next"] = asks["A"] + tokens + [5, 6]
            requests.appendleft(Request("A next", asks["A next"], max_new_tokens=4))
    hook.remove()
    assert moves[0] == [1, 3, 0, 2]
    assert prefills == [2, 40, 2, 30, 3]  # "P again" copied, "A next" runs its last answer token and the message
    for key in ("A", "C", "P", "P again", "A next"):
        assert answers[key] == reference(model, asks[key], len(answers[key])), key


def test_steps_run_only_through_the_last_busy_row_once_no_request_waits():
    """Once the queue is empty, finished rows stay free: a decoding step runs the rows up to the last busy one,
    re-sorted (free ones last) before a quarter of its rows idle, down to the longest answer's row alone, and
    every answer still equals transformers' generate. Before, every step ran all the rows to the end."""
    model = tiny_model("llama")
    asks = prompts(6, seed=8)
    limits = [3, 5, 12, 4, 6, 2]
    steps = []  # rows per decoding step (a prefill names its row in the cache)
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: steps.extend([kwargs["input_ids"].shape[0]] * (cache_of(kwargs).row is None)),
        with_kwargs=True)
    requests = deque(Request(i, ids, max_new_tokens=limits[i]) for i, ids in enumerate(asks))
    got = dict(decode_stream(model, requests, {EOS}, rows=4, max_new_tokens=12, capacity=32))
    hook.remove()
    assert got == {i: reference(model, ids, limits[i]) for i, ids in enumerate(asks)}
    assert steps[0] == 4 and steps[-1] == 1
    assert steps == sorted(steps, reverse=True)  # no step runs more rows once rows went free


def test_re_sorted_rows_keep_their_loop_watch(monkeypatch):
    """With stop_loops, each row's loop watch moves with it when rows are re-sorted: every answer is transformers'
    greedy answer cut where its own loop began (repetition.loop_start), or its whole budget where it never loops.
    A watch left behind reads another row's tokens and cuts there, or lets a loop run on."""
    from medusa_spec.train import engine
    from medusa_spec.train.repetition import loop_start

    model = tiny_model("llama")
    g = torch.Generator().manual_seed(6)
    asks = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (2, 50, 3, 45, 1, 40, 2, 35, 4, 30)]
    limits = [90, 60, 90, 70, 90, 80, 90, 75, 90, 70]
    moves = []
    reorder = engine.Slots.reorder
    monkeypatch.setattr(engine.Slots, "reorder",
                        lambda self, order, kept: moves.append(order) or reorder(self, order, kept))
    requests = deque(Request(i, ids, max_new_tokens=limits[i]) for i, ids in enumerate(asks))
    got = dict(decode_stream(model, requests, {EOS}, rows=4, max_new_tokens=90, capacity=160, chunk_rows=2,
                             stop_loops=True))
    cut = 0
    for i, ids in enumerate(asks):
        expected = reference(model, ids, limits[i])
        start = loop_start(expected)
        cut += start is not None
        assert got[i] == (expected if start is None else expected[:start]), i
    assert len(moves) >= 2 and cut >= 4  # rows moved, and several answers were cut at their loops


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_next_turn_prefills_only_what_its_row_lacks(arch):
    """A conversation's next turn, added to the queue while rows run (as distill asks one), goes to the row that
    held the turn before and keeps the columns it holds (the earlier prompt and answer): only the answer's last
    token and the new message run. The answer equals transformers' generate on the whole conversation."""
    model = tiny_model(arch)
    asks = prompts(3, seed=4)
    prefills = []  # tokens run per prefill (one row's prompt; the cache names the row)
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: prefills.extend([kwargs["input_ids"].shape[1]] * (cache_of(kwargs).row is not None)),
        with_kwargs=True)
    requests = deque(Request(i, ids) for i, ids in enumerate(asks))
    answers = {}
    for key, tokens in decode_stream(model, requests, {EOS}, rows=3, max_new_tokens=8, capacity=64):
        answers[key] = tokens
        if isinstance(key, int):
            requests.appendleft(Request(("next", key), asks[key] + tokens + [5, 6]))
    hook.remove()
    for i, ids in enumerate(asks):
        assert answers[("next", i)] == reference(model, ids + answers[i] + [5, 6], 8), (arch, i)
    assert prefills == [len(ids) for ids in asks] + [3, 3, 3]


def test_no_room_and_empty_requests_come_back_empty():
    model = tiny_model("llama")
    requests = deque([Request("long", list(range(3, 40))), Request("empty", []), Request("ok", [5, 6, 7])])
    got = dict(decode_stream(model, requests, {EOS}, rows=2, max_new_tokens=4, capacity=16))
    assert got["long"] == [] and got["empty"] == [] and got["ok"] == reference(model, [5, 6, 7], 4)
    # A row whose cache fills up ends there, not past its buffer, and not before: 4 free columns take 4 fed tokens,
    # and the answer's last token is never fed.
    got = dict(decode_stream(model, deque([Request("tight", list(range(3, 13)))]), set(), rows=1, max_new_tokens=50,
                             capacity=14))
    roomy = dict(decode_stream(model, deque([Request("tight", list(range(3, 13)))]), set(), rows=1, max_new_tokens=50))
    assert len(got["tight"]) == 14 - 10 + 1 and got["tight"] == roomy["tight"][:5]


def test_a_budget_below_one_token_is_refused_by_name():
    """max_new_tokens=0 is an error, not "the default" (as `0 or default` would read it)."""
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        Request("none", [5, 6, 7], max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        next(decode_stream(tiny_model("llama"), deque([Request("a", [5, 6, 7])]), {EOS}, rows=1, max_new_tokens=0))


def test_a_request_asked_on_seeing_an_empty_answer_is_answered():
    """The caller may extend the queue on any answer, an empty one too (a request with no room); with no row busy
    then, the engine still serves what it was asked, in a free row."""
    model = tiny_model("llama")
    requests = deque([Request("empty", [])])
    got = {}
    for key, tokens in decode_stream(model, requests, {EOS}, rows=2, max_new_tokens=4, capacity=16):
        got[key] = tokens
        if key == "empty":
            requests.append(Request("asked then", [5, 6, 7]))
    assert got == {"empty": [], "asked then": reference(model, [5, 6, 7], 4)}


def test_a_request_may_ask_more_tokens_than_the_default_and_the_model_need_not_take_logits_to_keep():
    """The default capacity holds every request's own budget; a model whose forward has no logits_to_keep (a custom
    one) is prefilled without it, as the decoding loop's verify pass runs it."""
    from transformers import LlamaForCausalLM

    class NoLogitsToKeep(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=use_cache, **{cache_argument(super().forward): cache})

    model = tiny_model("llama")
    got = dict(decode_stream(model, deque([Request("long", [5, 6, 7], max_new_tokens=10)]), set(), rows=1,
                             max_new_tokens=4))
    assert len(got["long"]) == 10
    plain = NoLogitsToKeep(model.config).eval()
    plain.load_state_dict(model.state_dict())
    got = dict(decode_stream(plain, deque([Request("a", [5, 6, 7])]), set(), rows=1, max_new_tokens=4))
    expected = reference(model, [5, 6, 7], 4)
    assert len(got["a"]) == 4 and got["a"][:len(expected)] == expected  # decoding steps ran, not only the prefill


def test_requests_that_end_at_their_first_token_one_after_another_in_a_row():
    """A row refilled by a request whose first token ends it (max_new_tokens 1 here) ends too, before any decoding
    step: no answer runs past its budget or its eos."""
    model = tiny_model("llama")
    asks = prompts(4, seed=5)
    got = dict(decode_stream(model, deque(Request(i, ids, max_new_tokens=1) for i, ids in enumerate(asks)), {EOS},
                             rows=1, max_new_tokens=8))
    assert got == {i: reference(model, ids, 1) for i, ids in enumerate(asks)}


def test_each_row_draws_as_its_requests_sampling_says():
    """Per-request sampling (the decoding loop's rule): a tiny nucleus or top-k 1 keeps only the argmax, so those
    rows equal greedy ones; a row sampling the whole distribution beside them samples (differs from greedy for some
    seed)."""
    model = tiny_model("llama", lm_head_scale=1.0)
    asks = prompts(4, seed=2)
    greedy = dict(decode_stream(model, deque(Request(i, ids) for i, ids in enumerate(asks)), set(), rows=4,
                                max_new_tokens=10))
    samplings = [Sampling(True, 1.0, top_p=1e-6), Sampling(True, 1.0, top_k=1), Sampling(), Sampling(True, 1.0)]
    mixed = [dict(decode_stream(model, deque(Request(i, ids, samplings[i]) for i, ids in enumerate(asks)), set(),
                                rows=4, max_new_tokens=10, seed=seed)) for seed in range(3)]
    assert all(m[i] == greedy[i] for m in mixed for i in range(3))
    assert any(m[3] != greedy[3] for m in mixed)


def test_a_sampled_answer_does_not_depend_on_its_row_or_what_ran_beside_it():
    """A resumed distillation runs the requests left, in other rows, beside others, maybe at another --batch-size:
    each request draws from its own stream (the seed and its key), so its answer is the one the first run would have
    written; one generator shared by the rows in row order drew other answers."""
    model = tiny_model("llama", lm_head_scale=1.0)
    asks = prompts(6, seed=9)
    hot = Sampling(True, 1.0)

    def answers(keys, rows, seed=0):
        requests = deque(Request(k, asks[k], hot, max_new_tokens=10) for k in keys)
        return dict(decode_stream(model, requests, set(), rows=rows, max_new_tokens=10, seed=seed))

    whole = answers(range(6), rows=4)
    assert answers(range(3, 6), rows=2) == {k: whole[k] for k in range(3, 6)}  # resumed after 3, other rows
    assert answers([5, 1, 4], rows=3) == {k: whole[k] for k in (5, 1, 4)}  # another order
    assert answers(range(6), rows=4, seed=1) != whole  # the seed still changes them
    assert len({tuple(tokens) for tokens in whole.values()}) == 6
    # A conversation's next turn comes under the same key with a longer prompt: a stream of its own, not the first
    # turn's draws again (which made later answers repeat earlier ones).
    from medusa_spec.train.engine import request_draws
    first, again, next_turn = (request_draws(0, Request("c", ids, hot), 10) for ids in ([5, 6], [7, 8], [5, 6, 9]))
    assert first == again and first != next_turn and len(set(first + next_turn)) == 20


@pytest.mark.parametrize("sampling", SETTINGS, ids=str)
def test_rows_sample_the_processed_distribution(sampling):
    """Each row inverts the distribution's CDF at its own uniform draw: counts over many rows follow
    transformers' processed distribution (chi-square), filtered tokens never come out, not even at a draw of 0 or
    just below 1."""
    from medusa_spec.train.engine import _pick

    logits = torch.randn(40, generator=torch.Generator().manual_seed(3)) * 2
    rows = 20_000
    uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(4), dtype=torch.float64).tolist()
    uniforms[:2] = [0.0, 1 - 2 ** -53]
    tokens = _pick(logits.expand(rows, -1), [sampling] * rows, uniforms)
    probs = transformers_probs(logits[None], sampling)[0]
    assert chi_square_p_value(torch.bincount(tokens, minlength=40).double(), probs) > 1e-3


def test_a_prompt_asked_again_is_prefilled_once():
    """Model-written prompts all start from one opening: a request with the last prefilled prompt copies its cache
    and logits instead of running the model, answers as if prefilled itself, and still draws its own tokens."""
    model = tiny_model("llama", lm_head_scale=1.0)
    a, b = prompts(2, seed=3)
    a, b = a + [7, 8], b + [9]  # at least 2 tokens: a prefill is the only forward of more than one
    prefills = []  # tokens run per prefill (one row's prompt; the cache names the row)
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: prefills.extend([kwargs["input_ids"].shape[1]] * (cache_of(kwargs).row is not None)),
        with_kwargs=True)
    asks = [a, a, b, a, a, a]
    got = dict(decode_stream(model, deque(Request(i, ids) for i, ids in enumerate(asks)), {EOS}, rows=2,
                             max_new_tokens=8))
    hook.remove()
    # a; a copied; b in row 0; a in row 1, which still holds it (only its last token runs, for the logits); a
    # twice more, copied from row 1.
    assert prefills == [len(a), len(b), 1]
    assert all(got[i] == reference(model, ids, 8) for i, ids in enumerate(asks))
    sampled = dict(decode_stream(model, deque(Request(i, a, Sampling(True, 1.0)) for i in range(6)), set(), rows=3,
                                 max_new_tokens=4))
    assert len({tokens[0] for tokens in sampled.values()}) > 1  # the logits are shared, not the first token
    # The row that prefilled `a` ends and stays free (its column 0 then takes pad tokens) while `b` goes on;
    # `a` asked again later is prefilled afresh, not copied from that row.
    answers = {}
    requests = deque([Request("b", b, max_new_tokens=10), Request("a", a, max_new_tokens=3)])
    for key, tokens in decode_stream(model, requests, set(), rows=2, max_new_tokens=10):
        answers[key] = tokens
        if key == "b":
            requests.append(Request("a again", a, max_new_tokens=3))
    assert list(answers) == ["a", "b", "a again"] and answers["a again"] == answers["a"]


def record(i: int) -> dict:
    return {"id": f"p{i}",
            "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}


def test_store_seals_chunks_and_resumes(tmp_path):
    folder = tmp_path / "data"
    store = ConversationStore(folder, chunk_size=4)
    store.append([record(i) for i in range(3)])
    store.append([record(i) for i in range(3, 6)])
    assert sorted(p.name for p in folder.iterdir()) == ["part-00000.jsonl.gz"]  # sealed at 6 >= 4
    assert len(gzip.decompress((folder / "part-00000.jsonl.gz").read_bytes()).splitlines()) == 6
    store.append([record(6)])
    # A kill mid-line: the cut line is dropped, everything before it is kept.
    with open(folder / "open.jsonl", "a") as f:
        f.write('{"id": "p7", "mess')
    del store  # its writer's end (the lock goes with it)
    again = ConversationStore(folder, chunk_size=4)
    assert again.done == {f"p{i}" for i in range(7)}
    again.append([record(7), record(8), record(9)])
    assert [r["id"] for r in read_records(folder)] == [f"p{i}" for i in range(10)]
    assert len(read_conversations(folder)) == 10
    # The same records always give the same bytes (a repository holds them without churn).
    other = ConversationStore(tmp_path / "again", chunk_size=4)
    other.append([record(i) for i in range(6)])
    assert (tmp_path / "again" / "part-00000.jsonl.gz").read_bytes() == (folder / "part-00000.jsonl.gz").read_bytes()


def test_store_drops_the_open_copy_left_by_a_kill_after_sealing(tmp_path):
    folder = tmp_path / "data"
    store = ConversationStore(folder, chunk_size=100)
    store.append([record(i) for i in range(3)])
    kept = (folder / "open.jsonl").read_bytes()
    store.seal()
    (folder / "open.jsonl").write_bytes(kept)  # as if killed between the rename and the unlink
    assert [r["id"] for r in read_records(folder)] == ["p0", "p1", "p2"]
    del store
    again = ConversationStore(folder)
    assert not (folder / "open.jsonl").exists() and again.done == {"p0", "p1", "p2"}
    again.append([record(3)])
    again.seal()
    assert [r["id"] for r in read_records(folder)] == ["p0", "p1", "p2", "p3"]


@pytest.mark.parametrize("text", ['{"prompt": "w5"}\n{"prompt": "w9"}', '{"id": "p0", "messages": []}\nnotes'],
                         ids=["prompts-file", "foreign-last-line"])
def test_a_file_distill_did_not_write_is_refused_untouched(tmp_path, text):
    """A prompts file given as --output, or one whose unfinished last line is not a record a kill cut short: refused
    before anything in it is cut (it used to lose its last line, written without a final newline)."""
    file = tmp_path / "prompts.jsonl"
    file.write_text(text)
    with pytest.raises(ValueError, match="not (a distill record|one distill writes).*write to a new --output"):
        ConversationStore(file)
    assert file.read_text() == text


def test_a_single_file_output_stays_one_jsonl(tmp_path):
    file = tmp_path / "out.jsonl"
    ConversationStore(file, chunk_size=2).append([record(i) for i in range(5)])
    assert [json.loads(line)["id"] for line in file.read_text().splitlines()] == [f"p{i}" for i in range(5)]


def test_reading_while_a_line_is_being_written_leaves_the_file_alone(tmp_path):
    """A reader (train --data, a token count) may open the folder while distill writes: a last line not yet complete
    is passed over, not cut off on disk, so the writer's rest of the line lands whole."""
    folder = tmp_path / "data"
    store = ConversationStore(folder)
    store.append([record(0)])
    line = json.dumps(record(1)) + "\n"
    with open(folder / "open.jsonl", "a", encoding="utf-8") as writer:
        writer.write(line[:20])
        writer.flush()
        assert [r["id"] for r in read_records(folder)] == ["p0"]
        writer.write(line[20:])
    assert [r["id"] for r in read_records(folder)] == ["p0", "p1"]
    # Its writer, started after a kill left half a line, cuts it off and appends whole lines.
    with open(folder / "open.jsonl", "a", encoding="utf-8") as writer:
        writer.write(json.dumps(record(2))[:20])
    del store
    store = ConversationStore(folder)
    store.append([record(3)])
    assert [r["id"] for r in read_records(folder)] == ["p0", "p1", "p3"]


@pytest.mark.parametrize("single_file", [False, True], ids=["folder", "file"])
def test_a_second_writer_is_refused(tmp_path, single_file):
    """Two writers on one output interleave their chunks: records were lost and others stored twice."""
    path = tmp_path / ("out.jsonl" if single_file else "data")
    store = ConversationStore(path, chunk_size=2)
    store.append([record(0)])
    with pytest.raises(ValueError, match="is being written by another distill run .*write to another --output"):
        ConversationStore(path, chunk_size=2)
    code = (f"from medusa_spec.train.store import ConversationStore; ConversationStore({str(path)!r})")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert other.returncode != 0 and "is being written by another distill run" in other.stderr
    store.append([record(1), record(2)])
    del store  # its process ends
    ConversationStore(path, chunk_size=2).append([record(3)])
    assert [r["id"] for r in read_records(path)] == ["p0", "p1", "p2", "p3"]


def test_a_reader_sees_every_record_while_chunks_are_sealed(tmp_path, monkeypatch):
    """train --data may read while distill writes: a chunk sealed between listing the parts and reading open.jsonl
    was missed (or open.jsonl was gone: FileNotFoundError)."""
    folder = tmp_path / "data"
    store = ConversationStore(folder, chunk_size=3)
    store.append([record(i) for i in range(5)])  # part-00000 with p0-p4
    store.append([record(5)])
    listed = medusa_spec.train.store._parts

    sealed = []

    def seal_after_listing(path):
        parts = listed(path)
        if not sealed:  # once, as the reader lists
            sealed.append(True)
            store.append([record(6), record(7)])  # reaches 3 in open.jsonl: sealed into part-00001
        return parts

    monkeypatch.setattr(medusa_spec.train.store, "_parts", seal_after_listing)
    assert [r["id"] for r in read_records(folder)] == [f"p{i}" for i in range(8)]


def test_a_damaged_part_is_named(tmp_path):
    folder = tmp_path / "data"
    ConversationStore(folder, chunk_size=2).append([record(0), record(1)])
    part = folder / "part-00000.jsonl.gz"
    part.write_bytes(part.read_bytes()[:20])
    with pytest.raises(ValueError, match=r"part-00000.jsonl.gz is damaged \(not a complete gzip file\): restore it"):
        read_records(folder)


def test_store_reads_back_text_with_unicode_line_separators(tmp_path):
    """JSON keeps U+2028, U+2029 and U+0085 raw inside strings; str.splitlines would cut a record there."""
    folder = tmp_path / "data"
    records = [{"id": "p0", "messages": [{"role": "user", "content": "a\u2028b\u2029c\x85d\x1ce"}]}, record(1)]
    ConversationStore(folder, chunk_size=4).append(records)
    assert read_records(folder) == records
    ConversationStore(folder, chunk_size=4).append([record(i) for i in range(2, 5)])  # sealed into a part
    assert read_records(folder)[:2] == records and len(read_records(folder)) == 5
