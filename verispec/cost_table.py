"""Which cost models a decoder prices its rounds with, and when each is measured.

Under k="auto" a round is priced by the cost model of its batch size (verispec.costs): the
one-row model for a row alone, a batch size's own model for a batch. A measurement takes a
while: a few seconds for the one-row model of the embedded model, minutes for batch 16 on a slow
laptop (every row's prefill after 1024 tokens dominates). So:

1. Every model measured is kept in the cost cache (verispec.cost_cache) when the decoder knows
   the files its models came from (`SpeculativeDecoder.from_pretrained`), and read back by any
   later process of the same configuration: measured once per machine and model.
2. The one-row model is measured (or read) on first use, before any request is timed.
3. A batch size not measured yet is priced by an estimate scaled from the largest measured
   size below it (`CostModel.scaled`): a round never waits for a measurement, which would
   stall every stream of the batch for as long as it takes.
4. Batch sizes are measured only where someone asks (`measure`): the benchmark before it times,
   `verispec costs --max-batch`, and the server's engine while it has nothing else to do,
   interrupted within one pass when a request arrives (verispec.server.worker).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from verispec.config import DecodeConfig
from verispec.cost_cache import CostCache, cost_key, folder
from verispec.costs import CostModel, Interrupt, measure_batch_costs, measure_costs
from verispec.drafters.feature import FeatureDrafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.model import ModelDrafter
from verispec.round_costs import ObservedCosts

log = logging.getLogger("verispec")

CONTEXTS = (128, 1024)  # the contexts every model is timed at (CostModel.at between them)
REPEATS = 5  # timings of each pass, the fastest kept: one row
BATCH_REPEATS = 3  # a batch


class CostTable:
    """The cost models of one target and drafter, by batch size (1: the one-row model)."""

    def __init__(self, target, drafter, config: DecodeConfig,
                 files: Sequence[str | os.PathLike] = (), one_row: CostModel | None = None
                 ) -> None:
        """target: a runner; drafter: any Drafter or None; files: the model files (or folders)
        target and drafter were loaded from, which key the cost cache (none: nothing is kept
        on disk); one_row: the one-row model to use instead of measuring it."""
        self.target, self.drafter, self.config = target, drafter, config
        self.files = tuple(files)
        self._models: dict[int, CostModel] = {} if one_row is None else {1: one_row}
        self._cache: CostCache | None = None
        self._read = False  # whether the cache was read (once, on first use)
        self._estimated: set[int] = set()  # sizes said in the log to be estimates
        # what a lone greedy row's rounds took against the one-row model (verispec.round_costs):
        # a draft model's (or feature draft's) rounds hold it back where it drafts at a loss; a
        # feature draft's also price its step (its small head a tight loop times in cache); a
        # model handed in is priced as given
        self.observed = ObservedCosts(corrects_draft=_reads_features(drafter),
                                      probe_every=config.probe_every) \
            if one_row is None and _model_of(drafter) is not None else None

    def one_row(self) -> CostModel:
        """The one-row model, measured on first use (or read from the cost cache)."""
        self._read_cache()
        if 1 not in self._models:
            costs = measure_costs(self.target, self.drafter, k_max=self.config.auto_k_max,
                                  context=CONTEXTS[0], long_context=CONTEXTS[1],
                                  repeats=REPEATS)
            log.info("cost model: draft step c=%.3f, verify v(1..%d)=%s (after %d tokens; "
                     "after %d: %s, c=%s, a step %sx), target step %.1f ms, draft catch-up "
                     "%.2f ms a token",
                     costs.draft_step, len(costs.verify), _curve(costs.verify),
                     costs.contexts[0], costs.contexts[1], _curve(costs.long_verify) or "-",
                     "-" if costs.long_draft_step is None else f"{costs.long_draft_step:.3f}",
                     "-" if costs.long_step is None else f"{costs.long_step:.2f}",
                     costs.target_step_s * 1e3, costs.draft_catch_up_s * 1e3)
            self._keep(1, costs)
        return self._models[1]

    def share_measurements(self, other: CostTable) -> None:
        """Price with the cost models `other` measures (or has measured), each table keeping
        its own record of what its rounds took (`observed`): one measurement for the decoders
        of one target and draft model compared in a benchmark (its draft-model method and
        the default beside lookups). Measured apart, two of them differed by the machine's
        drift (v(2) 1.04 against 1.22 a minute later), and each method was priced by its own
        noise."""
        other._read_cache()  # what it has measured before, whichever table asks first
        self._models, self._estimated = other._models, other._estimated
        self._read = True

    def prices(self, batch: int) -> CostModel:
        """The cost model a batch of `batch` rows is priced with now: its size's (the next
        measured size up, `DecodeConfig.cost_batch_size`) where measured, else scaled from
        the largest measured size below. Measures nothing but the one-row model."""
        size = self.config.cost_batch_size(batch)
        self.one_row()
        if size in self._models:
            return self._models[size]
        below = max(s for s in self._models if s < size)
        if size not in self._estimated:
            self._estimated.add(size)
            log.info("cost model at batch %d: not measured yet, scaled from batch %d's", size,
                     below)
        return self._models[below].scaled(size / below)

    def measure(self, batch: int, interrupt: Interrupt = None) -> CostModel:
        """The cost model of `batch` rows' size, measured now unless it is known (or in the
        cost cache). interrupt: as `measure_batch_costs` takes it (MeasurementInterrupted)."""
        size = self.config.cost_batch_size(batch)
        if size == 1:
            return self.one_row()
        self._read_cache()
        if size not in self._models:
            k_max = self.config.auto_k_max
            costs = measure_batch_costs(self.target, self.drafter, batch=size, k_max=k_max,
                                        context=CONTEXTS[0], long_context=CONTEXTS[1],
                                        repeats=BATCH_REPEATS,
                                        greedy_trees=size <= self.config.tree_max_batch,
                                        interrupt=interrupt)
            # a lagging row catches up in the batch's draft passes, in about the seconds it
            # takes alone
            costs = dataclasses.replace(costs,
                                        draft_catch_up_s=self.one_row().draft_catch_up_s)
            log.info("cost model at batch %d: c=%.3f, v(1..%d)=%s", size, costs.draft_step,
                     k_max + 1, _curve(costs.verify))
            self._keep(size, costs)
        return self._models[size]

    def unmeasured(self, max_batch: int) -> list[int]:
        """The batch sizes with models of their own (`DecodeConfig.cost_batch_sizes`) that a
        batch of up to max_batch rows is priced at and that are neither measured nor in the
        cost cache, smallest first; the one-row model aside. Example: sizes 1, 2, 4, 8, 16,
        max_batch 6, 2 measured -> [4, 8]."""
        self._read_cache()
        top = self.config.cost_batch_size(max_batch)
        return [size for size in self.config.cost_batch_sizes
                if 1 < size <= top and size not in self._models]

    def remeasure(self, max_batch: int = 1) -> dict[int, CostModel]:
        """Measure the one-row model and every size up to max_batch's afresh, and make them
        the cost cache's models of this configuration (`verispec costs`)."""
        self._read = True
        self._models.clear()
        self._estimated.clear()
        self.one_row()
        for size in self.unmeasured(max_batch):
            self.measure(size)
        cache = self._cache_file()
        if cache is not None:
            cache.store(self._models, replace=True)
        return dict(self._models)

    @property
    def cache_path(self) -> Path | None:
        """The file this table's models are kept in (None: not kept)."""
        cache = self._cache_file()
        return None if cache is None else cache.path

    def _keep(self, size: int, costs: CostModel) -> None:
        self._models[size] = costs
        cache = self._cache_file()
        if cache is not None:
            cache.store({size: costs})

    def _read_cache(self) -> None:
        if self._read:
            return
        self._read = True
        cache = self._cache_file()
        if cache is None:
            return
        found = cache.load()
        for size, costs in found.items():
            self._models.setdefault(size, costs)
        if found:
            log.info("cost models read from %s (batch sizes %s)", cache.path,
                     ", ".join(map(str, sorted(found))))

    def _cache_file(self) -> CostCache | None:
        """The cost cache of this configuration (built once; None: no files, or turned off)."""
        root = folder()
        if not self.files or root is None:
            return None
        if self._cache is None or self._cache.path.parent != root:
            measurement = {"k_max": self.config.auto_k_max, "contexts": list(CONTEXTS),
                           "repeats": REPEATS, "batch_repeats": BATCH_REPEATS,
                           "tree_max_batch": self.config.tree_max_batch,
                           "cost_batch_sizes": list(self.config.cost_batch_sizes)}
            self._cache = CostCache(cost_key(self.target, self.drafter, self.files,
                                             measurement), root)
        return self._cache


def _curve(values: Sequence[float] | None) -> str:
    return " ".join(f"{v:.2f}" for v in values or ())


def _model_of(drafter):
    """The drafter's model, alone or beside a lookup (a HybridDrafter's), else None."""
    model = drafter.model if isinstance(drafter, HybridDrafter) else drafter
    return model if isinstance(model, FeatureDrafter | ModelDrafter) else None


def _reads_features(drafter) -> bool:
    """Whether the drafter's model is a feature draft (alone or beside a lookup)."""
    return isinstance(_model_of(drafter), FeatureDrafter)
