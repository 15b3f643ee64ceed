"""A prompt pool of tasks over a given text, for self-distillation: summaries, extraction, answers from given
documents, rewriting, and translation into English.

These are the task types where the shipped heads guess worst (experiments/2026-12-smollm2-135m-instruct/NOTES.md,
"Where the heads lose on the benchmarks' text": head-0 top-1 0.16-0.32 on translation, summarization, answers from
documents and extraction, against 0.48-0.54 on code and math), and the training pools (training/data/prompts) hold
few of them. In such
an answer the model copies and rephrases what the prompt holds, which a head must learn to read from the hidden state.

The documents are the base model's own first answers in a distilled data folder (no text from outside the training
data, no evaluation set): each is used once, and one that ends in a loop is skipped (one that distill cut off at a
loop or at its token limit stays, and may end mid-sentence). An answer from given documents is asked as
retrieval-augmented prompts are: two documents in random order (the answer to the question, and another
conversation's answer as a distractor), then the question. Translation prompts are the distinct non-English first
turns of an OpenAssistant prompt file (--translate), asked "Translate <language> to English: ...".

The output is a prompt file for `medusa-spec distill --prompts` ({"prompt", "category"} per line). distill resumes by
file name and line number, so an existing output is never rewritten (the same data gives the same file: --seed).

    python scripts/document_prompts.py training/data/smollm2-135m-instruct OUT.jsonl --tasks 1000 \\
        --translate runs/prompts/oasst1_val_prompts_qlora_oa_questions.jsonl   # training/data/prompts/unpack.sh
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections import Counter
from pathlib import Path

from medusa_spec.prompts import read_jsonl, read_prompts
from medusa_spec.train.data import read_conversations
from medusa_spec.train.repetition import loop_start

# A document between 400 and 2,000 characters: about 100-500 tokens, so that most prompts fit distill.sh's
# --max-prompt-tokens 640 (distill skips the rest: 59 of the recipe's 250 answers from documents, which hold two).
MIN_CHARS, MAX_CHARS = 400, 2000
MAX_QUESTION_CHARS = 300
MAX_TRANSLATE_CHARS = 600

TEMPLATES = {
    "summarization": (
        "Summarize: {doc}",
        "Summarize the following text in a few sentences.\n\n{doc}",
        "Write a one-paragraph summary of this text:\n\n{doc}",
        "{doc}\n\nSummarize the text above in three bullet points.",
    ),
    "extraction": (
        "List every name, number and date that appears in the text below.\n\n{doc}",
        "Extract the main points of this text as a numbered list.\n\n{doc}",
        "Read the text and write down the key terms it uses, each with a short explanation taken from the text.\n\n"
        "{doc}",
        "{doc}\n\nWhat are the most important facts in the text above? Quote them.",
    ),
    "rewriting": (
        "Rewrite the following text in simpler words.\n\n{doc}",
        "Rewrite this text as a short formal email.\n\n{doc}",
        "Make this text shorter without losing any facts:\n\n{doc}",
    ),
}

# OpenAssistant's `lang` codes -> the language's English name (codes absent here are left out).
LANGUAGES = {"es": "Spanish", "ru": "Russian", "fr": "French", "zh": "Chinese", "de": "German", "th": "Thai",
             "ca": "Catalan", "uk-UA": "Ukrainian", "pt-BR": "Portuguese", "it": "Italian", "eu": "Basque",
             "ja": "Japanese", "vi": "Vietnamese", "hu": "Hungarian"}


def documents(conversations: list[list[dict]]) -> list[tuple[str, str]]:
    """(question, document) per conversation: its first user turn and the model's first answer, when the answer
    is a usable document."""
    found = []
    for messages in conversations:
        user = next((m["content"] for m in messages if m["role"] == "user"), None)
        answer = next((m["content"] for m in messages if m["role"] == "assistant"), None)
        if user is None or answer is None:
            continue
        answer = answer.strip()
        # A loop as distill finds one (train/repetition.py), counted in words: answers distilled before
        # distill cut loops off may still end in one.
        if MIN_CHARS <= len(answer) <= MAX_CHARS and loop_start(answer.split()) is None:
            found.append((user.strip(), answer))
    return found


def document_tasks(docs: list[tuple[str, str]], count: int, rng: random.Random) -> list[dict]:
    """`count` prompts over distinct documents, the task types in equal shares. An answer from documents takes two
    documents (the second is the distractor) and needs its own question to be short and on one line."""
    order = list(range(len(docs)))
    rng.shuffle(order)
    kinds = [*TEMPLATES, "rag"]
    want = {kind: count // len(kinds) + (i < count % len(kinds)) for i, kind in enumerate(kinds)}
    askable = [i for i in order if len(docs[i][0]) <= MAX_QUESTION_CHARS and "\n" not in docs[i][0]][:want["rag"]]
    taken = set(askable)
    rest = [i for i in order if i not in taken]
    if len(askable) < want["rag"] or len(rest) < count:
        raise SystemExit(f"{count} document tasks need {count + want['rag']} distinct usable answers "
                         f"({MIN_CHARS}-{MAX_CHARS} characters, no loop; {want['rag']} of them after a short one-line "
                         f"question), and the data holds {len(docs)} ({len(askable)} such): ask for fewer --tasks")
    tasks = []
    for i in askable:
        pair = [docs[i][1], docs[rest.pop()][1]]
        rng.shuffle(pair)
        tasks.append({"prompt": f"{pair[0]}\n{pair[1]}\n{docs[i][0]}", "category": "rag"})
    for kind in TEMPLATES:
        for _ in range(want[kind]):
            doc = docs[rest.pop()][1]
            tasks.append({"prompt": rng.choice(TEMPLATES[kind]).format(doc=doc), "category": kind})
    return tasks


def translation_tasks(path: Path) -> list[dict]:
    """"Translate <language> to English: <text>" for each distinct non-English first turn of an OpenAssistant file
    ({"input": "### Human: ... ### Assistant: ...", "lang": ...}, read as distill reads it; several transcripts open
    with the same turn)."""
    records = read_jsonl(path)
    if not all(isinstance(r, dict) and "input" in r and "lang" in r for _, r in records):
        raise SystemExit(f"{path}: expected OpenAssistant records with `input` and `lang` fields")
    tasks, seen = [], set()
    for (_, record), prompt in zip(records, read_prompts(path), strict=True):
        language, text = LANGUAGES.get(record["lang"]), prompt.turns[0]
        if language and len(text) <= MAX_TRANSLATE_CHARS and text not in seen:
            seen.add(text)
            tasks.append({"prompt": f"Translate {language} to English: {text}", "category": "translation"})
    return tasks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="a distilled data folder (or JSONL file): its answers are the documents")
    parser.add_argument("output", help="the prompt file to write (JSONL); never rewritten once it exists")
    parser.add_argument("--tasks", type=int, default=1000, help="tasks over documents (default 1000)")
    parser.add_argument("--translate", help="an OpenAssistant prompt file whose non-English first turns become "
                                            "translation tasks")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    output = Path(args.output)
    if output.exists():
        raise SystemExit(f"{output} exists: distill resumes by its line numbers, so it is not rewritten; delete it "
                         f"only together with the conversations distilled from it")
    rng = random.Random(args.seed)
    tasks = document_tasks(documents(read_conversations(args.data)), args.tasks, rng)
    if args.translate:
        tasks += translation_tasks(Path(args.translate))
    rng.shuffle(tasks)
    output.parent.mkdir(parents=True, exist_ok=True)
    # Whole or not at all: a partial file would stand for good (it exists, so it is never rewritten).
    partial = output.with_name(output.name + ".partial")
    partial.write_text("".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tasks), encoding="utf-8")
    os.replace(partial, output)
    print(json.dumps({"output": str(output), "prompts": len(tasks), **Counter(t["category"] for t in tasks)}))


if __name__ == "__main__":
    main()
