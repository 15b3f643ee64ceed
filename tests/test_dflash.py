"""DFlash block drafts as speculators defines them: every block slot equal to what the reference itself drafted
(tests/fixtures/dflash, made by make_fixtures.py with speculators 0.9.0), and bad folders refused by name."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from draft_folders import edited_copy, shifted
from medusa_spec.dflash import block_logits, context_features, load_dflash, propose_block, read_config
from tiny_models import tiny_model

FIXTURES = Path(__file__).parent / "fixtures" / "dflash"
VERIFIER = Path(__file__).parent / "fixtures" / "eagle3" / "tiny-verifier"
EXPECTED = json.loads((FIXTURES / "expected_blocks.json").read_text())
DRAFTS = sorted(EXPECTED["drafts"])


@pytest.fixture(scope="module")
def verifier():
    return AutoModelForCausalLM.from_pretrained(VERIFIER).eval()


def blocks(draft, verifier, text: list[int]) -> list[torch.Tensor]:
    """The block logits [block_size, draft vocab] after each prefix text[:a], anchored at text[a], one call each."""
    ids = torch.tensor([text])
    features = context_features(verifier, draft, ids)
    with torch.no_grad():
        return [block_logits(draft, features[:, :a], ids[:, a])[0] for a in range(len(text) - draft.config.block_size)]


# --- conformance with the reference -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", DRAFTS)
def test_blocks_equal_speculators_at_every_anchor_and_slot(verifier, name):
    """Every anchor of two texts (speculators picks every one it may: all but the last block_size positions), every
    slot's argmax in the verifier's vocabulary equal; the last two anchors' logits equal to 1e-4 (kept to 6 digits)."""
    draft = load_dflash(FIXTURES / name, verifier)
    assert draft.config.block_size == EXPECTED["block_size"] and draft.config.aux_layer_ids == EXPECTED["aux_layer_ids"]
    for text, expected in zip(EXPECTED["texts"], EXPECTED["drafts"][name]):
        logits = blocks(draft, verifier, text)
        assert [draft.token_ids(block.argmax(-1)).tolist() for block in logits] == expected["tokens"]
        assert expected["logits"]
        for anchor, want in expected["logits"].items():
            torch.testing.assert_close(logits[int(anchor)], torch.tensor(want), atol=1e-4, rtol=1e-5)
    # Fixtures that could not tell a wrong draft from a right one: the slots draft varied tokens.
    assert len({token for row in EXPECTED["drafts"][name] for block in row["tokens"] for token in block}) >= 8


def test_the_fixtures_tell_the_settings_apart(verifier):
    """The sliding window and the causal mask inside it change the drafts, so the comparison above would catch a
    sliding layer computed as a full one, or sliding_window_non_causal ignored."""
    text = EXPECTED["texts"][0]
    want = EXPECTED["drafts"]["qwen3-sliding-window"][0]["tokens"]
    for change in ("no window", "non-causal"):
        draft = load_dflash(FIXTURES / "qwen3-sliding-window", verifier)
        if change == "no window":
            draft.layers[0].sliding_window = None
        else:
            draft.config.sliding_window_non_causal = True
        got = [draft.token_ids(block.argmax(-1)).tolist() for block in blocks(draft, verifier, text)]
        assert got != want, change


@pytest.mark.parametrize("name", DRAFTS)
def test_propose_block_drafts_the_tokens_after_the_anchor(verifier, name):
    """block_size - 1 tokens from slot 1 on; with sample_from_anchor block_size from slot 0 (speculators'
    speculative_tokens either way)."""
    draft = load_dflash(FIXTURES / name, verifier)
    meta = json.loads((FIXTURES / name / "config.json").read_text())
    wanted = meta["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    text, expected = EXPECTED["texts"][1], EXPECTED["drafts"][name][1]["tokens"]
    ids = torch.tensor([text])
    anchor = len(text) - draft.config.block_size - 1
    with torch.no_grad():
        tokens = propose_block(draft, context_features(verifier, draft, ids)[:, :anchor], ids[:, anchor])
    assert tokens.shape == (1, wanted)
    assert tokens[0].tolist() == expected[anchor][-wanted:]


def test_a_left_padded_batch_drafts_each_row_as_alone(verifier):
    """Rows of different lengths, left-padded with context_mask: each row's block as drafted alone (its positions
    count its own tokens), in every layer kind."""
    draft = load_dflash(FIXTURES / "qwen3-sliding-window", verifier)
    rows = [torch.tensor(EXPECTED["texts"][0][:n]) for n in (9, 4, 6)]
    features = [context_features(verifier, draft, row[None])[0] for row in rows]
    anchors = torch.tensor([7, 11, 13])
    width = max(len(f) for f in features)
    padded = torch.stack([torch.cat([torch.full((width - len(f), f.shape[1]), 9.0), f]) for f in features])
    mask = torch.stack([torch.arange(width) >= width - len(f) for f in features]).long()
    with torch.no_grad():
        together = block_logits(draft, padded, anchors, mask)
        for i, row in enumerate(features):
            torch.testing.assert_close(together[i], block_logits(draft, row[None], anchors[i:i + 1])[0],
                                       atol=1e-5, rtol=1e-5)


def test_the_draft_shares_the_verifiers_embeddings_and_reads_a_reduced_lm_head_from_the_folder(verifier):
    full = load_dflash(FIXTURES / "qwen3-2-layers-full-vocab-from-anchor", verifier)
    assert full.verifier_weights[0] is verifier.get_input_embeddings().weight
    assert full.verifier_weights[1] is verifier.get_output_embeddings().weight
    assert full.lm_head is None and full.token_map is None
    # Shared by reference, not owned: the draft's dtype and device moves leave the base model as it was.
    assert not any(name.startswith(("embed_tokens", "lm_head")) for name in full.state_dict())
    full.half()
    embeddings, output = verifier.get_input_embeddings().weight, verifier.get_output_embeddings().weight
    assert embeddings.dtype == output.dtype == torch.float32
    reduced = load_dflash(FIXTURES / "qwen3-1-layer", verifier)
    assert torch.equal(reduced.lm_head.weight, load_file(FIXTURES / "qwen3-1-layer" / "model.safetensors")
                       ["lm_head.weight"])
    assert reduced.token_map.shape == (40,) and not reduced.training


def test_a_base_in_another_dtype_drafts_with_the_drafts_own(verifier):
    """A bfloat16 base: the shared embeddings and LM head meet the float32 draft; the blocks come out close to the
    float32 base's."""
    half = copy.deepcopy(verifier).to(torch.bfloat16)
    name = "qwen3-2-layers-full-vocab-from-anchor"  # its lm_head is the base's: bfloat16 here
    text = torch.tensor([EXPECTED["texts"][0]])
    got = []
    for base in (verifier, half):
        draft = load_dflash(FIXTURES / name, base)
        with torch.no_grad():
            got.append(block_logits(draft, context_features(base, draft, text)[:, :6], text[:, 6]))
    assert got[1].dtype == torch.bfloat16 and got[1].shape == got[0].shape == (1, 4, 96)
    torch.testing.assert_close(got[1].float(), got[0], atol=0.5, rtol=0.05)


# --- refusals -----------------------------------------------------------------------------------------------------

def broken_copy(tmp_path, config=None, tensors=None, name="qwen3-1-layer") -> Path:
    return edited_copy(FIXTURES / name, tmp_path / "draft", config, tensors, merged=("transformer_layer_config",))


@pytest.mark.parametrize(("name", "config", "tensors", "message"), [
    (None, {"speculators_model_type": "eagle3"}, None, "speculators_model_type 'eagle3' is not a DFlash draft"),
    (None, {"markov_head": True}, None, r"field\(s\) \['markov_head'\] are not part of speculators' DFlash config"),
    (None, {"mask_token_id": None}, None, r"mask_token_id None must be a token id of the verifier's vocabulary"),
    (None, {"mask_token_id": 96}, None, r"mask_token_id 96 must be a token id.*\[0, 96\)"),
    (None, {"block_size": 1}, None, "block_size 1 must be an integer >= 2"),
    (None, {"sample_from_anchor": "yes"}, None, "sample_from_anchor must be true or false"),
    (None, {"target_hidden_size": 64}, None, "target_hidden_size 64 differs"),
    (None, {"draft_vocab_size": 200}, None, r"draft_vocab_size 200 must be an integer from 1 to .* \(96"),
    (None, {"transformer_layer_config": {"model_type": "llama"}}, None, "model_type is 'llama'"),
    (None, {"aux_hidden_state_layer_ids": [1, 1, 2]}, None, "must be distinct layer ids"),
    (None, {"aux_hidden_state_layer_ids": [1, 2, 4]}, None, r"name layer 4 of a base model of 4 decoder layers"),
    (None, {"aux_hidden_state_layer_ids": [1, 2]}, None, r"fc.weight has shape \(32, 96\), expected \(32, 64\)"),
    (None, None, {"fc.weight": None}, "missing fc.weight"),
    (None, None, {"lm_head.weight": None}, "missing lm_head.weight"),
    (None, None, {"layers.0.self_attn.q_norm.weight": torch.ones(5)},
     r"layers.0.self_attn.q_norm.weight has shape \(5,\), expected \(8,\)"),
    (None, None, {"layers.1.mlp.up_proj.weight": torch.ones(40, 32)}, "unexpected layers.1.mlp.up_proj.weight"),
    (None, None, {"t2d": None}, "needs both d2t and t2d; missing t2d"),
    (None, None, {"d2t": shifted}, "one id twice"),
    (None, None, {"t2d": lambda t2d: t2d.roll(1)}, "t2d and d2t disagree"),
    (None, None, {"embed_tokens.weight": torch.zeros(96, 32)}, "embed_tokens.weight is not the base model's"),
    ("qwen3-2-layers-full-vocab-from-anchor", None, {"lm_head.weight": torch.zeros(96, 32)},
     "lm_head.weight is not the base model's"),
    ("qwen3-2-layers-full-vocab-from-anchor", None, {"d2t": torch.ones(96, dtype=torch.long)},
     "d2t maps a draft over the whole vocabulary"),
])
def test_a_bad_folder_is_refused_naming_the_problem(verifier, tmp_path, name, config, tensors, message):
    before = {k: v.clone() for k, v in verifier.state_dict().items()}
    folder = broken_copy(tmp_path, config, tensors, name or "qwen3-1-layer")
    with pytest.raises(ValueError, match=message):
        load_dflash(folder, verifier)
    assert all(torch.equal(before[k], v) for k, v in verifier.state_dict().items())


def test_a_verifier_that_does_not_fit_is_refused():
    for base, sizes in ((tiny_model("llama", hidden_size=48, num_hidden_layers=4), "48 and 96"),
                        (tiny_model("llama", vocab_size=120, num_hidden_layers=4), "32 and 120")):
        with pytest.raises(ValueError, match=f"hidden_size=32 and vocab_size=96 .* has {sizes}: this draft belongs"):
            load_dflash(FIXTURES / "qwen3-1-layer", base)


def test_the_config_keeps_what_it_does_not_read():
    config = read_config(FIXTURES / "qwen3-sliding-window")
    assert config.layer.sliding_window == 3 and config.layer.layer_types == ["sliding_attention", "full_attention"]
    assert config.source == json.loads((FIXTURES / "qwen3-sliding-window" / "config.json").read_text())
    assert config.drafted_slots == slice(1, 4)
