"""Prompt lookup: a chain of candidates copied from where the text's last n-gram occurred before.

`WithLookup` is the proposer: the chain merged into another proposer's tree (the heads', or the root
alone for lookup without heads).

The sources are each row's prompt and generated tokens and any `documents` (token id lists).
The chain hangs off the root of the Medusa tree (or of a root-only tree: lookup with no heads),
so one verify pass checks both; it is as long as the step's longest match, and absent when no
row has one. The search runs on the host over plain token lists: the step's one host sync
already brings the new tokens back, and an index from n-gram to position, updated with each
step's new tokens, makes a search a few dict lookups per row.
"""

from __future__ import annotations

import torch

from .inputs import check_token_ids
from .output import GenerationStats
from .propose import Candidates, Prompt, Proposer, RootOnly, StepResult, tokens_left, tokens_left_after
from .tree import MedusaTree, Tree, chain_tree

# The chain's length where none is given (generate_with_lookup; --lookup of generate, chat and bench), and the
# prompt_lookup_num_tokens bench's hf_prompt_lookup passes transformers, so both methods copy as far.
LOOKUP_TOKENS = 10
DEFAULT_MAX_NGRAM = 3
# Beside a proposer's tree (the heads'), a chain needs a match of 3 tokens, and when every row has one the step
# verifies the root and the chain alone. The longer the match, the more often the chain's first token is the model's
# next one: a 1-token match's chain mostly misses, a 2-token match's is right about as often as the heads' own first
# guess, a 3-token match's far more often. Every row of a verify pass costs, so a 2-token match's chain rarely pays
# for its rows, while a 3-token match's is worth more than the tree it replaces; the chain then takes at least as
# many nodes as the tree had, rows the step would have paid for anyway. (Measured: "Cheaper rows, fewer wasted rows"
# and "Lookup beside the heads" in experiments/2026-12-smollm2-135m-instruct/NOTES.md.)
# Lookup alone keeps 1-token matches: they are its only guesses.
MIN_NGRAM_WITH_TREE = DEFAULT_MAX_NGRAM
# Written into the acceptance copy of node tokens for nodes that must not be reached: no drawn token equals it.
UNREACHABLE = -1


def check_documents(documents, vocab_size: int) -> list[list[int]]:
    """Documents as token id lists (lists of ints or 1-D integer tensors); raises ValueError naming the fix."""
    fix = "tokenize them first: documents=[tokenizer(text, add_special_tokens=False).input_ids for text in texts]"
    if documents is None:
        return []
    if isinstance(documents, (str, bytes)) or not isinstance(documents, (list, tuple)):
        raise ValueError(f"documents must be a list of token id lists, got {type(documents).__name__}; {fix}")
    checked = []
    for i, document in enumerate(documents):
        if torch.is_tensor(document):
            if document.dim() != 1 or document.dtype.is_floating_point or document.dtype == torch.bool:
                raise ValueError(f"documents[{i}] is a tensor of shape {tuple(document.shape)} and dtype "
                                 f"{document.dtype}; pass a 1-D integer tensor or a list of ints ({fix})")
            document = document.tolist()
        if isinstance(document, (str, bytes)) or not isinstance(document, (list, tuple)):
            raise ValueError(f"documents[{i}] is a {type(document).__name__}, not a list of token ids; {fix}")
        not_ids = [t for t in document if not isinstance(t, int) or isinstance(t, bool)]
        if not_ids:
            raise ValueError(f"documents[{i}] holds {not_ids[0]!r}, not a token id; {fix}")
        checked.append(list(document))
    check_token_ids(checked, vocab_size, "documents", "the documents")
    return checked


def check_lookup_tokens(lookup_tokens) -> None:
    if not isinstance(lookup_tokens, int) or isinstance(lookup_tokens, bool) or lookup_tokens < 0:
        raise ValueError(f"lookup_tokens must be an integer >= 0 (the lookup chain's length; 0 turns lookup off), "
                         f"got {lookup_tokens!r}")


def with_lookup(proposer: Proposer, lookup_tokens: int, documents, vocab_size: int) -> Proposer:
    """`proposer` with a lookup chain of `lookup_tokens` merged in (over the prompt, the output and `documents`),
    or `proposer` itself for lookup_tokens=0; the arguments are checked."""
    check_lookup_tokens(lookup_tokens)
    documents = check_documents(documents, vocab_size)
    if documents and not lookup_tokens:
        raise ValueError("documents are only searched by prompt lookup: pass lookup_tokens >= 1 (e.g. 10) with them")
    return WithLookup(proposer, documents, lookup_tokens) if lookup_tokens else proposer


class NgramIndex:
    """A growing token list and, for every n-gram (n <= max_ngram), where the token after its latest occurrence is."""

    def __init__(self, tokens: list[int], max_ngram: int = DEFAULT_MAX_NGRAM):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.next_start: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, new_tokens: list[int]) -> None:
        for token in new_tokens:
            end = len(self.tokens)  # every n-gram ending here is now followed by `token`
            for n in range(1, min(self.max_ngram, end) + 1):
                self.next_start[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(token)


def lookup_chain(context: NgramIndex, documents: list[NgramIndex], length: int, min_ngram: int = 1) -> list[int]:
    """Up to `length` tokens that followed the longest suffix (n = max_ngram down to min_ngram) of `context`'s
    tokens seen earlier in the context, else in a document; [] when no such suffix occurred before.

    A copy from the context may run into the context's own end: it then goes on copying the tokens it
    has just proposed (the text repeats with the period of the match).
    """
    tokens = context.tokens
    for n in range(min(context.max_ngram, len(tokens)), min_ngram - 1, -1):
        suffix = tuple(tokens[-n:])
        for index in (context, *documents):
            start = index.next_start.get(suffix)
            if start is None:
                continue
            source = index.tokens
            chain: list[int] = []
            for j in range(start, start + length):
                if j < len(source):
                    chain.append(source[j])
                elif index is context:
                    chain.append(chain[j - len(source)])
                else:
                    break
            return chain
    return []


class PromptLookup:
    """Per-row indexes of prompt + generated tokens, the documents' indexes, and the chain each row proposes."""

    def __init__(self, prompts: list[list[int]], documents: list[list[int]], chain_length: int,
                 max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = 1):
        self.rows = [NgramIndex(prompt, max_ngram) for prompt in prompts]
        self.documents = [NgramIndex(document, max_ngram) for document in documents]
        self.chain_length, self.min_ngram = chain_length, min_ngram

    def extend(self, new_tokens: list[list[int]]) -> None:
        """Append each row's newly emitted tokens (host lists)."""
        for index, tokens in zip(self.rows, new_tokens):
            index.extend(tokens)

    def keep_rows(self, rows: list[int]) -> None:
        """The rows `rows` alone go on (a batch whose other rows are done)."""
        self.rows = [self.rows[r] for r in rows]

    def chains(self, device, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(chain_tokens [B, L], has_match [B]), L the longest chain of at most `length` (default chain_length)
        tokens any row found this step (0 when no row has a match: the step then verifies the heads' tree
        alone, as a chain that no row can use costs a longer verify pass for nothing). A shorter chain repeats
        its last token and a row with no match repeats its last text token: any valid token id is safe, since
        a chain node is accepted only where it equals the base model's own token, and a row with no match
        keeps its chain out of reach. `found` keeps each row's chain (host lists) for the step's update."""
        chains = [lookup_chain(index, self.documents, length or self.chain_length, self.min_ngram)
                  for index in self.rows]
        self.found = chains
        length = max(len(chain) for chain in chains)
        padded = [chain + [(chain or index.tokens)[-1]] * (length - len(chain))
                  for chain, index in zip(chains, self.rows)]
        return (torch.tensor(padded, dtype=torch.long, device=device),
                torch.tensor([bool(chain) for chain in chains], dtype=torch.bool, device=device))


def tree_with_chain(tree: Tree, length: int) -> Tree:
    """`tree` (N nodes, shared or per row) plus a chain of `length` nodes hanging off its root, appended as nodes
    N .. N+length-1, on the tree's device.

    The merged tree is what verify and accept read; the heads draft their N nodes on their own tree.
    """
    device = tree.depth.device
    n, total = tree.num_nodes, tree.num_nodes + length
    max_depth = max(tree.max_depth, length)
    lead = tree.depth.shape[:-1]  # () for a shared tree, (B,) for a per-row one
    chain = torch.arange(n, total, device=device)
    depth = torch.cat([tree.depth, torch.arange(1, length + 1, device=device).expand(*lead, -1)], dim=-1)
    parent = torch.cat([tree.parent, torch.cat([torch.zeros(1, dtype=torch.long, device=device),
                                                chain[:-1]]).expand(*lead, -1)], dim=-1)
    tree_mask = torch.zeros(*lead, total, total, dtype=torch.bool, device=device)
    tree_mask[..., :n, :n] = tree.tree_mask
    tree_mask[..., n:, 0] = True
    tree_mask[..., n:, n:] = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    # Past its depth a node's path repeats the node itself (as build_tree lays it out).
    steps = torch.arange(max_depth, device=device)
    node_paths = torch.empty(*lead, total, max_depth + 1, dtype=torch.long, device=device)
    node_paths[..., :n, : tree.max_depth + 1] = tree.node_paths
    node_paths[..., :n, tree.max_depth + 1:] = torch.arange(n, device=device)[:, None]
    node_paths[..., n:, 0] = 0
    node_paths[..., n:, 1:] = torch.where(steps[None, :] <= torch.arange(length, device=device)[:, None],
                                          n + steps[None, :], chain[:, None])
    return Tree(depth, parent, tree_mask, node_paths)


def add_chain(node_tokens: torch.Tensor, chain_tokens: torch.Tensor, has_match: torch.Tensor, num_tree_nodes: int,
              depth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Medusa node tokens [B, N] + lookup chains [B, L] -> (node_tokens [B, N + L] for the verify pass,
    candidates [B, N + L] for acceptance).

    Of two siblings with one token only one can stay reachable (acceptance keeps the first, see
    accept.repeats_a_sibling); a chain whose first token equals a depth-1 Medusa candidate wins here
    instead (it copies a run of text, usually longer than the heads' guesses). The choice is made from
    the tokens alone, before any draw, so it keeps sampling exact; a row with no match keeps its chain
    out of reach entirely. `depth` [N + L] (or [B, N + L]) is the merged tree's.
    """
    node_tokens = torch.cat([node_tokens, chain_tokens], dim=1)
    duplicate = (node_tokens[:, :num_tree_nodes] == chain_tokens[:, :1]) & (depth[..., :num_tree_nodes] == 1)
    unreachable = torch.cat([duplicate & has_match[:, None],
                             (~has_match)[:, None].expand(-1, chain_tokens.shape[1])], dim=1)
    return node_tokens, node_tokens.masked_fill(unreachable, UNREACHABLE)


def next_chain_length(length: int, taken_whole: bool, chain_length: int) -> int:
    """The chain's length for the next step, as transformers' assisted decoding schedules its draft: 2 longer
    after a step in which some row accepted its whole chain, 1 shorter otherwise, within [1, chain_length].
    Why not always chain_length: every verified row costs (a tree plus a full chain verifies markedly slower than
    the tree alone), while most chains miss at their first token; a run of copied text soon gets its length back."""
    return min(length + 2, chain_length) if taken_whole else max(length - 1, 1)


def shape_of(tree: Tree) -> tuple | None:
    """A key for the merged trees WithLookup keeps: a MedusaTree's rank paths, () for the root alone (any tree of one
    node), None for any other tree (a dynamic tree: a new shape nearly every step, merged anew, not kept)."""
    return tree.choices if isinstance(tree, MedusaTree) else () if tree.num_nodes == 1 else None


class WithLookup(Proposer):
    """`proposer`'s candidates plus a lookup chain of up to `chain_length` tokens off their root, verified in
    the same pass (see add_chain for which of two equal first tokens stays reachable); the chain's length
    adapts step by step (next_chain_length), and beside a tree other than the root alone a chain needs a match of
    MIN_NGRAM_WITH_TREE tokens; when every row has a chain, the step verifies the root and the chain alone, at
    least as many nodes as the tree had. The proposer proposes one tree per size (one tree, or AdaptiveTree's
    ladder): merged trees are built once per tree and chain length (a dynamic tree's each step: see shape_of)."""

    def __init__(self, proposer: Proposer, documents: list[list[int]], chain_length: int):
        self.proposer, self.documents, self.chain_length = proposer, documents, chain_length
        self.modules, self.feature_layers = proposer.modules, proposer.feature_layers
        self.max_depth = max(proposer.max_depth, chain_length)
        self.merged_trees: dict[tuple[tuple, int], Tree] = {}  # (rank paths, chain length) -> the tree with the chain

    def start(self, prompt: Prompt) -> None:
        self.proposer.start(prompt)
        prompts = [row[mask].tolist() for row, mask in zip(prompt.input_ids, prompt.attention_mask)]  # no padding
        min_ngram = 1 if isinstance(self.proposer, RootOnly) else MIN_NGRAM_WITH_TREE
        self.lookup = PromptLookup(prompts, self.documents, self.chain_length, min_ngram=min_ngram)
        self.lookup.extend([[token] for token in prompt.root.tolist()])
        self.accepted = torch.zeros((), dtype=torch.long, device=prompt.root.device)
        self.root_alone = chain_tree(0).to(prompt.root.device)
        self.length = self.chain_length
        self.lengths: list[int] = []  # the chain's length in each step that had one
        self.tokens_left = tokens_left(prompt)

    def propose(self, root: torch.Tensor) -> Candidates:
        candidates = self.proposer.propose(root)  # drafted even when unused: the proposer's state follows each step
        num_tree_nodes = candidates.tree.num_nodes
        self.chain_start = num_tree_nodes
        cap = min(self.chain_length, max(self.tokens_left) - 1)
        if cap < 1:  # one token left in every row: the bonus alone
            self.lookup.found = [[] for _ in self.lookup.rows]
            return candidates
        chain_tokens, has_match = self.lookup.chains(root.device, min(self.length, cap))
        length = chain_tokens.shape[1]
        if not length:
            return candidates
        if num_tree_nodes > 1 and all(self.lookup.found):  # a chain in every row: it alone, in the tree's rows
            if length < min(num_tree_nodes - 1, cap):
                chain_tokens, has_match = self.lookup.chains(root.device, min(num_tree_nodes - 1, cap))
                length = chain_tokens.shape[1]
            num_tree_nodes = self.chain_start = 1
            candidates = Candidates(root[:, None], self.root_alone)
        self.lengths.append(length)
        shape = shape_of(candidates.tree)
        if shape is None:
            tree = tree_with_chain(candidates.tree, length)
        else:
            if (shape, length) not in self.merged_trees:
                self.merged_trees[shape, length] = tree_with_chain(candidates.tree.to(root.device), length)
            tree = self.merged_trees[shape, length]
        node_tokens, accept_tokens = add_chain(candidates.node_tokens, chain_tokens, has_match, num_tree_nodes,
                                               tree.depth)
        return Candidates(node_tokens, tree, accept_tokens=accept_tokens)

    def update(self, step: StepResult) -> None:
        self.proposer.update(step)
        chain_won = (step.last_node >= self.chain_start) & step.active
        self.accepted += (step.accept_length * chain_won).sum()
        if any(self.lookup.found):
            # From the host lists the step's sync brought back: a row took its whole chain when it emitted it
            # (through the chain or an equal path of the heads) and a token after it.
            taken_whole = any(chain and active and len(emitted) > len(chain) and emitted[:len(chain)] == chain
                              for chain, active, emitted in zip(self.lookup.found, step.host.active, step.host.emitted))
            self.length = next_chain_length(self.length, taken_whole, self.chain_length)
        self.lookup.extend(step.host.emitted)
        self.tokens_left = tokens_left_after(self.tokens_left, step.host)

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.proposer.keep_rows(rows)
        kept = rows.tolist()
        self.lookup.keep_rows(kept)
        self.tokens_left = [self.tokens_left[r] for r in kept]

    def finish(self, stats: GenerationStats) -> None:
        self.proposer.finish(stats)
        stats.lookup_accepted = int(self.accepted)
        stats.draft_lengths = self.lengths
