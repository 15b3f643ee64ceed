"""Training DFlash drafts (medusa_spec.train.dflash_loop, `medusa-spec train --head-type dflash`): each trained block
is the block decoding drafts, scored against the base model's distribution as speculators scores it; a trained draft
learns and decodes losslessly; save_dflash writes what load_dflash reads back exactly; bad settings are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from medusa_spec import generate_with_dflash, load_dflash
from medusa_spec.base import inspect_base_model
from medusa_spec.dflash import block_logits, new_dflash, read_config, save_dflash
from medusa_spec.train import TrainConfig, dflash_loop, train_dflash
from medusa_spec.train.dflash_loop import DFlashTrainModule, select_anchors, slot_weights
from medusa_spec.train.load import load_model_and_tokenizer
from medusa_spec.tree import grow_tree
from test_training import ANSWER, Killed, ask, base_dir, conversations, one_thread  # noqa: F401 (fixtures)
from tiny_models import tiny_model

FIXTURES = Path(__file__).parent / "fixtures" / "dflash"
VERIFIER = Path(__file__).parent / "fixtures" / "eagle3" / "tiny-verifier"
TRAINING = json.loads((FIXTURES / "expected_training.json").read_text())


def dflash_run(base, data, output, **overrides) -> TrainConfig:
    settings = dict(model=str(base), data=[str(data)], output=str(output), head_type="dflash", num_layers=1,
                    block_size=4, max_anchors=16, max_length=64, batch_size=4, lr=3e-3, warmup_steps=5,
                    eval_examples=8, log_every=50, save_every=0, feature_layers=[0, 1])
    return TrainConfig(**{**settings, **overrides})


def reference_loss(base, draft, batch, anchors, valid, gamma):
    """The loss one block at a time, as decoding drafts: each anchor's example run alone through the base, the block
    drafted after the example's tokens before the anchor (block_logits), scored against the base's logits over the
    draft vocabulary one position before each slot's token."""
    ids, segments, mask = batch["input_ids"], batch["segment_ids"], batch["loss_mask"]
    size, rows = draft.config.block_size, []
    weight = slot_weights(size, gamma, ids.device)
    for b in range(ids.shape[0]):
        total, counted = 0.0, 0
        for a, ok in zip(anchors[b].tolist(), valid[b].tolist()):
            if not ok:
                continue
            in_example = (segments[b] == segments[b, a]).nonzero().flatten()
            start, end = int(in_example[0]), int(in_example[-1]) + 1
            example = ids[b: b + 1, start:end]
            with torch.no_grad():
                out = base(input_ids=example, output_hidden_states=True)
            features = torch.cat([out.hidden_states[i] for i in draft.config.aux_layer_ids], dim=-1)
            logits = block_logits(draft, features[:, : a - start], ids[b, a: a + 1])[0].float()
            for k in range(1, size):
                t = a + k
                if t >= end or not mask[b, t]:
                    continue
                teacher = out.logits[0, t - 1 - start].float()
                if draft.token_map is not None:
                    teacher = teacher[draft.token_map]
                kl = F.kl_div(logits[k].log_softmax(-1), teacher.softmax(-1), reduction="sum")
                total, counted = total + weight[k] * kl, counted + 1
        rows.append(total / (counted + 1e-5))
    return torch.stack([torch.as_tensor(r, dtype=torch.float32) for r in rows]).mean()


def packed_batch(vocab: int):
    """Two rows of 24 slots: row 0 packs two examples, row 1 holds one and padding; answers marked in loss_mask."""
    torch.manual_seed(1)
    ids = torch.randint(4, vocab, (2, 24))
    segments = torch.tensor([[1] * 13 + [2] * 11, [1] * 18 + [0] * 6])
    positions = torch.cat([torch.arange(13), torch.arange(11)]), torch.cat([torch.arange(18), torch.zeros(6)])
    mask = torch.zeros(2, 24, dtype=torch.bool)
    mask[0, 5:13], mask[0, 17:24], mask[1, 6:18] = True, True, True
    return {"input_ids": ids, "segment_ids": segments, "loss_mask": mask,
            "position_ids": torch.stack(positions).long()}


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "draft-vocab"])
def test_each_trained_block_is_the_block_decoding_drafts_scored_as_speculators_scores_it(reduced):
    base = tiny_model("llama").eval().requires_grad_(False)  # frozen, as train_dflash holds it
    vocab = base.config.vocab_size
    token_ids = torch.arange(0, vocab, 2) if reduced else None
    torch.manual_seed(0)
    draft = new_dflash(base, num_layers=2, block_size=4, aux_layer_ids=[0, 1], mask_token_id=3, token_ids=token_ids)
    spec = inspect_base_model(base)
    module = DFlashTrainModule(base, draft, spec.bool_mask, spec.takes_logits_to_keep)
    batch = packed_batch(vocab)
    anchors, valid = select_anchors(batch["loss_mask"], 4, 12, torch.Generator().manual_seed(0))
    assert valid.sum(1).tolist() == [11, 12]  # row 0: 11 answer positions leave a block; one anchor pads
    loss, stats = module(batch["input_ids"], batch["position_ids"], batch["segment_ids"], batch["loss_mask"], anchors,
                         valid, 4.0)
    expected = reference_loss(base, draft, batch, anchors, valid, 4.0)
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    assert stats.counted[0] == 0 and stats.counted[1:].sum() > 0  # the anchor's slot is never trained
    loss.backward()  # the frozen parts get no gradient, the trained ones do
    assert draft.fc.weight.grad is not None and draft.layers[1].mlp.down_proj.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in base.parameters())
    assert (draft.lm_head is None) != reduced and (not reduced or draft.lm_head.weight.grad is None)


@pytest.mark.parametrize("name", sorted(TRAINING["cases"]))
def test_the_loss_is_speculators_training_loss_on_its_own_draft(name):
    """Golden values written by speculators 0.9.0 (fixtures/dflash/make_training_fixture.py): its DFlashDraftModel's
    training forward on a packed sequence of two documents at given anchors."""
    base = AutoModelForCausalLM.from_pretrained(VERIFIER).eval().requires_grad_(False)
    draft = load_dflash(FIXTURES / name, base)
    spec = inspect_base_model(base)
    module = DFlashTrainModule(base, draft, spec.bool_mask, spec.takes_logits_to_keep)
    row = {key: torch.tensor([TRAINING[key]]) for key in ("input_ids", "position_ids", "loss_mask", "anchors",
                                                           "valid")}
    segments = torch.tensor([TRAINING["document_ids"]]) + 1
    loss, stats = module(row["input_ids"], row["position_ids"], segments, row["loss_mask"].bool(), row["anchors"],
                         row["valid"], TRAINING["gamma"])
    case = TRAINING["cases"][name]
    torch.testing.assert_close(loss.item(), case["loss"], rtol=1e-5, atol=1e-6)
    assert stats.hits[1:, 0].tolist() == case["slot_hits"] and stats.counted[1:].tolist() == case["slot_counted"]
    assert stats.accepted.item() == case["eal_sum"] and stats.blocks.item() == case["eal_total"]


def test_anchors_are_distinct_answer_positions_that_leave_a_whole_block():
    mask = torch.zeros(3, 20, dtype=torch.bool)
    mask[0, 2:20], mask[1, 15:20], mask[2, 3:5] = True, True, True
    anchors, valid = select_anchors(mask, 4, 6, torch.Generator().manual_seed(0))
    assert anchors.shape == (3, 6)
    for row in range(3):
        chosen = anchors[row][valid[row]].tolist()
        assert len(set(chosen)) == len(chosen) and all(mask[row, a] and a < 16 for a in chosen)
    assert valid.sum(1).tolist() == [6, 1, 2]  # row 1: only 15 leaves a block; row 2: both of its answer positions


def test_a_trained_draft_learns_to_count_and_decodes_the_base_models_output(base_dir, conversations,  # noqa: F811
                                                                           tmp_path):
    output = tmp_path / "dflash"
    untrained = train_dflash(dflash_run(base_dir, conversations, tmp_path / "untrained", max_steps=1, lr=1e-9))
    saved = (tmp_path / "untrained" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"already holds a model or a draft \(config.json\).*choose a new --output"):
        train_dflash(dflash_run(base_dir, conversations, tmp_path / "untrained", max_steps=1))
    assert (tmp_path / "untrained" / "model.safetensors").read_bytes() == saved  # a model's folder is no output
    summary = train_dflash(dflash_run(base_dir, conversations, output, max_steps=120, draft_vocab=20))
    log = [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["eval"] == summary["eval"] and summary["steps"] == 120
    assert min(summary["eval"]["slot_top1"]) > 0.7 > 0.1 > max(untrained["eval"]["slot_top1"])
    assert summary["eval"]["accepted_length"] > 2.5 > untrained["eval"]["accepted_length"]
    assert (output / "trained_conversations.txt").is_file()

    base, tokenizer = load_model_and_tokenizer(base_dir)
    draft = load_dflash(output, base)
    assert draft.config.draft_vocab_size == 20 and draft.config.aux_layer_ids == [0, 1]
    ids = torch.tensor([tokenizer.apply_chat_template([ask(5)], add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)])
    out = generate_with_dflash(base, draft, ids, max_new_tokens=ANSWER)
    with torch.no_grad():
        expected = base.generate(ids, do_sample=False, max_new_tokens=ANSWER)
    assert torch.equal(out.sequences, expected)
    assert out.stats.new_tokens[0] >= 2 * out.stats.row_steps[0]  # 1 without the draft: its blocks are accepted
    # Each slot's rank accuracies (rank 0 its top-1), from which a tree grows as for Medusa heads: lossless too.
    accuracy = summary["eval"]["rank_accuracy"]
    assert [row[0] for row in accuracy] == summary["eval"]["slot_top1"] and len(accuracy[0]) == 10
    assert all(sum(row) <= 1 + 1e-6 for row in accuracy)
    grown = generate_with_dflash(base, draft, ids, max_new_tokens=ANSWER, tree=grow_tree(accuracy, 6))
    assert torch.equal(grown.sequences, expected)


def test_resume_after_a_kill_reaches_the_draft_of_an_uninterrupted_run(base_dir, conversations,  # noqa: F811
                                                                       tmp_path, monkeypatch):
    """The checkpoint holds the trained weights only: the frozen LM head rows and the token map come back from the
    base and the data, and the anchors each micro-step draws from its seed."""
    def run(output, **extra):
        return train_dflash(dflash_run(base_dir, conversations, output, max_steps=6, save_every=2, grad_accum=2,
                                       eval_examples=4, draft_vocab=20, **extra))

    straight = run(tmp_path / "straight")
    calls, real = [], dflash_loop.select_anchors

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) > 9:  # dies in step 5, one step after the checkpoint of step 4
            raise Killed
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(dflash_loop, "select_anchors", dying)
        with pytest.raises(Killed):
            run(tmp_path / "killed")
    with pytest.raises(ValueError, match="--resume"):
        run(tmp_path / "killed")
    resumed = run(tmp_path / "killed", resume=True)
    assert resumed["start_step"] == 4 and resumed["answer_tokens_seen"] == straight["answer_tokens_seen"]
    assert resumed["eval"] == straight["eval"]
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("straight", "killed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_saved_draft_trains_on_from_its_folder(base_dir, conversations, tmp_path):  # noqa: F811
    """--init-heads DIR with a DFlash folder: the draft as saved (bf16 too) starts the run, in fp32, its shape kept
    (a flag with another value is refused), and what it learned from listed beside what it learns now."""
    first = train_dflash(dflash_run(base_dir, conversations, tmp_path / "first", max_steps=6, draft_vocab=20))
    saved = load_file(tmp_path / "first" / "model.safetensors")
    # Left-out shape flags take the draft's; the folder's kind makes the run a DFlash one without --head-type.
    again = dict(num_layers=None, feature_layers=None, block_size=8, head_type=None, init_heads=str(tmp_path / "first"))
    assert dflash_run(base_dir, conversations, tmp_path / "x", **again).head_type == "dflash"
    unchanged = train_dflash(dflash_run(base_dir, conversations, tmp_path / "same", max_steps=1, lr=0.0, **again))
    assert unchanged["eval"] == first["eval"]  # the same weights, on the same held-out rows
    same = load_file(tmp_path / "same" / "model.safetensors")
    assert same.keys() == saved.keys() and all(torch.equal(same[k], saved[k]) for k in saved)
    assert json.loads((tmp_path / "same" / "config.json").read_text()) == json.loads(
        (tmp_path / "first" / "config.json").read_text())

    base, _ = load_model_and_tokenizer(base_dir)
    save_dflash(load_dflash(tmp_path / "first", base), tmp_path / "bf16", dtype=torch.bfloat16)
    (tmp_path / "bf16" / "trained_conversations.txt").write_text(
        (tmp_path / "first" / "trained_conversations.txt").read_text())
    on = train_dflash(dflash_run(base_dir, conversations, tmp_path / "on", max_steps=40,
                                 **{**again, "init_heads": str(tmp_path / "bf16")}))
    trained = load_file(tmp_path / "on" / "model.safetensors")
    assert trained["layers.0.mlp.up_proj.weight"].dtype == torch.float32
    assert not torch.equal(trained["fc.weight"], saved["fc.weight"])  # it trains
    rows = load_file(tmp_path / "bf16" / "model.safetensors")["lm_head.weight"]
    assert torch.equal(trained["lm_head.weight"], rows.float())  # frozen: the base's rows as the folder keeps them
    assert on["eval"]["accepted_length"] > first["eval"]["accepted_length"]
    # On conversations it has not seen: those it learned from are listed beside the new ones.
    learned = (tmp_path / "first" / "trained_conversations.txt").read_text().split()
    train_dflash(dflash_run(base_dir, conversations, tmp_path / "apart", max_steps=1, eval_examples=1, batch_size=2,
                            exclude=[str(tmp_path / "first" / "trained_conversations.txt")], **again))
    listed = (tmp_path / "apart" / "trained_conversations.txt").read_text().split()
    assert set(learned) < set(listed)

    for flag, value in (("block_size", 6), ("draft_vocab", 30), ("num_layers", 2), ("feature_layers", [1])):
        with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')}.*leave --{flag.replace('_', '-')} out"):
            train_dflash(dflash_run(base_dir, conversations, tmp_path / f"bad-{flag}", max_steps=1,
                                    **{**again, flag: value}))


def test_save_dflash_writes_what_load_dflash_reads_back(tmp_path):
    base = tiny_model("qwen3").eval()
    torch.manual_seed(0)
    draft = new_dflash(base, num_layers=2, block_size=5, aux_layer_ids=[1, 0], mask_token_id=7,
                       token_ids=torch.arange(3, 40), base_name="org/tiny")
    save_dflash(draft, tmp_path / "draft")
    meta = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert meta["speculators_model_type"] == "dflash" and meta["block_size"] == 5 and meta["mask_token_id"] == 7
    assert meta["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    assert meta["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    loaded = load_dflash(tmp_path / "draft", base)
    assert loaded.state_dict().keys() == draft.state_dict().keys()
    for key, value in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert read_config(tmp_path / "draft").layer.to_dict() == draft.config.layer.to_dict()
    save_dflash(loaded, tmp_path / "again")  # a second round trip writes the same files
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == meta
    features = torch.randn(1, 6, 2 * base.config.hidden_size)
    torch.testing.assert_close(block_logits(loaded, features, torch.tensor([5])),
                               block_logits(draft.eval(), features, torch.tensor([5])))


@pytest.mark.parametrize("settings, named", [
    (dict(head_type="eagle", block_size=6), "--block-size"),
    (dict(mode="medusa2"), "--mode medusa2"),
    (dict(cache_hidden=True), "--cache-hidden"),
    (dict(block_size=1), "--block-size >= 2"),
    (dict(dflash_decay_gamma=0.0), "--dflash-decay-gamma"),
])
def test_bad_dflash_settings_are_refused_naming_the_flag(tmp_path, settings, named):
    with pytest.raises(ValueError, match=named):
        dflash_run("base", "data.jsonl", tmp_path, **settings)


def test_the_heads_loop_refuses_a_dflash_config(tmp_path):
    from medusa_spec.train import train
    with pytest.raises(ValueError, match="train_dflash"):
        train(dflash_run("base", "data.jsonl", tmp_path))
