"""What a generate call returns: the output buffer (sequences, stopping at eos or the budget) and the stats."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GenerationStats:
    """What one generate() call did. A step is one forward pass of the base model (prefill included)."""

    steps: int = 0
    new_tokens: list[int] = field(default_factory=list)   # per row
    row_steps: list[int] = field(default_factory=list)    # per row: steps in which the row was still generating
    accepted_at_depth: list[int] = field(default_factory=list)  # [d]: row-steps whose accepted path reached depth d+1
    wall_time: float = 0.0
    # Lookup (generate with lookup_tokens): candidate tokens accepted from the lookup chain (bonus not counted).
    lookup_accepted: int | None = None
    # Draft model (generate_with_draft): per-token acceptance estimate alpha, mean seconds of one draft forward
    # (c_q) and of one verify pass (c_p).
    acceptance_rate: float | None = None
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    # Draft model: the number of draft tokens K of every step; lookup: the chain's length in every step with one.
    draft_lengths: list[int] | None = None
    # generate(tree=None): the nodes of the heads' tree in every step (1: the root alone), as it adapted.
    tree_sizes: list[int] | None = None

    @property
    def tokens_per_step(self) -> float:
        """Mean new tokens per forward pass, the bonus token included (1.0 = no speculation gain)."""
        return sum(self.new_tokens) / max(sum(self.row_steps), 1)

    @property
    def tokens_per_second(self) -> float:
        return sum(self.new_tokens) / self.wall_time if self.wall_time > 0 else 0.0

    def to_dict(self) -> dict:
        optional = {name: getattr(self, name) for name in _OPTIONAL_STATS if getattr(self, name) is not None}
        return {"steps": self.steps, "new_tokens": self.new_tokens, "row_steps": self.row_steps,
                "accepted_at_depth": self.accepted_at_depth, "tokens_per_step": self.tokens_per_step,
                "tokens_per_second": self.tokens_per_second, "wall_time": self.wall_time, **optional}


_OPTIONAL_STATS = ("lookup_accepted", "acceptance_rate", "draft_seconds", "verify_seconds", "draft_lengths",
                   "tree_sizes")


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [B, prompt + new], prompt included; finished rows padded with pad_token_id
    stats: GenerationStats


class SequenceWriter:
    """The output buffer: appends each row's new tokens, stopping a row after its eos or at max_new_tokens."""

    def __init__(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: list[int], pad_token_id: int | None):
        device = input_ids.device
        pad = pad_token_id if pad_token_id is not None else (eos_token_id[0] if eos_token_id else 0)
        batch, self.prompt_length = input_ids.shape
        self.max_new_tokens = max_new_tokens
        self.eos = torch.tensor(eos_token_id, dtype=torch.long, device=device)
        # One spare column takes the writes of tokens that are not emitted.
        self.sequences = torch.full((batch, self.prompt_length + max_new_tokens + 1), pad, dtype=torch.long,
                                    device=device)
        self.sequences[:, : self.prompt_length] = input_ids
        self.n_generated = torch.zeros(batch, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.row_steps = torch.zeros(batch, dtype=torch.long, device=device)
        self.rows: torch.Tensor | None = None  # the rows still decoded, once finished ones have left (None: all)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Decoding goes on with the rows `rows` [B'] (indices into those decoded so far) alone, the others finished:
        append then takes theirs only."""
        self.rows = rows if self.rows is None else self.rows[rows]

    @property
    def decoded_finished(self) -> torch.Tensor:
        """[B']: whether each row still decoded is finished (rows finish in a step and leave the batch after it)."""
        return self.finished if self.rows is None else self.finished[self.rows]

    def append(self, new_tokens: torch.Tensor, n_new: torch.Tensor) -> torch.Tensor:
        """Append up to n_new [B'] of new_tokens [B', M] for each row still decoded; returns how many each took [B']."""
        if self.rows is not None:  # at their rows of the whole batch; the rows that left are finished and take none
            whole = len(self.finished)
            new_tokens = new_tokens.new_zeros(whole, new_tokens.shape[1]).index_copy_(0, self.rows, new_tokens)
            n_new = n_new.new_zeros(whole).index_copy_(0, self.rows, n_new)
        offsets = torch.arange(new_tokens.shape[1], device=new_tokens.device)
        is_eos = torch.isin(new_tokens, self.eos) & (offsets < n_new[:, None])
        until_eos = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, n_new)
        count = torch.minimum(until_eos, self.max_new_tokens - self.n_generated).masked_fill(self.finished, 0)
        columns = self.prompt_length + self.n_generated[:, None] + offsets
        columns = columns.masked_fill(offsets >= count[:, None], self.sequences.shape[1] - 1)
        self.sequences.scatter_(1, columns, new_tokens)
        self.row_steps.add_((~self.finished).long())
        self.finished = (self.finished | (is_eos & (offsets < count[:, None])).any(-1)
                         | (self.n_generated + count >= self.max_new_tokens))
        self.n_generated = self.n_generated + count
        return count if self.rows is None else count[self.rows]

    def output(self, stats: GenerationStats) -> GenerateOutput:
        stats.new_tokens = self.n_generated.tolist()
        stats.row_steps = self.row_steps.tolist()
        return GenerateOutput(self.sequences[:, : self.prompt_length + max(stats.new_tokens)], stats)


def stream(streamer, new_tokens: torch.Tensor, count: int) -> None:
    if streamer is not None and count > 0:
        streamer.put(new_tokens[0, :count].cpu())
