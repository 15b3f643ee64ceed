"""Prompt files: JSONL, one prompt per record, its shape read from the file's first record (MT-bench's `turns`,
self-instruct's and Alpaca's `instruction`, OASST's transcripts, `prompt`, `question`, `text`, or bare JSON strings;
see SOURCES.md). bench times their first turns; distill answers every turn."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str                 # "<file name>:<line>[:<instance>]", stable across runs: the resume key of distill
    turns: tuple[str, ...]  # user turns, answered one after the other
    category: str | None = None  # the record's `category` (MT-bench's), by which bench reports


def _field(record: dict, name: str) -> list[list[str]]:
    """A string, or a list of strings (a multi-turn prompt such as MT-bench's `turns`)."""
    value = record[name]
    if isinstance(value, str):
        return [[value]]
    if isinstance(value, list):
        return [value]
    raise TypeError(f"{name} holds a {type(value).__name__}")


def _human_turns(record: dict) -> list[list[str]]:
    """OASST transcripts ("### Human: ... ### Assistant: ..."): keep the human turns; the base
    model writes its own answers (self-distillation), so the recorded ones are dropped."""
    text = record["input"]
    if "### Human:" not in text:
        return [[text]]
    turns = [part.split("### Assistant:")[0].strip() for part in text.split("### Human:")[1:]]
    return [turns]


def _instruction(record: dict) -> list[list[str]]:
    """self-instruct (`instances[].input`) or Alpaca (`input`): one prompt per input, the
    instruction followed by that input."""
    instruction = record["instruction"]
    instances = record.get("instances") or [{"input": record.get("input", "")}]
    inputs = [instance.get("input", "") for instance in instances]
    return [[f"{instruction}\n\n{text}" if text.strip() else instruction] for text in inputs]


# Record shape -> reader, tried in order on a file's first record (by shape, never by file name).
_FORMATS = (
    ("turns", lambda r: _field(r, "turns")),
    ("instruction", _instruction),
    ("input", _human_turns),
    ("prompt", lambda r: _field(r, "prompt")),
    ("question", lambda r: _field(r, "question")),
    ("text", lambda r: _field(r, "text")),
)


def _reader_for(first, path: Path, prompt_field: str | None):
    if isinstance(first, str):
        return lambda r: [[r]], "a bare JSON string per line"
    if not isinstance(first, dict):
        raise ValueError(f"{path}:1: each line must be a JSON object or a JSON string, got {type(first).__name__}")
    if prompt_field is not None:
        return (lambda r: _field(r, prompt_field)), f"field {prompt_field!r}"
    for key, reader in _FORMATS:
        if key in first:
            return reader, f"field {key!r}"
    raise ValueError(f"{path}:1: no prompt field found (keys: {sorted(first)}); expected one of "
                     f"{[key for key, _ in _FORMATS]}, or pass --prompt-field NAME")


def parse_prompt_spec(spec: str) -> tuple[Path, int | None]:
    """"FILE" or "FILE:N" (read at most N prompts from FILE, to balance a mix)."""
    path, _, count = spec.rpartition(":")
    if path and count.isdigit():
        return Path(path), int(count)
    return Path(spec), None


def read_jsonl(path: str | Path) -> list[tuple[int, object]]:
    """(line number, parsed value) for every non-blank line; clear errors for a missing or empty file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {'a folder, not a JSONL file' if path.is_dir() else 'no such file'}")
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append((number, json.loads(line)))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err}); one JSON value per line") from None
    if not records:
        raise ValueError(f"{path} is empty: it holds no JSON lines; give a JSONL file with one record per line")
    return records


def read_prompts(path: str | Path, prompt_field: str | None = None, limit: int | None = None) -> list[Prompt]:
    """Prompts of one JSONL file; the format is read from its first record (_FORMATS)."""
    path = Path(path)
    records = read_jsonl(path)
    reader, described = _reader_for(records[0][1], path, prompt_field)
    prompts = []
    for number, record in records:
        try:
            conversations = reader(record)
        except (KeyError, TypeError, AttributeError):
            raise ValueError(f"{path}:{number}: no prompt in {described} (the file's format, read from its first "
                             f"record); fix the record, or name the prompt's field with --prompt-field NAME") from None
        for i, turns in enumerate(conversations):
            if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
                raise ValueError(f"{path}:{number}: empty or non-text prompt {turns!r}; "
                                 f"every prompt must be non-empty text")
            category = record.get("category") if isinstance(record, dict) else None
            prompts.append(Prompt(f"{path.name}:{number}" + (f":{i}" if len(conversations) > 1 else ""), tuple(turns),
                                  category if isinstance(category, str) else None))
        if limit is not None and len(prompts) >= limit:
            return prompts[:limit]
    return prompts


def read_prompt_files(specs: list[str], prompt_field: str | None = None) -> list[Prompt]:
    """The prompts of --prompts FILE[:N] ... (bench's and distill's), file after file."""
    prompts = []
    for spec in specs:
        path, limit = parse_prompt_spec(spec)
        prompts += read_prompts(path, prompt_field, limit)
    return prompts
