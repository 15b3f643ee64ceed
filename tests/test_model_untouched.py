"""generate() leaves the user's model as it found it, in every thread: no attribute set on any module,
other threads' forwards computed exactly as with nothing running, and the attention implementation read
at each call, not when the heads were attached."""

import sys
import threading

import pytest
import torch

from medusa_spec import MedusaConfig, MedusaModel, UnsupportedModelError
from tiny_models import VOCAB, tiny_model

TREE = [[0], [1], [0, 0], [1, 0], [0, 0, 0]]


def medusa(model):
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=3))
    torch.manual_seed(0)
    with torch.no_grad():  # random heads: the zero-initialised blocks perturbed, so trees of many nodes are verified
        for p in mm.heads.parameters():
            p.normal_(0, 0.5)
        # transformers installs hooks (and flags so on the model) at the first forward asking for hidden states
        model(prompt(2, seed=0), output_hidden_states=True)
    return mm.eval()  # as generate() sets the heads, so the modules' state before and after compares


def prompt(length, seed):
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


class CallbackStreamer:
    """A streamer that runs `callback` at its first put: generate() is then inside its decoding block."""

    def __init__(self, callback):
        self.callback, self.called = callback, False

    def put(self, tokens):
        if not self.called:
            self.called = True
            self.callback()

    def end(self):
        pass


def module_state(model):
    return {name: dict(vars(module)) for name, module in model.named_modules()}


def test_a_plain_forward_in_another_thread_during_generate_is_bit_identical():
    mm = medusa(tiny_model("llama"))
    before = module_state(mm)
    x = prompt(8, seed=1)  # 8 rows: the size the decoding loop computes column-wise
    with torch.no_grad():
        expected = mm.base_model(x).logits
    seen = {}

    def other_thread():
        seen["state"] = module_state(mm)
        with torch.no_grad():
            seen["logits"] = mm.base_model(x).logits

    def during_generate():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()

    mm.generate(prompt(6, seed=2), max_new_tokens=8, eos_token_id=[], tree=TREE,
                streamer=CallbackStreamer(during_generate))
    assert torch.equal(seen["logits"], expected)
    assert seen["state"] == before  # no attribute set on any module, even while generate runs
    assert module_state(mm) == before


def test_an_error_inside_generate_leaves_this_thread_computing_as_before():
    mm = medusa(tiny_model("llama"))
    before = module_state(mm)
    x = prompt(8, seed=1)
    with torch.no_grad():
        expected = mm.base_model(x).logits

    def interrupt():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        mm.generate(prompt(6, seed=2), max_new_tokens=8, eos_token_id=[], tree=TREE,
                    streamer=CallbackStreamer(interrupt))
    assert module_state(mm) == before
    with torch.no_grad():
        assert torch.equal(mm.base_model(x).logits, expected)


def test_concurrent_generate_calls_equal_sequential_ones():
    mm = medusa(tiny_model("llama"))
    before = module_state(mm)
    prompts = [prompt(5 + i, seed=10 + i) for i in range(4)]
    sequential = [mm.generate(p, max_new_tokens=12, eos_token_id=[], tree=TREE).sequences for p in prompts]
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave inside every step, entries and exits included
    results, errors = {}, []
    start = threading.Barrier(len(prompts))
    seen_states = []

    def run(i):
        try:
            start.wait()
            for repeat in range(3):
                streamer = CallbackStreamer(lambda: seen_states.append(module_state(mm)))
                out = mm.generate(prompts[i], max_new_tokens=12, eos_token_id=[], tree=TREE, streamer=streamer)
                results[i, repeat] = out.sequences
        except Exception as error:  # reported below with the thread it came from
            errors.append((i, repeat, repr(error)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch_interval)
    assert not errors
    for (i, _), sequences in results.items():
        assert torch.equal(sequences, sequential[i]), f"prompt {i}"
    assert all(state == before for state in seen_states)
    assert module_state(mm) == before


def test_switching_to_eager_after_building_keeps_padded_batches_exact():
    model = tiny_model("llama")
    assert model.config._attn_implementation == "sdpa"
    mm = medusa(model)
    model.set_attn_implementation("eager")  # eager adds a float mask to its scores; sdpa took a boolean one
    rows = [prompt(9, seed=20)[0], prompt(4, seed=21)[0]]
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, 9 - len(row):], mask[b, 9 - len(row):] = row, 1
    out = mm.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[], tree=TREE)
    for b, row in enumerate(rows):
        with torch.no_grad():
            expected = model.generate(row[None], max_new_tokens=12, do_sample=False, eos_token_id=None)[0, len(row):]
        assert torch.equal(out.sequences[b, 9:], expected), f"row {b}"


def test_switching_to_an_unmaskable_attention_after_building_is_refused():
    model = tiny_model("llama")
    mm = medusa(model)
    model.set_attn_implementation("flex_attention")
    with pytest.raises(UnsupportedModelError, match=r"flex_attention.*set_attn_implementation\('sdpa'\)"):
        mm.generate(prompt(6, seed=3), max_new_tokens=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: no column-wise copy of the model
def test_generate_writes_no_training_flag_on_a_model_in_train_mode(dtype, monkeypatch):
    """A model in train mode (dropout 0.5) decodes as in eval mode, losslessly, and not one of the caller's modules has
    its `training` written, even for a moment: another thread training it keeps its dropout throughout, and two
    overlapping calls cannot leave it in eval mode."""
    model = tiny_model("gpt2", embd_pdrop=0.5, attn_pdrop=0.5, resid_pdrop=0.5).to(dtype)
    mm = medusa(model)
    ids = prompt(6, seed=4)
    expected = mm.generate(ids, max_new_tokens=10, eos_token_id=[], tree=TREE).sequences
    if dtype == torch.float32:
        with torch.no_grad():
            assert torch.equal(expected, model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None))
    mm.train()
    callers = {id(m) for m in mm.modules()}
    writes, seen = [], []
    setattr_ = torch.nn.Module.__setattr__

    def recording(module, name, value):
        if name == "training" and id(module) in callers:
            writes.append(type(module).__name__)
        setattr_(module, name, value)

    def other_thread():  # what a thread training the model sees while generate runs
        seen.append(all(m.training for m in mm.modules()))

    def during_generate():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()

    monkeypatch.setattr(torch.nn.Module, "__setattr__", recording)
    torch.manual_seed(0)
    out = mm.generate(ids, max_new_tokens=10, eos_token_id=[], tree=TREE, streamer=CallbackStreamer(during_generate))
    assert writes == []
    assert seen == [True]
    assert torch.equal(out.sequences, expected)
    assert all(m.training for m in mm.modules())
