"""Self-distillation: the base model answers the prompts through its own chat template; the
conversations are appended to a JSONL file, one {"id", "messages"} per line.

Batched (left-padded) generation; a multi-turn prompt is answered turn by turn, each later turn
asked after the model's own earlier answers. Resumable: prompts whose id is already in the
output are skipped, and a line cut short by a kill is dropped before appending.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .data import Prompt, render
from .options import option


@dataclass
class DistillConfig:
    """Settings of `medusa-spec distill` (the flags are generated from these fields)."""

    model: str = option(None, "local folder of the base model and tokenizer (save_pretrained layout)", required=True)
    prompts: list[str] = option(None, "prompt JSONL files, each FILE or FILE:N (the first N prompts of FILE)",
                                required=True)
    output: str = option(None, "conversation JSONL to append to (prompts already in it are skipped)", required=True)
    prompt_field: str | None = option(None, "the prompt's field in every file (default: read from the first record)")
    system_prompt: str | None = option(None, "a system message put before every conversation")
    batch_size: int = option(16, "prompts generated together")
    max_new_tokens: int = option(512, "tokens per answer at most")
    max_prompt_tokens: int = option(2048, "a longer prompt is skipped (a longer later turn ends the conversation)")
    do_sample: bool = option(False, "sample instead of greedy decoding")
    temperature: float = option(0.7, "sampling temperature (with --do-sample)")
    top_p: float = option(0.95, "nucleus sampling mass (with --do-sample)")
    dtype: str = option("auto", "dtype to load the model in", choices=("auto", "float32", "bfloat16", "float16"))
    device: str | None = option(None, "torch device (default: cuda if available, else cpu)")
    plain_text: bool = option(False, "the tokenizer has no chat template: use the plain 'User:/Assistant:' format")
    seed: int = option(0, "seed for sampling")


def finished_ids(output: Path) -> set[str]:
    """Ids already in `output`; truncates a final line left incomplete by a kill."""
    if not output.is_file():
        return set()
    data = output.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]  # everything up to the last newline
    if len(complete) != len(data):
        with open(output, "r+b") as f:
            f.truncate(len(complete))
    ids = set()
    for number, line in enumerate(complete.decode("utf-8").splitlines(), start=1):
        if line.strip():
            try:
                ids.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{output}:{number}: not a distill record; write to a new --output file") from None
    return ids


def _eos_ids(base_model, tokenizer) -> set[int]:
    eos = getattr(base_model.generation_config, "eos_token_id", None)
    ids = set([eos] if isinstance(eos, int) else eos or [])
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


def _prompt_length(tokenizer, messages: list[dict]) -> int:
    return len(tokenizer(render(tokenizer, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"])


def answer(base_model, tokenizer, conversations: list[list[dict]], cfg: DistillConfig) -> tuple[list[str], int]:
    """One generated reply per conversation (each ending in a user turn); returns (replies, new tokens)."""
    texts = [render(tokenizer, messages, add_generation_prompt=True) for messages in conversations]
    # The template already holds any BOS; left padding so every row continues from its last column.
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    batch = batch.to(base_model.device)
    sampling = {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p} if cfg.do_sample else {"do_sample": False}
    with torch.inference_mode():
        sequences = base_model.generate(**batch, max_new_tokens=cfg.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                        **sampling)
    new = sequences[:, batch["input_ids"].shape[1]:].tolist()
    eos = _eos_ids(base_model, tokenizer)
    replies, count = [], 0
    for tokens in new:
        length = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))  # through the first eos
        count += length
        replies.append(tokenizer.decode(tokens[:length], skip_special_tokens=True).strip())
    return replies, count


def converse(base_model, tokenizer, prompts: list[Prompt], cfg: DistillConfig) -> tuple[dict[str, list[dict]], int]:
    """Answer a batch of prompts turn by turn: turn t of every prompt that has one goes in one
    generate call, after the model's own answers to the earlier turns. Returns ({id: messages}, new
    tokens); a prompt over max_prompt_tokens is left out, a later turn over it ends its conversation."""
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    conversations = {p.id: list(system) for p in prompts}
    active = {p.id: p for p in prompts}
    new_tokens, turn = 0, 0
    while active:
        asking = []
        for pid, prompt in list(active.items()):
            messages = conversations[pid] + [{"role": "user", "content": prompt.turns[turn]}]
            too_long = _prompt_length(tokenizer, messages) > cfg.max_prompt_tokens
            if too_long or turn + 1 == len(prompt.turns):
                del active[pid]
            if too_long:
                if turn == 0:
                    del conversations[pid]
                continue
            conversations[pid] = messages
            asking.append(pid)
        turn += 1
        if asking:
            replies, count = answer(base_model, tokenizer, [conversations[pid] for pid in asking], cfg)
            for pid, reply in zip(asking, replies):
                conversations[pid].append({"role": "assistant", "content": reply})
            new_tokens += count
    return conversations, new_tokens


def distill(base_model, tokenizer, prompts: list[Prompt], cfg: DistillConfig, progress: bool = True) -> dict:
    """Answer every prompt not yet in cfg.output and append the conversations; returns counts.
    (cfg.model and cfg.prompts only say where `base_model` and `prompts` came from.)"""
    output = Path(cfg.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = finished_ids(output)
    todo = [p for p in prompts if p.id not in done]
    # Similar lengths in one batch waste less on padding; longest first, so memory trouble shows early.
    todo.sort(key=lambda p: -len(p.turns[0]))
    stats = {"prompts": len(prompts), "skipped_finished": len(prompts) - len(todo), "written": 0,
             "skipped_too_long": 0, "new_tokens": 0}
    base_model.eval()
    start = time.perf_counter()
    bar = tqdm(total=len(todo), unit="prompt", disable=not progress, desc=f"distill -> {output.name}")
    with open(output, "a", encoding="utf-8") as out:
        for first in range(0, len(todo), cfg.batch_size):
            batch = todo[first: first + cfg.batch_size]
            conversations, new_tokens = converse(base_model, tokenizer, batch, cfg)
            for pid, messages in conversations.items():
                out.write(json.dumps({"id": pid, "messages": messages}, ensure_ascii=False) + "\n")
            out.flush()
            os.fsync(out.fileno())  # a finished batch survives even a machine crash
            stats["written"] += len(conversations)
            stats["skipped_too_long"] += len(batch) - len(conversations)
            stats["new_tokens"] += new_tokens
            bar.update(len(batch))
            bar.set_postfix(tok_per_s=f"{stats['new_tokens'] / (time.perf_counter() - start):.0f}")
    bar.close()
    stats["tokens_per_second"] = round(stats["new_tokens"] / max(time.perf_counter() - start, 1e-9), 1)
    return stats
