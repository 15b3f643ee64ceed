"""Where an answer starts copying itself: a small model's greedy answers often end in a loop.

Many of SmolLM2-135M's distilled answers ran to the token limit, and a large share of all answer tokens repeated
a sequence already written earlier in the same answer: much of the distillation time went to loops. At decoding
time the lookup chain copies loops (a long match's chain is mostly right in this data), so the heads' training is
spent better on the text before them; the heads guess loop tokens worse than the rest anyway (measured: "What
limits these heads" in experiments/2026-12-smollm2-135m-instruct/NOTES.md). A loop is a run of LOOP_RUN
positions in a row that each close an LOOP_NGRAM-gram seen before; it starts where the first of those n-grams
starts. Distillation stops an answer there, and training leaves the loop out of the loss and the accuracy.

A degenerate answer is worse: empty, or little more than one repeated token. A base model prompted in a format it
does not know answers so ("Assistant Assistant ...", "?", ""): nearly every answer of one such run, which nothing
reported. Distillation counts them as it writes (AnswerWatch) and stops when they dominate; training refuses data
that is mostly made of them.
"""

from __future__ import annotations

import re
from collections import deque

LOOP_NGRAM = 8
LOOP_RUN = 32


class LoopWatch:
    """Fed one answer's tokens one by one; `push` says when the answer is in a loop, `start` where it began."""

    def __init__(self, ngram: int = LOOP_NGRAM, run: int = LOOP_RUN):
        self.ngram, self.run = ngram, run
        self.tokens: list[int] = []
        self.seen: set[tuple[int, ...]] = set()
        self.repeats = 0  # positions in a row whose n-gram was seen before
        self.start: int | None = None

    def push(self, token: int) -> bool:
        self.tokens.append(token)
        if len(self.tokens) < self.ngram:
            return False
        gram = tuple(self.tokens[-self.ngram:])
        self.repeats = self.repeats + 1 if gram in self.seen else 0
        self.seen.add(gram)
        if self.repeats >= self.run:
            self.start = len(self.tokens) - self.run - self.ngram + 1  # where the first repeated n-gram begins
            return True
        return False


def loop_start(tokens: list[int], ngram: int = LOOP_NGRAM, run: int = LOOP_RUN) -> int | None:
    """The index where `tokens` start a loop (the tokens before it are the answer without the loop), or None."""
    watch = LoopWatch(ngram, run)
    for token in tokens:
        if watch.push(token):
            return watch.start
    return None


# A word: a run of letters, digits or underscores; a character of a script written without spaces (Chinese,
# Japanese) is one word by itself, so that an answer in such a script is not one long "word".
_SPACELESS = "\u3040-\u30ff\u3400-\u9fff\uf900-\ufaff"
_WORD = re.compile(f"[{_SPACELESS}]|[^\\W{_SPACELESS}]+")

# What a run of degenerate answers most likely means, for the messages of distill and train.
DEGENERATE_CAUSES = ("the model is not answering the prompts as they are formatted. Likely causes: the prompts lack "
                     "the tokenizer's BOS token (plain-text data distilled before the plain-text format put it "
                     "first), a chat template that is not the model's own, or a base (non-chat) model run without "
                     "--plain-text")


def degenerate(answer: str) -> bool:
    """Whether an answer is empty or little more than one repeated token: fewer than three distinct words."""
    return len({word.lower() for word in _WORD.findall(answer)}) < 3


class AnswerWatch:
    """Distillation's account of the answers it writes: how many are degenerate and how many were cut (stopped
    before their end of turn); `push` says when more than `limit` of the last `window` answers are degenerate."""

    def __init__(self, limit: float, window: int):
        self.limit = limit
        self.recent: deque[bool] = deque(maxlen=window)
        self.answers = self.degenerate = self.cut = 0
        self.examples: deque[str] = deque(maxlen=3)  # the last degenerate answers, to show in the stop's message

    def push(self, answer: str, cut: bool) -> bool:
        bad = degenerate(answer)
        self.answers += 1
        self.degenerate += bad
        self.cut += cut
        self.recent.append(bad)
        if bad:
            self.examples.append(answer[:40])
        # A full window only: the first few answers alone say little.
        return len(self.recent) == self.recent.maxlen and sum(self.recent) > self.limit * len(self.recent)

    def shares(self) -> dict[str, str]:
        """The progress line's shares of the answers so far: degenerate and cut."""
        answers = max(self.answers, 1)
        return {"degenerate": f"{self.degenerate / answers:.0%}", "cut": f"{self.cut / answers:.0%}"}

    def stop_message(self, output) -> str:
        return (f"distill stopped: {sum(self.recent)} of the last {len(self.recent)} answers are degenerate (empty, "
                f"or fewer than three distinct words; the last ones: {list(self.examples)}), more than "
                f"--max-degenerate {self.limit} of them: {DEGENERATE_CAUSES}. The conversations finished so far are "
                f"stored in {output}, whole; since a rerun into it would skip their prompts, distill into a new "
                f"--output once the cause is fixed (or --max-degenerate 1 to go on regardless)")
