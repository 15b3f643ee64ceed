"""Distillation through an OpenAI-compatible server (vLLM, SGLang, llama.cpp's server,
`transformers serve`): the scale-out route for models too large for this process.

The same conversations as local distillation (turn by turn, each later turn asked after the
model's own answers), sent `concurrency` at a time to `POST {url}/v1/chat/completions`, stored
the same way (store.py) and resumable the same way: conversations already stored are skipped.
"""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from tqdm.auto import tqdm

from ..inputs import resolve_sampling
from ..prompts import Prompt
from .data import unique_prompts
from .repetition import AnswerWatch
from .store import ConversationStore, record_model


class ServerError(RuntimeError):
    """The server refused a request or answered something that is not a chat completion."""


# A busy, restarting or overloaded server answers 429 / 5xx, drops a connection or a reply midway: such a request
# is sent again after 1, 2, 4, ... seconds before the run stops.
TRIES, BACKOFF_SECONDS = 5, 1.0


def _call(url: str, payload: dict | None, timeout: float) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    for attempt in range(TRIES):
        request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            failure = f"{url} answered HTTP {err.code}: {err.read().decode(errors='replace')[:300]}"
            if err.code != 429 and err.code < 500:  # the request itself is refused: sending it again won't help
                raise ServerError(failure) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as err:
            failure = f"cannot reach {url} ({err!r}); start the server, or check --server (e.g. http://127.0.0.1:8000)"
        except json.JSONDecodeError:
            failure = f"{url} did not answer JSON; is --server an OpenAI-compatible server?"
        if attempt + 1 < TRIES:
            time.sleep(BACKOFF_SECONDS * 2 ** attempt)
    raise ServerError(f"{failure} (tried {TRIES} times)")


def _context_too_short(error: str) -> bool:
    """Whether a server's error says the prompt does not fit its context."""
    _, refused, body = error.partition(" answered HTTP 400: ")  # the server's own message, not the URL
    return bool(refused) and re.search(r"context|too long|too many tokens", body, re.IGNORECASE) is not None


def served_model(base_url: str, timeout: float = 30) -> str:
    """The first model the server lists (GET /v1/models)."""
    listing = _call(f"{base_url}/v1/models", None, timeout)
    models = [m.get("id") for m in listing.get("data", []) if isinstance(m, dict)]
    if not models or not models[0]:
        raise ServerError(f"{base_url}/v1/models lists no model; pass --server-model NAME")
    return models[0]


def _converse(base_url: str, model: str, prompt: Prompt, cfg, timeout: float) -> tuple[dict | None, int]:
    """One conversation, turn by turn; returns ({"id", "messages"} or None if the first turn was refused
    as too long, answer tokens)."""
    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    # As distill resolves them locally, less the model's generation_config, which a server does not show.
    sampling = resolve_sampling(None, cfg.do_sample, cfg.temperature, cfg.top_k, cfg.top_p)
    tokens = 0
    for turn in prompt.turns:
        sent = [{"role": m["role"], "content": m["content"]} for m in messages]  # without distill's own "cut"
        payload = {"model": model, "messages": sent + [{"role": "user", "content": turn}],
                   "max_tokens": cfg.max_new_tokens, "temperature": sampling.temperature if sampling.do_sample else 0.0,
                   "seed": cfg.seed}
        if sampling.do_sample:
            payload["top_p"] = sampling.top_p
            if sampling.top_k:  # not in OpenAI's API; vLLM, SGLang and llama.cpp's server read it
                payload["top_k"] = sampling.top_k
        try:
            reply = _call(f"{base_url}/v1/chat/completions", payload, timeout)
        except ServerError as err:
            # A server refuses a prompt past its context length with HTTP 400 and says so (vLLM, SGLang, llama.cpp's
            # server: "... context length ..." / "... context size ..."): like a local prompt over --max-prompt-tokens,
            # the conversation ends before that turn. Any other refusal (a bad setting) stops the run.
            if not _context_too_short(str(err)):
                raise
            break
        try:
            text = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"{base_url}: not a chat completion: {json.dumps(reply)[:300]}") from None
        if not isinstance(text, str):  # null: a refusal or tool call, not an answer to train on (nor to skip later)
            raise ServerError(f"{base_url}: the reply to {prompt.id!r} holds no text (content {text!r}): "
                              f"{json.dumps(reply)[:300]}; check the server's chat template and tool settings")
        # Stopped by max_tokens: marked as distill marks an answer it stopped (training leaves out the end marker).
        cut = {"cut": True} if reply["choices"][0].get("finish_reason") == "length" else {}
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": text.strip(), **cut}]
        tokens += int((reply.get("usage") or {}).get("completion_tokens") or 0)
    if not any(m["role"] == "assistant" for m in messages):
        return None, tokens
    return {"id": prompt.id, "messages": messages}, tokens


def distill_via_server(prompts: list[Prompt], cfg, progress: bool = True, timeout: float = 600) -> dict:
    """Answer every prompt not yet in cfg.output through the server at cfg.server; returns counts."""
    if cfg.self_prompts or cfg.follow_ups:
        raise ValueError("--self-prompts and --follow-ups need the model's raw chat template, which a chat server "
                         "hides; run them locally (without --server), or drop them")
    base_url = cfg.server.rstrip("/").removesuffix("/v1")
    model = cfg.server_model or served_model(base_url)
    record_model(cfg.output, {"server_model": model})
    store = ConversationStore(cfg.output, cfg.chunk_size)
    unique = unique_prompts(prompts)  # as local distillation: each text once
    todo = [p for p in unique if p.id not in store.done]
    stats = {"prompts": len(prompts), "duplicates": len(prompts) - len(unique),
             "skipped_finished": len(unique) - len(todo), "written": 0,
             "skipped_too_long": 0, "new_tokens": 0}
    watch = AnswerWatch(cfg.max_degenerate, cfg.degenerate_window)
    start = time.perf_counter()
    bar = tqdm(total=len(todo), unit="conv", disable=not progress, desc=f"distill via {base_url}")
    with ThreadPoolExecutor(max_workers=cfg.concurrency) as pool:
        futures = [pool.submit(_converse, base_url, model, p, cfg, timeout) for p in todo]
        try:
            for future in as_completed(futures):
                record, tokens = future.result()
                stats["new_tokens"] += tokens
                if record is None:
                    stats["skipped_too_long"] += 1
                else:
                    store.append([record])  # one at a time: a crash loses at most the requests in flight
                    stats["written"] += 1
                    stops = [watch.push(m["content"], m.get("cut", False))  # every answer counted, then judged
                             for m in record["messages"] if m["role"] == "assistant"]
                    if any(stops):
                        raise ValueError(watch.stop_message(cfg.output))
                bar.update(1)
                bar.set_postfix({"tok_per_s": f"{stats['new_tokens'] / (time.perf_counter() - start):.0f}",
                                 **watch.shares()})  # in this order (tqdm sorts keywords)
        except BaseException:
            for future in futures:
                future.cancel()  # what is stored stays; a rerun resumes from there
            raise
    bar.close()
    stats.update(answers=watch.answers, degenerate=watch.degenerate, cut=watch.cut)
    stats["seconds"] = round(time.perf_counter() - start, 1)
    stats["tokens_per_second"] = round(stats["new_tokens"] / max(stats["seconds"], 1e-9), 1)
    stats["output"] = str(Path(cfg.output))
    return stats
