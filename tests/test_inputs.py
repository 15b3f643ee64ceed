"""Bad input gets a clear error naming the problem and the fix; trees and the basic save/load."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from medusa_spec import MedusaConfig, MedusaModel, UnsupportedModelError, build_tree, default_tree, grow_tree
from medusa_spec.tree import DEFAULT_TREE_SIZES
from tiny_models import VOCAB, tiny_model

IDS = torch.tensor([[5, 6, 7, 8]])


@pytest.fixture(scope="module")
def mm():
    return MedusaModel.from_base(tiny_model("llama"), MedusaConfig(num_heads=3))


@pytest.mark.parametrize("tree, message", [
    ([[0, 0]], r"no parent \[0\]"),
    ([[0], [0]], "duplicate path"),
    ([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], "only 3 heads"),
    ([[-1]], "ranks must be >= 0"),
    ([[0], "a"], "list of integer ranks"),
    ("[[0]]", "list of rank paths"),
])
def test_invalid_tree_is_refused(mm, tree, message):
    with pytest.raises(ValueError, match=message):
        mm.generate(IDS, max_new_tokens=2, tree=tree)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(do_sample=True, temperature=0.0), "temperature must be > 0"),
    (dict(do_sample=True, top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(do_sample=True, top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(do_sample=True, top_k=-1), "top_k must be an integer >= 1"),  # 0 turns top-k off, as in transformers
    (dict(max_new_tokens=True), r"max_new_tokens must be an integer >= 1, got True \(True/False is not a count\)"),
    (dict(do_sample="false"), "do_sample must be True or False, got 'false'"),  # a truthy string would sample
    (dict(eos_token_id="</s>"), r"eos_token_id must be a token id \(an int\) or a list of them, not '</s>'.*"
                                r"tokenizer.eos_token_id"),
    (dict(eos_token_id=[2, "</s>"]), "eos_token_id must be a token id"),
    (dict(pad_token_id="<pad>"), r"pad_token_id must be a token id \(an int\), not '<pad>'.*tokenizer.pad_token_id"),
])
def test_bad_generation_arguments(mm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        mm.generate(IDS, **kwargs)


def test_numpy_and_tensor_scalars_are_taken_as_numbers(mm):
    greedy = mm.generate(IDS, max_new_tokens=5).sequences
    assert torch.equal(mm.generate(IDS, max_new_tokens=np.int64(5)).sequences, greedy)
    assert torch.equal(mm.generate(IDS, max_new_tokens=torch.tensor(5), do_sample=np.bool_(False)).sequences, greedy)
    torch.manual_seed(0)
    sampled = mm.generate(IDS, max_new_tokens=5, do_sample=True, temperature=0.5, top_k=5).sequences
    torch.manual_seed(0)
    assert torch.equal(mm.generate(IDS, max_new_tokens=5, do_sample=True, temperature=torch.tensor(0.5),
                                   top_k=np.int64(5)).sequences, sampled)
    torch.manual_seed(0)
    assert torch.equal(mm.generate(IDS, max_new_tokens=5, do_sample=True, temperature=np.float32(0.5),
                                   top_k=torch.tensor(5)).sequences, sampled)


@pytest.mark.parametrize("ids, row, bad", [([[5, 6, VOCAB + 10]], 0, VOCAB + 10), ([[5, 6, 7], [5, -100, 7]], 1, -100)])
def test_token_ids_outside_the_vocabulary_are_refused(mm, ids, row, bad):
    with pytest.raises(ValueError, match=rf"input_ids\[{row}\] holds token ids \[{bad}\] outside the model's "
                                         rf"vocabulary \[0, {VOCAB}\); tokenize the prompts with the model's own "
                                         rf"tokenizer.*resize_token_embeddings"):
        mm.generate(torch.tensor(ids), max_new_tokens=2)


def test_bad_prompts(mm):
    with pytest.raises(ValueError, match="input_ids is empty"):
        mm.generate(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="LongTensor of shape"):
        mm.generate(torch.tensor([5, 6, 7]))
    with pytest.raises(ValueError, match="left-padded"):
        mm.generate(IDS, attention_mask=torch.tensor([[1, 1, 1, 0]]))
    with pytest.raises(ValueError, match="all padding"):
        mm.generate(IDS.repeat(2, 1), attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]]))
    # Padding between tokens: a sliding window would count it otherwise than transformers does.
    windowed = MedusaModel.from_base(tiny_model("mistral"), MedusaConfig(num_heads=2))
    with pytest.raises(ValueError, match=r"row 1 of attention_mask masks tokens between its first and last token, "
                                         r"which this model's sliding window \(\d+\) would count otherwise"):
        windowed.generate(IDS.repeat(2, 1), attention_mask=torch.tensor([[0, 1, 1, 1], [1, 0, 1, 1]]))
    with pytest.raises(ValueError, match=r"row 0 of input_ids .*pad_token_id=0.* masks tokens between"):
        windowed.generate(torch.tensor([[5, 0, 7]]))
    with pytest.raises(ValueError, match="batch size 1"):
        mm.generate(IDS.repeat(2, 1), streamer=SimpleNamespace(put=print, end=print))
    with pytest.raises(ValueError, match=r"attention_mask must be a tensor of input_ids' shape \(1, 4\), got list"):
        mm.generate(IDS, attention_mask=[[1, 1, 1, 1]])
    # No attention_mask: tokens equal to pad_token_id (0) are padding, as transformers' generate infers it.
    with pytest.raises(ValueError, match="left-padded, but input_ids .*pad_token_id=0 are padding"):
        mm.generate(torch.tensor([[5, 6, 0]]))
    with pytest.raises(ValueError, match="a row of input_ids .*pad_token_id=0.* is all padding"):
        mm.generate(torch.tensor([[5, 6, 7], [0, 0, 0]]))


def test_config_must_be_a_medusa_config_with_a_valid_tree():
    with pytest.raises(TypeError, match=r"config must be a MedusaConfig, got dict; .*MedusaConfig\(\*\*config\)"):
        MedusaModel.from_base(tiny_model("llama"), {"num_heads": 2})
    # The message generate(tree=[0, 1]) gives.
    with pytest.raises(ValueError, match="tree: each entry must be a non-empty list of integer ranks, got 0"):
        MedusaConfig(num_heads=2, tree=[0, 1])


def test_heads_left_behind_by_a_moved_base_model_are_refused_naming_the_fix():
    base = tiny_model("llama")
    mm = MedusaModel.from_base(base, MedusaConfig(num_heads=3))
    base.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"heads are in torch.float32 on cpu but the base model is in torch.bfloat16 "
                                         r"on cpu.*medusa_model.to\(torch.bfloat16\)"):
        mm.generate(IDS, max_new_tokens=2)
    assert mm.heads.blocks[0].layers[0].weight.dtype == torch.float32  # refused, not moved behind the caller's back
    mm.to(torch.bfloat16)
    assert mm.generate(IDS, max_new_tokens=2).sequences.shape == (1, 6)
    base.to("meta")
    with pytest.raises(ValueError, match="on cpu but the base model is in torch.bfloat16 on meta"):
        mm.generate(IDS, max_new_tokens=2)


def test_heads_for_another_model_are_refused(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="hidden_size=48 but the base model has 32"):
        MedusaModel.from_base(model, MedusaConfig(hidden_size=48))
    MedusaModel.from_base(tiny_model("llama", vocab_size=VOCAB + 8)).save_heads(tmp_path / "other")
    with pytest.raises(ValueError, match=f"vocab_size={VOCAB + 8} but the base model has {VOCAB}"):
        MedusaModel.from_pretrained(model, tmp_path / "other")


def test_unsupported_models_are_refused_up_front():
    mamba = AutoModelForCausalLM.from_config(transformers.MambaConfig(vocab_size=64, hidden_size=32,
                                                                      num_hidden_layers=2, state_size=4))
    with pytest.raises(UnsupportedModelError, match="recurrent or state-space"):
        MedusaModel.from_base(mamba)
    t5 = AutoModelForSeq2SeqLM.from_config(transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64,
                                                                 num_layers=1, num_heads=4))
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        MedusaModel.from_base(t5)
    flex = tiny_model("llama", _attn_implementation="flex_attention")
    with pytest.raises(UnsupportedModelError, match="attn_implementation='sdpa'"):
        MedusaModel.from_base(flex)


def test_a_peft_model_as_the_base_is_refused_naming_the_model_it_wraps():
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(UnsupportedModelError, match=r"is a peft model; pass .*peft_model.get_base_model\(\)"):
        MedusaModel.from_base(peft_model)


def test_wrong_kinds_of_argument_are_named(tmp_path):
    model = tiny_model("llama")
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2))
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ValueError, match="file is a file, not a folder"):
        mm.save_heads(tmp_path / "file")
    assert (tmp_path / "file").read_text() == "not a folder"
    with pytest.raises(TypeError, match="lora must be the peft model .*got LlamaForCausalLM"):
        mm.save_heads(tmp_path / "heads", lora=model)
    with pytest.raises(TypeError, match="path must be the adapter folder .*got NoneType"):
        MedusaModel.from_pretrained(model, None)
    with pytest.raises(ValueError, match=r"streamer must have put\(token_ids\) and end\(\) methods"):
        mm.generate(torch.tensor([[3, 5]]), max_new_tokens=2, streamer=object())


def test_a_tree_rank_past_the_heads_guesses_is_refused_before_decoding():
    """A rank at or past the vocabulary failed inside topk at the first step ("selected index k out of range")."""
    model = tiny_model("llama")
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2))
    vocab = model.get_output_embeddings().weight.shape[0]
    with pytest.raises(ValueError, match=rf"tree: rank in \[{vocab}\] is outside the top-{vocab} candidates"):
        mm.generate(torch.tensor([[3, 5]]), max_new_tokens=2, tree=[[vocab]])
    out = mm.generate(torch.tensor([[3, 5]]), max_new_tokens=2, tree=[[vocab - 1]], eos_token_id=[])
    assert out.sequences.shape == (1, 4)


def test_tree_tensors():
    tree = build_tree([[1], [0], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    # Sorted by depth then path: root, [0], [1], [0,0], [0,1], [1,0], [0,0,0].
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.parent.tolist() == [0, 0, 0, 1, 1, 2, 3]
    assert tree.rank.tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert tree.node_paths[6].tolist() == [0, 1, 3, 6] and tree.node_paths[5].tolist() == [0, 2, 5, 5]
    assert tree.tree_mask[6].tolist() == [True, True, False, True, False, False, True]
    assert tree.top_k == 2 and tree.max_depth == 3


def test_grow_tree_takes_the_most_valuable_nodes():
    # Head 0 is right 90% of the time at rank 0; head 1 only 10%: depth 2 loses to rank 1 of head 0.
    tree = grow_tree([[0.9, 0.08], [0.1, 0.05]], num_nodes=4)
    assert tree == [[0], [0, 0], [1]]
    for size in DEFAULT_TREE_SIZES:
        choices = default_tree(num_heads=4, num_nodes=size)
        assert len(choices) == size - 1 and build_tree(choices, num_heads=4).num_nodes == size


def test_save_and_load_round_trip(tmp_path):
    model = tiny_model("llama")
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2, num_layers=2, share_lm_head=False, tree=[[0], [0, 0]]))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in mm.heads.parameters():
            p.normal_()
    mm.save_heads(tmp_path / "heads")
    assert sorted(p.name for p in (tmp_path / "heads").iterdir()) == ["medusa_config.json", "medusa_heads.safetensors"]
    loaded = MedusaModel.from_pretrained(model, tmp_path / "heads")
    assert loaded.config == mm.config
    for (name, a), (_, b) in zip(mm.heads.state_dict().items(), loaded.heads.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.tensor([[5, 9, 11, 3, 7]])
    assert torch.equal(mm.generate(ids, max_new_tokens=12).sequences, loaded.generate(ids, max_new_tokens=12).sequences)
