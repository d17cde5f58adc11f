"""The decode loop's knobs, in one frozen configuration.

`DecodeConfig` holds every tunable number that the round planner, the K policies and the cost
model read, so a run can be described (the bench records it with its results) and changed in
one place: `SpeculativeDecoder(..., config=DecodeConfig(tree_max_batch=4))`. The defaults are
the values the benchmarks chose (docs/choosing-k.md, docs/token-trees.md).

This module imports nothing from verispec: drafters, policies and the scheduler all read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# A token tree verified in one pass stays a short pass: the native runtime attends
# batch-invariantly over passes of up to 16 positions (the tree's nodes plus its root).
MAX_TREE_NODES = 15
DEFAULT_TREE_WIDTH = 8  # greedy rows of a feature draft propose trees this wide


def check_tree_width(width: int) -> int:
    """A tree width as a user gives it: an integer in [1, MAX_TREE_NODES] (1: chains)."""
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= MAX_TREE_NODES:
        raise ValueError(f"tree width must be an integer in [1, {MAX_TREE_NODES}] (1: chains), "
                         f"got {width!r}")
    return width


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    # K under k="auto": at most this many draft tokens a round (the cost model times passes
    # over 1..auto_k_max + 1 positions).
    auto_k_max: int = 8
    # k="heuristic" (transformers' +2 / -1 schedule) starts here.
    heuristic_start_k: int = 5
    # Batch cost models are measured at these sizes; a batch is priced at the next one up.
    cost_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    # A batch speculates only when its cost model predicts at least this gain: lockstep
    # drafting has bookkeeping the model does not price, so a predicted +2% loses.
    batch_margin: float = 1.10
    # Greedy rows draft token trees in batches up to this size and chains in bigger ones: a
    # tree's wide pass is nearly free for one row and dear when every row of a batch has one.
    tree_max_batch: int = 1
    # A draft step cheaper than this (relative to a target step) counts as free: n-gram
    # lookups, whose proposals are then cut by their kind rather than priced before drafting.
    cheap_draft: float = 0.01
    # Acceptance estimates: the 0.5 prior weighs this many rounds of evidence, and evidence
    # decays by estimate_decay a round. A light prior lets a weak draft's estimate fall below
    # break-even (a heavy one kept it drafting at a loss); the decay lets K = 0 drift back to
    # the prior within a few rounds, so speculation is retried.
    prior_weight: float = 0.5
    estimate_decay: float = 0.85
    # A draft model's estimate starts optimistic (lookups start at 0.5): where its step costs
    # half a target step (Qwen2.5-Coder-0.5B for the 1.5B), a 0.5 prior prices K = 1 out from
    # the first round, and with nothing drafted no evidence ever raises the estimate. A weak
    # draft's estimate falls within a round or two and is retried every ~15 rounds.
    draft_prior: float = 0.8
    # A source whose estimate prices it out (K = 0) is still tried with one token once it has
    # gone this many rounds without evidence (and at its first proposal): its acceptance is
    # then learnt, not assumed, at most one extra position every probe_every rounds.
    probe_every: int = 16
    # A draft model that lags far behind its row (a long prompt it has not read, or tokens
    # lookups and a prediction added) catches up only where what it saves over the next
    # catch_up_horizon tokens of output at most pays for the catching up.
    catch_up_horizon: int = 512
    # A long prompt is fed in chunks, one a round, so a long prompt arriving in a running batch
    # delays the other rows' rounds by one chunk's pass, not its whole pass. That pass is the
    # longest wait between two of another stream's tokens, and its attention grows with the
    # prompt already fed, so chunks shrink as it grows: prefill_chunk tokens at the start,
    # half that once prefill_knee tokens are in (`chunk_at`), never below 16.
    prefill_chunk: int = 256
    prefill_knee: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.auto_k_max, int) or not 1 <= self.auto_k_max <= MAX_TREE_NODES:
            raise ValueError(f"auto_k_max must be an integer in [1, {MAX_TREE_NODES}], "
                             f"got {self.auto_k_max!r}")
        if self.heuristic_start_k < 1:
            raise ValueError(f"heuristic_start_k must be >= 1, got {self.heuristic_start_k}")
        sizes = self.cost_batch_sizes
        rising = all(a < b for a, b in zip(sizes[:-1], sizes[1:], strict=True))
        if not sizes or sizes[0] != 1 or not rising:
            raise ValueError(f"cost_batch_sizes must rise from 1, got {sizes!r}")
        if self.batch_margin < 1.0:
            raise ValueError(f"batch_margin must be >= 1, got {self.batch_margin}")
        if self.tree_max_batch < 0:
            raise ValueError(f"tree_max_batch must be >= 0, got {self.tree_max_batch}")
        if not 0.0 <= self.cheap_draft < 1.0:
            raise ValueError(f"cheap_draft must be in [0, 1), got {self.cheap_draft}")
        if not 0.0 < self.draft_prior < 1.0:
            raise ValueError(f"draft_prior must be in (0, 1), got {self.draft_prior}")
        if self.prior_weight <= 0.0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}")
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}")
        if self.catch_up_horizon < 1:
            raise ValueError(f"catch_up_horizon must be >= 1, got {self.catch_up_horizon}")
        if self.prefill_chunk < 16:
            raise ValueError(f"prefill_chunk must be >= 16, got {self.prefill_chunk}")
        if self.prefill_knee < 1:
            raise ValueError(f"prefill_knee must be >= 1, got {self.prefill_knee}")
        if not 0.0 < self.estimate_decay <= 1.0:
            raise ValueError(f"estimate_decay must be in (0, 1], got {self.estimate_decay}")

    def as_dict(self) -> dict:
        """For reports: every knob by name."""
        return asdict(self)

    def chunk_at(self, fed: int) -> int:
        """The prompt tokens a round feeds once `fed` are in: prefill_chunk / (1 + fed / knee),
        at least 16. Example: 256, knee 1024: 256 at 0, 128 at 1024, 42 at 5120."""
        return max(16, int(self.prefill_chunk / (1 + fed / self.prefill_knee)))

    def cost_batch_size(self, batch: int) -> int:
        """The measured batch size a batch of `batch` rows is priced at (the next one up)."""
        return next((b for b in self.cost_batch_sizes if b >= batch), self.cost_batch_sizes[-1])
