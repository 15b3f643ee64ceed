"""Training data: distill's prompts with each text once, the conversations distill wrote (the prompt files themselves
are read by medusa_spec/prompts.py), chat-template tokenisation with an assistant-only loss mask, and padding or
packing into rows of at most `max_length` tokens."""

from __future__ import annotations

import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..prompts import Prompt, read_jsonl
from .repetition import DEGENERATE_CAUSES, degenerate, loop_start
from .store import read_records

# Used only when asked for (--plain-text): a model without a chat template is then trained,
# distilled and must be prompted in this format ("User: ...\n\nAssistant: ..." + eos), after the BOS token where
# the tokenizer puts one before plain text (plain_text_template).
PLAIN_TEXT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n\n"
    "{% else %}Assistant: {{ m['content'] }}{{ eos_token }}\n\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    loss_mask: list[bool]   # True on assistant tokens: the only training targets
    source: str | None = None  # the conversation's key (loop.conversation_key): which ones a run's steps read


# ---------------------------------------------------------------- prompts and conversations

def normal_text(text: str) -> str:
    """A prompt's text as compared for repeats: lowercased, whitespace folded."""
    return re.sub(r"\s+", " ", text.lower()).strip()


def unique_prompts(prompts: list[Prompt]) -> list[Prompt]:
    """`prompts` with each text once (the pools overlap: the same question in two collections; the first copy is
    kept), by normal_text of every turn. An id names the stored conversation (FILE_NAME:LINE, so a run resumes from
    any folder): two different prompts under one id, from two --prompts files of the same name, would store one's
    answers as the other's and skip the second on resume, so they are refused."""
    by_id: dict[str, Prompt] = {}
    seen, unique = set(), []
    for p in prompts:
        other = by_id.setdefault(p.id, p)
        if other.turns != p.turns:
            raise ValueError(f"two prompts have the id {p.id!r}: prompt ids are FILE_NAME:LINE, and two --prompts "
                             f"files are named {p.id.split(':')[0]!r}; give each file its own name")
        text = tuple(normal_text(t) for t in p.turns)
        if text not in seen:
            seen.add(text)
            unique.append(p)
    return unique


def read_conversations(path: str | Path, refuse_degenerate: bool = False) -> list[list[dict]]:
    """Conversations written by distill: one {"messages": [{"role", "content"}, ...]} per line of a
    JSONL file, or per record of a distill output folder (gzipped chunks, see store.py). refuse_degenerate (train's
    check): refuse them when most of their answers are degenerate (repetition.degenerate)."""
    path = Path(path)
    if path.is_dir():
        records = list(enumerate(read_records(path), start=1))
        if not records:
            raise ValueError(f"{path}: the folder holds no distilled conversations (part-*.jsonl.gz or open.jsonl)")
    else:
        records = read_jsonl(path)
    conversations = []
    for number, record in records:
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError(f"{path}:{number}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}} "
                             f"(the output of `medusa-spec distill`)")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{path}:{number}: the conversation has no assistant turn, so nothing to train on")
        conversations.append(messages)
    if refuse_degenerate:
        answers = [m["content"] for messages in conversations for m in messages if m["role"] == "assistant"]
        bad = sum(map(degenerate, answers))
        if bad > len(answers) / 2:
            raise ValueError(f"{path}: {bad} of its {len(answers)} answers are degenerate (empty, or fewer than "
                             f"three distinct words), so heads trained on them would learn nothing useful: "
                             f"{DEGENERATE_CAUSES}. Distill again into a new --output once the cause is fixed, or "
                             f"pass --allow-degenerate-data to train on them anyway")
    return conversations


# ---------------------------------------------------------------- chat template

def plain_text_template(tokenizer) -> str:
    """PLAIN_TEXT_TEMPLATE for `tokenizer`: after its BOS token where `tokenizer(text)` puts one first. A base model
    has only ever read text so (the chat templates of Llama and Gemma put it first too); without it one such model
    answered "User: How do I build a PC?\\n\\nAssistant:" with "Assistant Assistant ...", with it with an answer.
    The template holds the BOS token as text, as chat templates do: every rendering is then tokenized without
    special tokens."""
    first = tokenizer("a")["input_ids"][:1]
    adds_bos = tokenizer.bos_token_id is not None and first == [tokenizer.bos_token_id]
    return ("{{ bos_token }}" if adds_bos else "") + PLAIN_TEXT_TEMPLATE


def require_chat_template(tokenizer, plain_text: bool = False, source: str = "the tokenizer") -> None:
    """Refuse a tokenizer without a chat template, unless the plain-text format was asked for."""
    if tokenizer.chat_template:
        return
    if not plain_text:
        raise ValueError(f"{source} has no chat template, so prompts cannot be formatted as the model expects. "
                         f"Use an instruct/chat model, set tokenizer.chat_template, or pass --plain-text to use "
                         f"the plain 'User: ...\\n\\nAssistant: ...' format (then prompt the model that way too)")
    tokenizer.chat_template = plain_text_template(tokenizer)


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def tokenize_conversation(tokenizer, messages: list[dict], keep_loops: bool = False) -> Example:
    """Tokens of the rendered conversation; loss_mask marks each assistant turn (its end-of-turn
    marker included, so the heads also learn where an answer stops). An answer that ends in a loop
    (repetition.loop_start) has the loop left out of the loss, and cut off when it is the last turn, unless
    keep_loops. An answer marked `"cut": true` (distill stopped it: max_new_tokens reached, or a loop cut off) did
    not end there, so its end-of-turn marker, which the model never wrote, is left out of the loss.

    Assistant spans are found in characters by rendering growing prefixes, then mapped to tokens
    through offsets: robust to tokens merging across a boundary, and needs no `{% generation %}`
    markers in the template.
    """
    text = render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        through = render(tokenizer, messages[: i + 1])
        if not (text.startswith(before) and text.startswith(through)):
            raise ValueError("the chat template renders an earlier turn differently once later turns follow, so "
                             "assistant tokens cannot be located; train on single-turn conversations or use another "
                             "template")
        end = len(through)
        if message.get("cut"):
            content = message["content"]
            found = text.find(content, len(before), end) if content else len(before)
            if found >= 0:  # where the template put it (a template that rewrites it keeps the whole turn)
                end = found + len(content)
        spans.append((len(before), end))
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    loss_mask = [any(start <= begin < end for start, end in spans) for begin, _ in offsets]
    if keep_loops:
        return Example(input_ids, loss_mask)
    for n, (start, end) in enumerate(spans):
        answer = [i for i, (begin, _) in enumerate(offsets) if start <= begin < end]
        loop = loop_start([input_ids[i] for i in answer])
        if loop is None:
            continue
        if n == len(spans) - 1:  # the last answer: what follows the loop is only more of it
            return Example(input_ids[:answer[loop]], loss_mask[:answer[loop]])
        for i in answer[loop:]:  # later turns read the whole answer: it stays, out of the loss
            loss_mask[i] = False
    return Example(input_ids, loss_mask)


# ---------------------------------------------------------------- rows and batches

# Conversations each tokenizing process must get before more processes pay for their start.
PER_WORKER = 1000


def tokenize_conversations(tokenizer, conversations: list[list[dict]], keep_loops: bool = False,
                           workers: int | None = None) -> list[Example]:
    """tokenize_conversation over many conversations, in order, split over `workers` processes (default: the CPUs
    this process may use, shared among the machine's training processes, at most 16). Tokenizing is mostly Python,
    so one process uses one core, and a large data set took noticeably less time in two processes than in one,
    before the first training step."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cpus //= int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # accelerate / torchrun: each local process tokenizes
    workers = min(workers or min(cpus, 16), len(conversations) // PER_WORKER)
    if workers < 2 or "fork" not in multiprocessing.get_all_start_methods():  # Windows: one process
        return [tokenize_conversation(tokenizer, messages, keep_loops) for messages in conversations]
    size = -(-len(conversations) // workers)
    chunks = [conversations[i: i + size] for i in range(0, len(conversations), size)]
    # fork, not spawn: a spawned child imports the caller's __main__, which breaks a script without a main guard.
    # The children run no torch op, and the tokenizers library turns its own threads off in a forked child.
    with ProcessPoolExecutor(len(chunks), mp_context=multiprocessing.get_context("fork")) as pool:
        parts = pool.map(_tokenize_chunk, [tokenizer] * len(chunks), chunks, [keep_loops] * len(chunks))
        return [example for part in parts for example in part]


def _tokenize_chunk(tokenizer, conversations: list[list[dict]], keep_loops: bool) -> list[Example]:
    return [tokenize_conversation(tokenizer, messages, keep_loops) for messages in conversations]


def make_rows(examples: list[Example], max_length: int, pack: bool) -> list[list[Example]]:
    """Group examples into rows of at most `max_length` tokens: one per row (padding) or, with
    `pack`, consecutive examples sharing a row (each still attends only to itself).
    Longer examples are truncated; those left with no assistant token are dropped."""
    rows: list[list[Example]] = []
    used = max_length  # forces a new row for the first example
    for example in examples:
        example = Example(example.input_ids[:max_length], example.loss_mask[:max_length], example.source)
        if not any(example.loss_mask):
            continue
        if pack and used + len(example.input_ids) <= max_length:
            rows[-1].append(example)
            used += len(example.input_ids)
        else:
            rows.append([example])
            used = len(example.input_ids)
    return rows


def collate(rows: list[list[Example]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Rows -> right-padded tensors [B, T], T = the longest row.

    segment_ids: 1, 2, ... for the examples of a row, 0 on padding; position_ids restart at 0 for
    every example, so a packed example sees the same positions as it would alone.
    """
    length = max(sum(len(e.input_ids) for e in row) for row in rows)
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), length, dtype=torch.bool)
    segment_ids = torch.zeros(len(rows), length, dtype=torch.long)
    position_ids = torch.zeros(len(rows), length, dtype=torch.long)
    for b, row in enumerate(rows):
        start = 0
        for segment, example in enumerate(row, start=1):
            end = start + len(example.input_ids)
            input_ids[b, start:end] = torch.tensor(example.input_ids)
            loss_mask[b, start:end] = torch.tensor(example.loss_mask)
            segment_ids[b, start:end] = segment
            position_ids[b, start:end] = torch.arange(end - start)
            start = end
    return {"input_ids": input_ids, "loss_mask": loss_mask, "segment_ids": segment_ids, "position_ids": position_ids}
