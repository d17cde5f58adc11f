"""The native model behind the `verispec.runtime.Runner` protocol, one sequence per runner;
`batched_logits` runs many runners of one model in a single forward pass.

Token trees: `logits(history + tree tokens, n, parents)` scores a tree of draft tokens in one
pass (each node in the slot after the history where it comes, at its depth's position). The
cache then holds the history; the tree waits in its slots, and the next call keeps the path of
it that the new ids follow, moved into place (`settle`), so an accepted path costs nothing to
keep and the rest falls out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.runtime.native.attention import INVARIANT_MAX
from verispec.runtime.native.cache import TreeLinks, check_taps
from verispec.runtime.native.llama import NativeLlama, RowPass
from verispec.runtime.runner import PrefixRunner, common_prefix

# The most history tokens a greedy chain's first pass reads (more: a catch-up, which goes
# through `logits` and its prompt chunks).
MAX_CHAIN_UNREAD = 8


class NativeRunner(PrefixRunner):
    """One sequence of a NativeLlama, with its own KV cache. The cache is indexed by position, so
    truncating it is only forgetting the ids: the next pass writes over the stale positions.
    Runners made by `sibling()` share the model's weights, one sequence each.

    For a feature draft, the runner keeps at every cached position the target's last hidden
    state (`features`) and, once asked (`keep_taps`), the hidden states after some of its
    layers (`tapped_states`). `model` (the NativeLlama, read-only to callers) lends such a draft
    the target's embedding table and final norm. The model holds weights only: what a runner
    keeps is the runner's, so runners of one model may serve different drafts.
    """

    def __init__(self, model: NativeLlama, tap_layers: tuple[int, ...] = ()) -> None:
        super().__init__(device=model.device, vocab_size=int(model.lm_head.out_features),
                         max_positions=model.shape.max_positions)
        self.model = model
        self.cache = model.new_cache(tap_layers)
        self._tree: _PendingTree | None = None  # the last pass's tree, until the next call

    def sibling(self) -> NativeRunner:
        """Another sequence on the same weights, keeping the same taps."""
        return NativeRunner(self.model, self.tap_layers)

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes

    @property
    def bytes_per_position(self) -> int:
        return self.cache.bytes_per_position

    def limit_growth(self, positions: int | None) -> None:
        self.cache.limit_growth(positions)

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """The layer counts after which this runner keeps every position's hidden state."""
        return self.cache.tap_layers

    def keep_taps(self, layers: tuple[int, ...]) -> None:
        """From now on keep the hidden states after `layers` layers at every position.

        A runner keeps one set of taps: asking for none, or for the ones it keeps, changes
        nothing; a runner that keeps none starts keeping these, forgetting its sequence (the
        positions cached so far were not tapped); other taps than it keeps are a ValueError
        (two feature drafts that read different taps need runners of their own)."""
        layers = check_taps(layers, self.model.shape.num_layers)
        if not layers or layers == self.tap_layers:
            return
        if self.tap_layers:
            raise ValueError(f"this runner keeps the hidden states after layers "
                             f"{self.tap_layers}, not {layers}: one set of taps a runner")
        self.cache = self.model.new_cache(layers)
        self.reset()

    def features(self, start: int, end: int) -> torch.Tensor:
        """[end - start, H]: the target's last hidden state (before its final norm) at the
        cached positions start..end-1, a view into the cache valid until the next pass."""
        self._check_cached(start, end)
        return self.cache.features[start:end]

    def tapped_states(self, start: int, end: int) -> torch.Tensor:
        """[end - start, len(tap_layers), H]: the hidden states after each of tap_layers at the
        cached positions start..end-1, a view valid until the next pass."""
        if not self.tap_layers:
            raise ValueError("this runner keeps no taps (keep_taps first)")
        self._check_cached(start, end)
        return self.cache.taps[start:end]

    def _check_cached(self, start: int, end: int) -> None:
        if not 0 <= start <= end <= self.cached_length:
            raise ValueError(f"positions {start}..{end - 1} are not all cached (the cache holds "
                             f"{self.cached_length})")
        self.cache.reserve(max(end, 1))  # a cache no pass has written yet has no buffers

    def describe(self) -> str:
        return self.model.describe()

    @torch.inference_mode()
    def copy_prefix(self, source: NativeRunner, length: int) -> None:
        """Runner.copy_prefix: the first `length` cached positions of `source`, a runner of the
        same model keeping the same taps."""
        if source.model is not self.model:
            raise ValueError("a runner copies a prefix from a runner of its own model only")
        if not 0 <= length <= source.cached_length:
            raise ValueError(f"{length} positions asked; the source holds "
                             f"{source.cached_length}")
        self.reset()
        if length:
            self.cache.copy_prefix(source.cache, length)
            self._cached_ids = source.cached_ids[:length].clone()

    @property
    def exact_prefixes(self) -> bool:
        """Runner.exact_prefixes: where the model's passes are invariant (`pass_invariant`)."""
        return self.model.pass_invariant

    def _clear(self) -> None:
        self._tree = None  # the cache is indexed by position: stale slots are written over

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor, num_logits: int = 1,
               parents: torch.Tensor | None = None) -> torch.Tensor:
        """PrefixRunner.logits; with parents [num_logits - 1] the last num_logits - 1 ids are a
        token tree (each one's parent among them, -1: the last token before them)."""
        return batched_logits([self], [ids], [num_logits], [parents])[0]

    def greedy_chain(self, ids: torch.Tensor, steps: int, head_ids: torch.Tensor | None = None,
                     cut=None, prior: list[float] = ()) -> tuple[list[int], list[float]] | None:
        """A greedy draft chain after ids [L] in one call, where the cache holds a prefix of
        ids and at most MAX_CHAIN_UNREAD of them are left to read (its first pass reads them:
        the last round's bonus token and, after a round that accepted every draft token, the
        draft's own last one; slots past the prefix are written over), and the model can run
        one (`GGUFLlama.greedy_chain`, whose arguments these are): (tokens, their cumulative
        probabilities); None otherwise, with nothing done. The cache then holds ids and every
        chosen token fed to a later step."""
        chain = getattr(self.model, "greedy_chain", None)
        if chain is None or self._tree is not None:
            return None
        cached = common_prefix(self._cached_ids, ids)
        if cached < 1 or not 1 <= int(ids.numel()) - cached <= MAX_CHAIN_UNREAD:
            return None
        result = chain(self.cache, cached, ids[cached:].tolist(), steps, head_ids, cut, prior)
        if result is None:
            return None
        tokens, cumulative, passes = result
        self.commit(torch.cat([ids, torch.tensor(tokens[:passes - 1], dtype=ids.dtype)]))
        return tokens, cumulative

    def prepare(self, ids: torch.Tensor, num_logits: int) -> int:
        self.settle(ids)
        return super().prepare(ids, num_logits)

    @torch.inference_mode()
    def settle(self, ids: torch.Tensor) -> None:
        """Keep the path of the last pass's tree that ids follow, moved into place (a feature
        draft calls this before it reads the path's features; the next pass does otherwise)."""
        tree, self._tree = self._tree, None
        if tree is None or common_prefix(self._cached_ids, ids) < tree.base:
            return
        path, parent = [], tree.base - 1
        nodes = list(zip(tree.parents, tree.tokens, strict=True))  # slot base + j's
        for token in ids[tree.base:].tolist():
            child = next((tree.base + j for j, node in enumerate(nodes) if node == (parent, token)),
                         None)
            if child is None:
                break
            path.append(child)
            parent = child
        self.cache.move(path, tree.base)
        self._cached_ids = ids[:tree.base + len(path)].clone()

    def commit_tree(self, ids: torch.Tensor, base: int, parents: torch.Tensor) -> None:
        """After a pass whose last ids from slot `base` on were a token tree: the cache holds the
        history ids[:base]; the tree (each node's parent slot, [len(ids) - base]) waits in its
        slots until the next call keeps the path the new ids follow (`settle`)."""
        self.commit(ids)
        self._cached_ids = ids[:base].clone()
        self._tree = _PendingTree(base, parents.tolist(), ids[base:].tolist())

    def _truncate(self, length: int) -> None:
        pass


@dataclass(frozen=True, slots=True)
class _PendingTree:
    base: int  # the slot of the tree's first node; the history is the ids before it
    parents: list[int]  # each node's parent slot
    tokens: list[int]


def batched_logits(runners: list[NativeRunner], sequences: list[torch.Tensor],
                   num_logits: list[int], parents: list[torch.Tensor | None] | None = None
                   ) -> list[torch.Tensor]:
    """runner.logits(ids, n[, parents]) for every row at once: one forward pass of the shared
    model over every row's new positions -> per row logits [n, V]. A row's logits equal what
    runner.logits alone returns, and a tree node's what the chain to it gets, bit for bit."""
    model = runners[0].model
    if any(runner.model is not model for runner in runners):
        raise ValueError("batched rows must share one model")
    parents = parents or [None] * len(runners)
    rows = []
    for runner, ids, count, row_parents in zip(runners, sequences, num_logits, parents,
                                               strict=True):
        keep = runner.prepare(ids, count)
        tree = None
        if row_parents is not None:
            base = int(ids.numel()) - count + 1
            if row_parents.numel() != count - 1 or count - 1 >= INVARIANT_MAX:
                raise ValueError(f"a tree of {count - 1} tokens needs {count - 1} parents and "
                                 f"at most {INVARIANT_MAX - 1} tokens")
            if bool((row_parents >= torch.arange(count - 1)).any()) or bool(
                    (row_parents < -1).any()):
                raise ValueError("a tree token's parent must come before it (or be -1)")
            tree = TreeLinks(base, torch.where(row_parents < 0, base - 1, base + row_parents))
        rows.append(RowPass(runner.cache, ids[keep:], keep, count, tree))
    logits = forward_invariant(model, rows)
    for runner, ids, row in zip(runners, sequences, rows, strict=True):
        if row.tree is None:
            runner.commit(ids)
        else:
            runner.commit_tree(ids, row.tree.base, row.tree.parents)
    return logits


def forward_invariant(model: NativeLlama, rows: list[RowPass]) -> list[torch.Tensor]:
    """model.forward_rows(rows), with one guard: a row that appends draft tokens to a prompt
    pass has its prompt run first, on its own, then its draft tokens.

    A prompt pass (more than INVARIANT_MAX new positions) attends with one masked kernel whose
    rounding depends on the number of positions, so plain decoding's prompt pass (the prompt
    alone) and a speculative first round (prompt + draft) would cache slightly different keys
    and values, and outputs could part later. Split, every position gets the same bits in both.
    """
    split = [row.ids.numel() > INVARIANT_MAX and row.num_logits > 1 for row in rows]
    if not any(split):
        return model.forward_rows(rows)
    # 1. The prompts of the split rows: the positions before their draft tokens.
    prompts = [RowPass(row.cache, row.ids[: row.ids.numel() - row.num_logits + 1], row.start, 1)
               for row, cut in zip(rows, split, strict=True) if cut]
    prompt_logits = iter(model.forward_rows(prompts))  # [1, V] each
    # 2. Everything else: the split rows' draft tokens, the other rows whole.
    rest = [RowPass(row.cache, row.ids[-(row.num_logits - 1):],
                    row.start + row.ids.numel() - row.num_logits + 1, row.num_logits - 1,
                    row.tree)
            if cut else row for row, cut in zip(rows, split, strict=True)]
    rest_logits = model.forward_rows(rest)
    return [torch.cat([next(prompt_logits), logits]) if cut else logits
            for logits, cut in zip(rest_logits, split, strict=True)]
