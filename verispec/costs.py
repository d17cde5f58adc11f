"""What speculation costs on this machine: the cost model and its measurement.

A `CostModel` prices a round in units of one one-token target step: c, one draft token, and
v(n), a target pass over n positions. `measure_costs` (one sequence) and `measure_batch_costs`
(a batch, in units of a plain batched step) time the real runtime objects; the K policies
(verispec.policy) and the round planner (verispec.planner) only read the result. Which models
a decoder has measured, estimated or read back from disk: verispec.cost_table.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from verispec.config import MAX_TREE_NODES
from verispec.drafters.batch_drafting import propose_batch
from verispec.drafters.drafter import follow_target
from verispec.params import SamplingParams
from verispec.runtime import batched_logits
from verispec.sampling import sample, warp
from verispec.verify import RowVerification, verify_rows


@dataclass(frozen=True, slots=True)
class CostModel:
    """Measured costs, in units of one one-token target step."""

    draft_step: float  # c: one draft token
    verify: tuple[float, ...]  # verify[k] = v(k + 1): a target pass over k + 1 positions
    target_step_s: float  # the unit, in seconds
    # The same v measured after a longer context (relative to a one-token step there), where
    # every extra position attends over more keys: v(n) grows with the context (`at`).
    long_verify: tuple[float, ...] | None = None
    contexts: tuple[int, int] = (128, 1024)  # the contexts verify and long_verify were timed at
    # c after the longer context (relative to a one-token target step there): a draft model
    # attends over the context too. None: c does not change with the context.
    long_draft_step: float | None = None
    # A one-token step after the longer context, in steps after the shorter one (timed in
    # alternation with them): with it `at` follows each pass's time along the context, not
    # its ratio to a step. None: the ratios are followed (a model handed in without it).
    long_step: float | None = None
    # What a sampled row pays per drafted token beyond a greedy one: the drafter warping and
    # drawing from its distribution, and verification warping the target's distribution at one
    # more position and the rejection step over it (`sampled`).
    sampling_step: float = 0.0
    # Seconds the drafter takes per token it has not read yet (a prompt, or the tokens that
    # lookups and predictions added while it waited), in its own prompt-sized passes: what a
    # draft model that lags far behind pays before it can propose (`catch_up`). 0: nothing.
    draft_catch_up_s: float = 0.0

    def catch_up(self, tokens: int) -> float:
        """What catching the drafter up on `tokens` unread tokens costs, in target steps."""
        return tokens * self.draft_catch_up_s / self.target_step_s

    def at(self, context: int) -> CostModel:
        """The prices for a sequence of `context` tokens; unchanged with one context.

        With `long_step`: each pass's time (and a draft step's, where timed at both) along the
        line through its times at the two contexts, in short-context steps, then over the
        one-token step's time there. A pass over n positions grows with the context no slower
        than one over fewer (it attends over the same keys for more queries), and no pass
        shrinks, so a curve whose longer context came out a little cheaper (noise) never
        brings a pass down to v = 1, as the ratios' line did by a few thousand tokens, and v(n)
        tends to the ratio of the passes' growth rather than growing without bound. Example:
        v(9) 2.0 at 128 and 2.5 at 1024, the step 1.3x as long there -> at 4096 the step
        1 + 4.43 x 0.3 and the pass 2.0 + 4.43 x 1.25 short steps: v(9) 7.54 / 2.33 = 3.2.

        Without it (a model handed in without it): v(n) (and c) along the line through the two
        contexts' ratios, v never below 1. Example: v(5) 1.05 at 128 and 1.15 at 1024 -> 1.10
        at 576."""
        if self.long_verify is None:
            return self
        short, long = self.contexts
        weight = (context - short) / (long - short)
        if self.long_step is None:
            verify = tuple(max(1.0, v + weight * (w - v))
                           for v, w in zip(self.verify, self.long_verify, strict=True))
            draft_step = self.draft_step
            if self.long_draft_step is not None:
                draft_step = max(0.0, draft_step + weight * (self.long_draft_step - draft_step))
        else:
            # 1. each pass's time in short-context steps, growing at least as a shorter pass's
            growth, times = 0.0, []
            for v, w in zip(self.verify, self.long_verify, strict=True):
                growth = max(growth, w * self.long_step - v)
                times.append(max(v + weight * growth, 1e-6))
            # 2. over the one-token step's time at this context
            verify = tuple(max(1.0, t / times[0]) for t in times)
            draft_step = self.draft_step
            if self.long_draft_step is not None:
                draft_growth = max(0.0, self.long_draft_step * self.long_step - draft_step)
                draft_step = max(0.0, draft_step + weight * draft_growth) / times[0]
        return dataclasses.replace(self, verify=verify, long_verify=None, draft_step=draft_step,
                                   long_draft_step=None, long_step=None)

    def sampled(self) -> CostModel:
        """The prices a sampled row sees: each drafted token also costs sampling_step."""
        return dataclasses.replace(self, draft_step=self.draft_step + self.sampling_step,
                                   sampling_step=0.0)

    @property
    def k_max(self) -> int:
        return len(self.verify) - 1

    def row_share(self, batch: int) -> CostModel:
        """The prices one row of a batch sees for its own extra positions, when the other rows
        keep theirs: v_row(n) = 1 + (v(n) - 1) / batch, since v(n) is measured with every row
        at n positions and the pass grows with the positions it holds (linearly, between the
        measured points). Example: batch 4, v(5) = 1.40 -> v_row(5) = 1.10."""
        def share(curve: tuple[float, ...] | None) -> tuple[float, ...] | None:
            return None if curve is None else tuple(1.0 + (v - 1.0) / batch for v in curve)

        return dataclasses.replace(self, verify=share(self.verify),
                                   long_verify=share(self.long_verify))

    def scaled(self, factor: float) -> CostModel:
        """An estimate of the cost model of a batch `factor` times as many rows as this one's
        (factor >= 1), for a batch size not measured yet. A pass of `factor` times the rows
        over n positions each feeds as many tokens as one of these rows over factor * n, and
        costs about as much (the weights are read once either way; attention, which grows
        with the rows instead, is the smaller part at these contexts): v'(n) = v(factor * n) /
        v(factor), at both contexts. Past the measured positions v goes on along the mean step
        of the curve's upper half (its last step alone may be flattened by noise and by the
        curve being made monotone). c and a sampled row's extra are kept (a draft step grows
        with the rows much as a target step does); the step's growth with the context
        (`long_step`) becomes a pass over `factor` positions' growth. Example: v(1..5) = 1.0,
        1.1, 1.2, 1.3, 1.4, factor 4 -> v'(2) = v(8) / v(4) = 1.7 / 1.3 = 1.31."""
        if factor < 1:
            raise ValueError(f"a cost model scales up to more rows, not by {factor}")

        def extended(curve: tuple[float, ...]) -> Callable[[float], float]:
            plain = dataclasses.replace(self, verify=curve, long_verify=None)
            last, mid = len(curve), (len(curve) + 1) // 2
            slope = (curve[-1] - curve[mid - 1]) / (last - mid) if last > mid else 0.0
            return lambda x: plain.v(x) if x <= last else curve[-1] + slope * (x - last)

        def grown(curve: tuple[float, ...]) -> tuple[float, ...]:
            v = extended(curve)
            return tuple(max(1.0, v(factor * n) / v(factor)) for n in range(1, len(curve) + 1))

        long_step = self.long_step
        if long_step is not None and self.long_verify is not None:
            # the unit becomes a pass over `factor` positions at each context: its growth
            # with the context is that pass's, not a one-position step's
            long_step *= extended(self.long_verify)(factor) / extended(self.verify)(factor)
        return dataclasses.replace(
            self, verify=grown(self.verify),
            target_step_s=self.target_step_s * extended(self.verify)(factor),
            long_verify=None if self.long_verify is None else grown(self.long_verify),
            long_step=long_step)

    def tree(self, width: int, max_nodes: int = MAX_TREE_NODES,
             nodes: float | None = None) -> CostModel:
        """The prices of token trees `width` wide, by depth: verify[k] = v(nodes k + 1), a pass
        over the tree's nodes and the root, extended past the measured positions along the
        last measured step; depth up to max_nodes // width. nodes: the nodes a depth is priced
        at (default width; fewer where trees are cut before verifying). Width 1 is this model.
        """
        if width <= 1:
            return self
        depth = max(1, max_nodes // width)
        nodes = float(width if nodes is None else nodes)
        return dataclasses.replace(self, verify=tuple(self.v(nodes * k + 1)
                                                      for k in range(depth + 1)))

    def v(self, positions: float) -> float:
        """v(positions), between measured positions along the line joining them, past them
        along the last measured step."""
        if self.long_verify is not None:
            raise ValueError("price passes at a context: costs.at(context)")
        last = len(self.verify)
        if positions <= last:
            below = max(1, int(positions))
            above = min(last, below + 1)
            return self.verify[below - 1] + (positions - below) * (
                self.verify[above - 1] - self.verify[below - 1])
        slope = self.verify[-1] - self.verify[-2] if last > 1 else 0.0
        return self.verify[-1] + slope * (positions - last)



class MeasurementInterrupted(Exception):
    """A measurement stopped because its `interrupt` asked it to (nothing is kept of it)."""


Interrupt = Callable[[], bool] | None  # asked between two passes: True stops the measurement


def check(interrupt: Interrupt) -> None:
    if interrupt is not None and interrupt():
        raise MeasurementInterrupted


def fastest(fns: list, repeats: int, interrupt: Interrupt = None) -> list[float]:
    """The fastest of `repeats` timings of each fn, timed in interleaved rounds (fn 1, 2, ...,
    then again), so a burst of machine noise costs one sample of each, not every sample of one.
    The minimum, not the median: noise only ever adds time. interrupt: asked before each
    timing (MeasurementInterrupted when it says stop)."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            check(interrupt)
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def verify_curve(pass_s: list[float]) -> tuple[float, ...]:
    """v(n) = pass_s[n-1] / pass_s[0], made non-decreasing from the right: a pass over more
    positions cannot be cheaper, so a noisy sample above a later one is lowered to it (rather
    than raising every later value to a spike)."""
    unit = pass_s[0]
    curve = [seconds / unit for seconds in pass_s]
    for n in range(len(curve) - 2, -1, -1):
        curve[n] = min(curve[n], curve[n + 1])
    return tuple(max(1.0, v) for v in curve)


def measure_costs(target, drafter, k_max: int = 8, context: int = 128, repeats: int = 5,
                  long_context: int = 1024) -> CostModel:
    """Time target passes over 1..k_max+1 positions and one draft step after `context` tokens,
    and the passes again after `long_context` tokens (where the model's context allows).

    Uses the real runtime objects: `target` is a Runner, `drafter` any Drafter (None
    gives c = 0). Fastest of `repeats` interleaved timings; the caches are warmed first.
    """
    generator = torch.Generator().manual_seed(0)
    vocab = min(target.vocab_size, 1000)
    extra = torch.randint(0, vocab, (k_max + 1,), generator=generator)

    def prefilled(runner, length: int) -> torch.Tensor:
        history = torch.randint(0, vocab, (length,), generator=generator)
        runner.logits(history, 1)  # prefill, and warm up
        return history

    def passes(runner, history: torch.Tensor) -> list:
        return [lambda n=n: runner.logits(torch.cat([history, extra[:n]]), n)
                for n in range(1, k_max + 2)]

    def draft_time(history: torch.Tensor, params: SamplingParams | None = None,
                   paired: bool = False) -> tuple[float, float]:
        """Seconds of one draft token after history and, where `paired`, of a one-token target
        pass after it timed in the same rounds (on a sibling holding history, so the drafter's
        own target is left as it is; else 0.0). c is their ratio: timed minutes apart the two
        took the machine's state of two moments (a noisy VM's read bandwidth moves a step by
        ~40% from minute to minute: the Qwen2.5-Coder pair's c measured 0.41 where it is
        ~0.28, and its default drafted with the 0.5B in 21 rounds of ~300). (0.0, 1.0)
        without a drafter."""
        if drafter is None:
            return 0.0, 1.0
        params = params or SamplingParams()
        rng = None if params.greedy else torch.Generator().manual_seed(0)
        drafter.propose(history, 1, params, rng)
        # One draft token after the history: the drafter's cache holds all but the last token.
        step = torch.cat([history, extra[:1]])
        timed = [lambda: drafter.propose(step, 1, params, rng),
                 lambda: drafter.propose(history, 1, params, rng)]
        if paired:
            pair = target.sibling()
            pair.logits(history, 1)
            timed.append(lambda: pair.logits(step, 1))
        times = fastest(timed, repeats)
        return times[0], times[2] if paired else 0.0

    def catch_up_time(history: torch.Tensor) -> float:
        """Seconds a drafter with an empty cache takes per history token before it proposes
        (one proposal of a token after it, less a draft step; the faster of two)."""
        if drafter is None:
            return 0.0
        params = SamplingParams()
        times = []
        for _ in range(2):
            drafter.reset()
            start = time.perf_counter()
            drafter.propose(history, 1, params, None)
            times.append(time.perf_counter() - start)
        return max(0.0, min(times) - draft_s) / int(history.numel())

    long_verify = long_draft = long_step = None
    if context < long_context <= target.max_positions - k_max - 1:
        # The passes after both contexts timed in alternation (a sibling holds the short
        # history): what the longer context adds is a small difference of two times, and a
        # machine that slowed down between two separate timings would pass for it.
        long_history = prefilled(target, long_context)
        short_runner = target.sibling()
        history = prefilled(short_runner, context)
        times = fastest(passes(short_runner, history) + passes(target, long_history), repeats)
        pass_s, long_s = times[:k_max + 1], times[k_max + 1:]
        long_verify, long_step = verify_curve(long_s), long_s[0] / pass_s[0]
        long_draft = draft_time(long_history)[0] / long_s[0]
        target.logits(history, 1)  # the target holds the short history for the draft timings
    else:
        history = prefilled(target, context)
        pass_s = fastest(passes(target, history), repeats)
    draft_s, paired_step_s = draft_time(history, paired=True)
    sampled_s = max(0.0, draft_time(history, SamplingParams(temperature=1.0))[0] - draft_s)
    return CostModel(draft_step=draft_s / paired_step_s, verify=verify_curve(pass_s),
                     target_step_s=pass_s[0], long_verify=long_verify,
                     contexts=(context, long_context), long_draft_step=long_draft,
                     long_step=long_step,
                     sampling_step=(sampled_s + sampled_verify_time(
                         target.vocab_size, repeats)) / pass_s[0],
                     draft_catch_up_s=catch_up_time(history))


def sampled_verify_time(vocab_size: int, repeats: int) -> float:
    """Seconds that verifying one sampled draft token adds to plain sampling: the target's
    distribution warped at two positions and the rejection step, against warping one and
    drawing from it (random logits; the times do not depend on them). A round of one token:
    the round's fixed part (the draw after the last position) is charged to its token, which
    overprices longer rounds a little, on the side of not drafting."""
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0)
    logits = torch.randn(2, vocab_size, generator=generator)  # [2, V]
    draft_probs = torch.softmax(torch.randn(1, vocab_size, generator=generator), -1)  # [1, V]
    tokens = torch.randint(0, vocab_size, (1,), generator=generator)  # [1]
    row = [RowVerification("token", generator)]
    plain, drafted = fastest([
        lambda: sample(warp(logits[:1], params), generator),
        lambda: verify_rows(tokens, [0, 1], draft_probs, warp(logits, params), row)],
        repeats)
    return max(0.0, drafted - plain)


PREFILL_CHUNK = 64  # a batch measurement's prefill feeds one row this much at a time


def measure_batch_costs(target, drafter, batch: int, k_max: int = 8, context: int = 128,
                        repeats: int = 3, long_context: int = 1024,
                        greedy_trees: bool = False, interrupt: Interrupt = None) -> CostModel:
    """The cost model of a batch of `batch` sequences, in units of one plain batched step
    (every row one position): v(n) times a pass where every row has n positions, c one draft
    step for every row; the passes after both contexts timed in alternation as
    `measure_costs` times them (`long_step`: the batch step's growth). `target` is a runner
    (its siblings hold the rows), `drafter` any Drafter (its forks draft the rows) or None.
    greedy_trees: whether greedy rows draft token trees at this batch size (as
    `propose_batch` takes it): c is timed drafting the same way (a tree's first step costs
    ~1.35x a chain's at batch 4 and 16). interrupt: asked between
    any two passes (each row's prefill goes in chunks of PREFILL_CHUNK tokens), so that
    whoever measures while a server idles is back within one pass when a request arrives
    (MeasurementInterrupted)."""
    generator = torch.Generator().manual_seed(0)
    vocab = min(target.vocab_size, 1000)
    runners = [target.sibling() for _ in range(batch)]
    extra = torch.randint(0, vocab, (k_max + 1,), generator=generator)

    def prefilled(rows: list, length: int) -> list[torch.Tensor]:
        histories = [torch.randint(0, vocab, (length,), generator=generator) for _ in rows]
        for runner, history in zip(rows, histories, strict=True):
            for end in range(PREFILL_CHUNK, length + PREFILL_CHUNK, PREFILL_CHUNK):
                check(interrupt)
                runner.logits(history[:min(end, length)], 1)
        check(interrupt)
        batched_logits(rows, histories, [1] * batch)  # warm up (each row's last position)
        return histories

    def passes(rows: list, histories: list[torch.Tensor]) -> list:
        return [lambda n=n: batched_logits(
            rows, [torch.cat([h, extra[:n]]) for h in histories], [n] * batch)
            for n in range(1, k_max + 2)]

    long_verify = long_step = None
    if context < long_context <= target.max_positions - k_max - 1:
        # As `measure_costs`: the passes after both contexts in alternation (a second set of
        # rows holds the long histories), and the step's growth kept (`CostModel.at`).
        long_rows = [target.sibling() for _ in range(batch)]
        long_histories = prefilled(long_rows, long_context)
        histories = prefilled(runners, context)
        times = fastest(passes(runners, histories) + passes(long_rows, long_histories),
                        repeats, interrupt)
        pass_s, long_s = times[:k_max + 1], times[k_max + 1:]
        long_verify, long_step = verify_curve(long_s), long_s[0] / pass_s[0]
        del long_rows, long_histories  # their caches go before the draft's are filled
    else:
        histories = prefilled(runners, context)
        pass_s = fastest(passes(runners, histories), repeats, interrupt)
    draft_s = 0.0
    if drafter is not None:
        drafters = [drafter.fork() for _ in runners]
        for row_drafter, runner in zip(drafters, runners, strict=True):
            follow_target(row_drafter, runner)
        greedy = [SamplingParams()] * batch
        # A round's draft step reads what the last round verified first: after an accepted
        # draft token, it and the target's bonus token, two positions a row (one after a
        # rejection). At one row two positions cost what one does (the weights are read once
        # either way); at batch 4 the draft model's pass over eight positions costs ~1.4x its
        # pass over four, and timing one position a row underpriced c by that much (0.30
        # against 0.37 a round on an Intel Xeon: the batch drafted at a loss, 0.92x plain).
        # Timed after an acceptance, so longer chains' later steps are priced a little high:
        # on the side of not drafting.
        behind = [torch.cat([h, extra[:2]]) for h in histories]

        def draft_step() -> None:
            propose_batch(drafters, behind, [1] * batch, greedy, [None] * batch,
                          greedy_trees=greedy_trees)

        def roll_back() -> None:  # each row's draft cache back to its history
            propose_batch(drafters, histories, [1] * batch, greedy, [None] * batch,
                          greedy_trees=greedy_trees)

        check(interrupt)
        roll_back()
        draft_s = fastest([draft_step, roll_back], repeats, interrupt)[0]
    return CostModel(draft_step=draft_s / pass_s[0], verify=verify_curve(pass_s),
                     target_step_s=pass_s[0], long_verify=long_verify,
                     contexts=(context, long_context), long_step=long_step)

