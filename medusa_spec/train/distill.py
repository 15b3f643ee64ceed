"""Self-distillation: the base model answers prompts through its own chat template, and the
conversations are stored (one {"id", "messages"} record each; see store.py).

Decoding runs in the continuous-batching engine (engine.py): many rows at once, a finished row
refilled at once. A multi-turn prompt is answered turn by turn, each later turn asked after the
model's own earlier answers. Two sources of more prompts, both written by the model itself:
`self_prompts` opens the chat template at the user turn and samples what a user would ask
(Magpie), and `follow_ups` does the same after a first answer, so a share of the conversations
gets a second, model-written user turn, answered again. Resumable: prompts whose id is stored
are skipped.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import time
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..accept import Sampling
from ..inputs import resolve_sampling
from ..loop import eval_mode
from ..prompts import Prompt
from .data import normal_text, render, unique_prompts
from .engine import Request, decode_stream
from .fields import option, shared
from .repetition import AnswerWatch
from .store import ConversationStore, complete_lines, is_folder, read_gzip, record_model

SELF_PROMPTS = "self_prompts.jsonl"  # the round under way appends here, a line per prompt
SEALED_PROMPTS = SELF_PROMPTS + ".gz"  # and, finished, folds it into this: tens of thousands of prompts, gzipped
PROMPT_START = b'{"prompt": '  # how every line of SELF_PROMPTS begins
_SENTINEL = "\x00medusa-spec-user-turn\x00"


@dataclass
class DistillConfig:
    """Settings of `medusa-spec distill` (the flags are generated from these fields)."""

    model: str | None = shared(None)
    prompts: list[str] = shared(None, required=True)
    output: str = shared(None, required=True)
    prompt_field: str | None = shared(None)
    system_prompt: str | None = shared(None)
    batch_size: int = shared(64)
    max_new_tokens: int = shared(512)
    max_prompt_tokens: int = option(2048, "a longer prompt is skipped (a longer later turn ends the conversation)")
    # The answers' sampling, as generate's (None: the model's generation_config, else transformers' default).
    do_sample: bool | None = shared(None)
    temperature: float | None = shared(None)
    top_k: int | None = shared(None)
    top_p: float | None = shared(None)
    self_prompts: int = option(0, f"first have the model write this many user prompts of its own (Magpie), kept "
                                  f"deduplicated in the output folder's {SEALED_PROMPTS}, and answer them too")
    follow_ups: float = option(0.0, "share of single-turn conversations that get a model-written second user turn, "
                                    "answered again")
    prompt_temperature: float = option(1.0, "sampling temperature of model-written prompts and follow-ups, drawn "
                                            "from the whole distribution (--top-k and --top-p are the answers')")
    keep_loops: bool = shared(False)
    max_degenerate: float = option(0.5, "stop once more than this share of the last --degenerate-window answers is "
                                        "degenerate (empty, or fewer than three distinct words), the sign of a "
                                        "prompt format the model does not know; 1: never stop")
    degenerate_window: int = option(100, "answers --max-degenerate looks back over")
    chunk_size: int = option(2000, "conversations per gzipped chunk of an output folder")
    # None: bf16 where the device computes it natively (flags.fast_dtype): more answer tokens/s than fp32 on an
    # AVX512-BF16 CPU (scripts/bench_distill.py) and the usual GPU dtype, while a CPU without it emulates bf16 far
    # slower than fp32. The answers are the model's own up to bf16 rounding.
    dtype: str | None = shared(None)
    device: str | None = shared(None)
    plain_text: bool = shared(False)
    server: str | None = option(None, "answer through an OpenAI-compatible server at this URL (vLLM, SGLang, "
                                      "llama.cpp's server) instead of a local model; sampling settings not given "
                                      "take transformers' defaults there (the model's generation_config is not read)")
    server_model: str | None = option(None, "the model name the server serves (with --server; default: its first)")
    concurrency: int = option(16, "requests in flight at once (with --server)")
    seed: int = shared(0)

    def __post_init__(self):
        for name in ("batch_size", "max_new_tokens", "max_prompt_tokens", "chunk_size", "concurrency",
                     "degenerate_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.self_prompts < 0:
            raise ValueError(f"--self-prompts must be >= 0 (0: none), got {self.self_prompts}")
        if not 0 <= self.max_degenerate <= 1:
            raise ValueError(f"--max-degenerate is a share of the answers, in [0, 1] (1: never stop); got "
                             f"{self.max_degenerate}")
        if not 0 <= self.follow_ups <= 1:
            raise ValueError(f"--follow-ups is a share of the conversations, in [0, 1]; got {self.follow_ups}")
        if not self.prompt_temperature >= 0:  # nan too
            raise ValueError(f"--prompt-temperature must be >= 0 (0: greedy), got {self.prompt_temperature}")
        if self.server_model is not None and self.server is None:
            raise ValueError("--server-model names the model a --server serves: add --server URL, or drop it")
        if self.concurrency != type(self).__dataclass_fields__["concurrency"].default and self.server is None:
            raise ValueError(f"--concurrency {self.concurrency} sets the requests in flight to a --server; local "
                             f"distillation runs --batch-size rows at once: add --server URL, or drop it")


def model_identity(model, tokenizer) -> dict:
    """What names the model whose answers a data folder holds (store.record_model): its shape, its tokenizer's
    vocabulary, and `weights`: the sum of |w| over 8 of its parameters spread from the first to the last, which a
    float32, bfloat16 or float16 load of one model gives within store.WEIGHTS_RTOL (rounding is unbiased) and a
    fine-tune moves; not its path, which differs from machine to machine. Offloaded (meta) weights are left out."""
    config = model.config.get_text_config(decoder=True)
    embeddings = model.get_input_embeddings().weight
    vocabulary = json.dumps(sorted(tokenizer.get_vocab().items())).encode()
    identity = {"model_type": getattr(config, "model_type", None),
                "num_hidden_layers": getattr(config, "num_hidden_layers", None),
                "hidden_size": embeddings.shape[1], "vocab_size": embeddings.shape[0],
                "tokenizer": hashlib.sha256(vocabulary).hexdigest()[:16]}
    parameters = [p for _, p in model.named_parameters()]
    if not any(p.is_meta for p in parameters):
        picked = [parameters[round(i * (len(parameters) - 1) / 7)] for i in range(8)]
        with torch.no_grad():
            identity["weights"] = [float(f"{float(p.float().abs().sum()):.6g}") for p in picked]
    return identity


def eos_ids(base_model, tokenizer) -> set[int]:
    eos = getattr(base_model.generation_config, "eos_token_id", None)
    ids = set([eos] if isinstance(eos, int) else eos or [])
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


def _ids(tokenizer, text: str) -> list[int]:
    # The template already holds any BOS.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def user_turn_opening(tokenizer, messages: list[dict]) -> str:
    """The rendered conversation up to where the next user message's text would begin (Magpie)."""
    text = render(tokenizer, messages + [{"role": "user", "content": _SENTINEL}])
    if _SENTINEL not in text:
        raise ValueError("the chat template drops the user's message, so the model cannot be asked to write one; "
                         "use --self-prompts 0 --follow-ups 0")
    return text[: text.index(_SENTINEL)]


def _decode(tokenizer, tokens: list[int], eos: set[int]) -> str:
    return tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True).strip()


def answer_sampling(base_model, cfg: DistillConfig) -> Sampling:
    """How answers are drawn: --do-sample, --temperature, --top-k, --top-p as `medusa-spec generate` resolves
    them (the flag, else the model's generation_config, else transformers' default: greedy)."""
    return resolve_sampling(base_model, cfg.do_sample, cfg.temperature, cfg.top_k, cfg.top_p)


def prompt_sampling(cfg: DistillConfig) -> Sampling:
    """How model-written prompts are drawn: the whole distribution at --prompt-temperature (0: greedy)."""
    return Sampling(cfg.prompt_temperature > 0, cfg.prompt_temperature or 1.0)


def answer(base_model, tokenizer, conversations: list[list[dict]], cfg: DistillConfig) -> tuple[list[str], int]:
    """One reply per conversation (each ending in a user turn); returns (replies, new tokens)."""
    eos = eos_ids(base_model, tokenizer)
    sampling = answer_sampling(base_model, cfg)
    requests = deque(Request(i, _ids(tokenizer, render(tokenizer, m, add_generation_prompt=True)), sampling)
                     for i, m in enumerate(conversations))
    replies, count = [""] * len(conversations), 0
    for i, tokens in decode_stream(base_model, requests, eos, rows=cfg.batch_size, max_new_tokens=cfg.max_new_tokens,
                                   pad_token_id=tokenizer.pad_token_id or 0, seed=cfg.seed):
        replies[i], count = _decode(tokenizer, tokens, eos), count + len(tokens)
    return replies, count


def read_self_prompts(folder: Path, cut: bool = False) -> list[str]:
    """The model-written prompts kept in `folder`, in the order written (prompt n is SELF_PROMPTS:n): the sealed
    ones (SEALED_PROMPTS), then those of the round under way (SELF_PROMPTS). `cut`: as their writer (complete_lines)."""
    sealed_path, path = folder / SEALED_PROMPTS, folder / SELF_PROMPTS
    sealed = []
    if sealed_path.is_file():
        sealed = _prompt_texts(read_gzip(sealed_path, "move it away to write the prompts anew"), sealed_path)
    if not path.is_file():
        return sealed
    if cut:  # a last line a kill cut short is cut off (the next prompt starts a line)
        complete_lines(path, cut=PROMPT_START)
    current = _prompt_texts(complete_lines(path), path)
    if current and sealed[-len(current):] == current:  # killed between sealing and removing SELF_PROMPTS
        if cut:  # as the writer: finish the removal, so the prompts written next start a file of their own
            path.unlink()
        return sealed
    return sealed + current


def seal_self_prompts(folder: Path) -> None:
    """Fold SELF_PROMPTS into SEALED_PROMPTS (written whole under another name, then renamed) and remove it: the
    prompts of finished rounds are kept gzipped, as the conversations' chunks are (store.py)."""
    path = folder / SELF_PROMPTS
    if not path.is_file():
        return
    lines = "".join(json.dumps({"prompt": t}, ensure_ascii=False) + "\n" for t in read_self_prompts(folder))
    partial = folder / (SEALED_PROMPTS + ".partial")
    partial.write_bytes(gzip.compress(lines.encode("utf-8"), mtime=0))  # mtime 0: the same prompts, the same bytes
    os.replace(partial, folder / SEALED_PROMPTS)
    path.unlink()


def _prompt_texts(data: bytes, source: Path) -> list[str]:
    texts = []
    for number, line in enumerate(data.decode("utf-8").split("\n"), start=1):  # not splitlines: see store.py
        try:
            texts += [json.loads(line)["prompt"]] if line.strip() else []
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{source}:{number}: not a model-written prompt ({{\"prompt\": ...}}); it is distill's "
                             f"own file: move it away to write the prompts anew") from None
    return texts


def write_self_prompts(base_model, tokenizer, cfg: DistillConfig, known: list[Prompt], progress: bool) -> list[str]:
    """Grow the output folder's prompts to cfg.self_prompts model-written prompts, each new (by lowercased,
    whitespace-folded text) against `known` and the ones kept; returns every kept one (read_self_prompts)."""
    if not is_folder(cfg.output):
        raise ValueError(f"--self-prompts needs a folder --output (where {SEALED_PROMPTS} is kept)")
    folder = Path(cfg.output)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / SELF_PROMPTS
    written = read_self_prompts(folder, cut=True)
    seen = {normal_text(t) for p in known for t in p.turns} | {normal_text(t) for t in written}
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    opening = _ids(tokenizer, user_turn_opening(tokenizer, system))
    eos = eos_ids(base_model, tokenizer)
    bar = tqdm(total=cfg.self_prompts, initial=len(written), unit="prompt", disable=not progress, desc="self-prompts")
    tries = 0
    while len(written) < cfg.self_prompts:
        want = cfg.self_prompts - len(written)
        if tries > 4 * cfg.self_prompts + 64:
            raise ValueError(f"the model repeats itself: {len(written)} distinct prompts after {tries} tries; "
                               f"raise --prompt-temperature or ask for fewer --self-prompts")
        batch = deque(Request(i, opening, prompt_sampling(cfg), 160) for i in range(min(want * 2, 256)))
        tries += len(batch)
        with open(path, "a", encoding="utf-8") as out:
            for _, tokens in decode_stream(base_model, batch, eos, rows=cfg.batch_size,
                                           pad_token_id=tokenizer.pad_token_id or 0,
                                           seed=cfg.seed + tries + len(written)):
                text = _decode(tokenizer, tokens, eos)
                # An unfinished prompt (no end of turn within 160 tokens) or a repeat is dropped.
                if not tokens or tokens[-1] not in eos or len(text) < 8 or normal_text(text) in seen:
                    continue
                if len(written) < cfg.self_prompts:
                    seen.add(normal_text(text))
                    written.append(text)
                    out.write(json.dumps({"prompt": text}, ensure_ascii=False) + "\n")  # PROMPT_START
                    out.flush()  # whole lines on disk as they come: a kill loses at most the prompt being written
                    bar.update(1)
    bar.close()
    seal_self_prompts(folder)
    return written


def _wants_follow_up(pid: str, share: float) -> bool:
    """A stable choice per prompt id, so a resumed run picks the same conversations."""
    return zlib.crc32(pid.encode()) % 10_000 < share * 10_000


def distill(base_model, tokenizer, prompts: list[Prompt], cfg: DistillConfig, progress: bool = True) -> dict:
    """Answer every prompt not yet in cfg.output and store the conversations; returns counts.
    (cfg.model and cfg.prompts only say where `base_model` and `prompts` came from.)"""
    with eval_mode(base_model):
        return _distill(base_model, tokenizer, prompts, cfg, progress)


def _distill(base_model, tokenizer, prompts: list[Prompt], cfg: DistillConfig, progress: bool) -> dict:
    unique = unique_prompts(prompts)  # an id clash fails here, before any prompt is written
    record_model(cfg.output, model_identity(base_model, tokenizer))  # another model's folder: refused, untouched
    if cfg.self_prompts and any(p.id.rsplit(":", 1)[0] == SELF_PROMPTS for p in prompts):
        # Their ids would clash with the model's own prompts' (FILE_NAME:LINE) once those are written.
        raise ValueError(f"a --prompts file is named {SELF_PROMPTS}, the name --self-prompts keeps the model's own "
                         f"prompts under in --output: rename that file (or leave it out: --self-prompts reads the "
                         f"output folder's own {SELF_PROMPTS})")
    if cfg.self_prompts:
        written = write_self_prompts(base_model, tokenizer, cfg, unique, progress)
        prompts = prompts + [Prompt(f"{SELF_PROMPTS}:{n}", (text,)) for n, text in enumerate(written, start=1)]
        unique = unique_prompts(prompts)
    store = ConversationStore(cfg.output, cfg.chunk_size)
    todo = [p for p in unique if p.id not in store.done]
    # Similar lengths side by side, shortest first: conversations are stored soonest (the cache is
    # allocated whole at the start, so memory trouble shows at once whatever the order).
    todo.sort(key=lambda p: len(p.turns[0]))
    stats = {"prompts": len(prompts), "duplicates": len(prompts) - len(unique),
             "skipped_finished": len(unique) - len(todo), "written": 0,
             "skipped_too_long": 0, "follow_ups": 0, "new_tokens": 0}
    watch = AnswerWatch(cfg.max_degenerate, cfg.degenerate_window)
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    conversations = {p.id: list(system) for p in todo}
    turns = {p.id: list(p.turns) for p in todo}
    eos = eos_ids(base_model, tokenizer)
    answers, asks = answer_sampling(base_model, cfg), prompt_sampling(cfg)

    def ask(pid: str):
        """The request for the conversation's next user turn, or None when it is too long."""
        messages = conversations[pid] + [{"role": "user", "content": turns[pid].pop(0)}]
        ids = _ids(tokenizer, render(tokenizer, messages, add_generation_prompt=True))
        if len(ids) > cfg.max_prompt_tokens:
            return None
        conversations[pid] = messages
        return Request(pid, ids, answers)

    requests = deque()
    for p in todo:
        request = ask(p.id)
        if request is None:
            stats["skipped_too_long"] += 1
        else:
            requests.append(request)

    start = time.perf_counter()
    bar = tqdm(total=len(requests), unit="conv", disable=not progress, desc=f"distill -> {Path(cfg.output).name}")
    pending = []
    try:
        for key, tokens in decode_stream(base_model, requests, eos, rows=cfg.batch_size,
                                         max_new_tokens=cfg.max_new_tokens,
                                         capacity=cfg.max_prompt_tokens + cfg.max_new_tokens,
                                         pad_token_id=tokenizer.pad_token_id or 0, seed=cfg.seed,
                                         stop_loops=not cfg.keep_loops):
            text = _decode(tokenizer, tokens, eos)
            if isinstance(key, tuple):  # a model-written follow-up question: ask it if it is usable
                pid = key[0]
                if tokens and tokens[-1] in eos and len(text) >= 8:
                    turns[pid].append(text)
                    request = ask(pid)
                    if request is not None:
                        stats["follow_ups"] += 1
                        requests.appendleft(request)
                        continue
                pending.append({"id": pid, "messages": conversations.pop(pid)})
            else:
                pid = key
                stats["new_tokens"] += len(tokens)
                # Stopped before its end of turn (max_new_tokens, a loop cut off): marked, so training leaves out
                # the end-of-turn marker the chat template puts after it.
                cut = {} if tokens and tokens[-1] in eos else {"cut": True}
                conversations[pid].append({"role": "assistant", "content": text, **cut})
                if watch.push(text, bool(cut)):  # the finished conversations are stored below, as at any stop
                    raise ValueError(watch.stop_message(cfg.output))
                request = ask(pid) if turns[pid] else None
                if request is not None:
                    requests.appendleft(request)  # the next turn now, so the conversation closes soon
                    continue
                single = len(conversations[pid]) == len(system) + 2
                if single and cfg.follow_ups and _wants_follow_up(pid, cfg.follow_ups):
                    opening = _ids(tokenizer, user_turn_opening(tokenizer, conversations[pid]))
                    if len(opening) + 160 <= cfg.max_prompt_tokens:
                        requests.appendleft(Request((pid, "ask"), opening, asks, 160))
                        continue
                pending.append({"id": pid, "messages": conversations.pop(pid)})
            if len(pending) >= 16:
                batch, pending = pending, []  # handed over first: a Ctrl-C inside the write stores nothing twice
                store.append(batch)
                stats["written"] += len(batch)
            bar.update(stats["written"] + len(pending) - bar.n)  # each conversation as it ends, stored in sixteens
            # A dict, not keywords, which tqdm would sort: tokens/s first, the answers' shares beside it.
            bar.set_postfix({"tok_per_s": f"{stats['new_tokens'] / (time.perf_counter() - start):.1f}",
                             **watch.shares()})
    finally:  # finished conversations are kept whatever ends the run (a Ctrl-C included)
        pending = [r for r in pending if r["id"] not in store.done]
        store.append(pending)
        stats["written"] += len(pending)
    bar.close()
    stats.update(answers=watch.answers, degenerate=watch.degenerate, cut=watch.cut)
    stats["seconds"] = round(time.perf_counter() - start, 1)
    stats["tokens_per_second"] = round(stats["new_tokens"] / max(stats["seconds"], 1e-9), 1)
    return stats
