"""A drafter that reads the target's features: an EAGLE-style head (`verispec.distill.feature_head`)
run on the native runtime.

The target's native runner keeps every position's last hidden state (`runner.features`). After a
round, the history's last token x_{L-1} was just drawn from the target at position L-2, whose
feature f_{L-2} is known: the draft reads (f_s, x_{s+1}) for every position s it has not read
yet, up to L-2, then drafts x_L, x_{L+1}, ... feeding its own predicted features back in. Its
KV cache is indexed by position like the target's: positions past the last real feature are
written over in the next round. The first round (no target features yet) drafts nothing. A
prompt the target takes in chunks is read a chunk a round as it comes in (`catch_up`).

A head with taps also reads the target's hidden states after some of its layers at the real
positions (it asks the target's runner to keep them: `NativeRunner.keep_taps`); drafted positions
have none, as in training.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from transformers import PreTrainedModel

from verispec.config import DEFAULT_TREE_WIDTH, MAX_TREE_NODES, check_tree_width
from verispec.drafters.drafter import Draft, empty_draft
from verispec.drafters.model import fit_vocab
from verispec.errors import IncompatibleDraftError
from verispec.params import SamplingParams
from verispec.quant.gguf import GGUFTensor
from verispec.quant.linear import ConcatLinear, QuantLinear, QuantMatrix
from verispec.runtime import Runner, common_prefix
from verispec.runtime.native import NativeRunner, bf16_kernels
from verispec.runtime.native.cache import TreeLinks
from verispec.runtime.native.gguf_model import GGUFLlama
from verispec.runtime.native.layers import LayerWeights, Linear
from verispec.runtime.native.llama import NativeLlama, RowPass
from verispec.runtime.native.shape import LlamaShape
from verispec.sampling import draw, greedy_tokens, has_mass, sample_distinct, warp


class FeatureDrafter:
    """One sequence's feature drafter. `follow(runner)` ties it to the target runner of the same
    sequence (the decoder and the scheduler do this); `fork()` gives one for another sequence."""

    name = "feature"

    def __init__(self, weights: dict[str, torch.Tensor], head_token_ids: torch.Tensor,
                 target: PreTrainedModel, vocab_size: int, taps: tuple[int, ...] = (),
                 tree_width: int = DEFAULT_TREE_WIDTH, sampled_tree_width: int = 1) -> None:
        self.weights, self.head_token_ids = weights, head_token_ids.long()
        self.target_model, self.vocab_size, self.taps = target, vocab_size, tuple(taps)
        self.runner: NativeRunner | None = None  # the target's runner for this sequence
        self.model: _FeatureModel | None = None  # built on the first follow(), shared by forks
        self.cache = None
        self.fed = torch.empty(0, dtype=torch.long)  # history whose real pairs are in the cache
        # Greedy rows draft token trees this wide (the best `tree_width` continuations by the
        # head's cumulative probability at every depth), sampled rows sampled_tree_width wide
        # (as many draws for the next token without replacement, a chain under each); 1: chains.
        self.tree_width = check_tree_width(tree_width)
        self.sampled_tree_width = check_tree_width(sampled_tree_width)

    def follow(self, runner: Runner) -> None:
        """Read `runner`'s features from now on, asking it to keep this head's taps (a runner
        that keeps none forgets its sequence then; see NativeRunner.keep_taps)."""
        if not isinstance(runner, NativeRunner):
            raise IncompatibleDraftError("a feature draft reads the target's hidden states, which "
                                         "only the native runtime keeps: use --runtime native "
                                         "(or auto) with a Llama-family target")
        try:
            runner.keep_taps(self.taps)
        except ValueError as err:
            raise IncompatibleDraftError(f"the target's runner keeps the hidden states after "
                                         f"layers {runner.tap_layers} for another feature draft; "
                                         f"this one reads {self.taps}") from err
        if self.model is None:
            self.model = _FeatureModel(self.weights, self.head_token_ids, self.target_model,
                                       runner.model)
        self.runner = runner
        self.cache = self.model.native.new_cache()
        self.reset()

    def reset(self) -> None:
        self.fed = torch.empty(0, dtype=torch.long)

    def cache_bytes(self) -> int:
        """verispec.drafters.drafter.cache_bytes: the draft layer's cache (the features it
        reads are the target runner's)."""
        return 0 if self.cache is None else self.cache.nbytes

    def bytes_per_position(self) -> int:
        return 0 if self.cache is None else self.cache.bytes_per_position

    def limit_growth(self, positions: int | None) -> None:
        if self.cache is not None:
            self.cache.limit_growth(positions)

    def width_for(self, params: SamplingParams) -> int:
        """How wide this row's trees are (1: chains)."""
        return self.tree_width if params.greedy else self.sampled_tree_width

    def fork(self) -> FeatureDrafter:
        other = FeatureDrafter(self.weights, self.head_token_ids, self.target_model,
                               self.vocab_size, self.taps, self.tree_width,
                               self.sampled_tree_width)
        other.model = self.model
        return other

    def propose(
        self,
        history: torch.Tensor,  # [L] long
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        return propose_features_together([self], [history], [k], [params], [generator])[0]

    def catch_up(self, prefix_ids: torch.Tensor) -> None:
        """Read the pairs of prefix_ids [n] (a prompt whose first n - 1 tokens the target has
        taken) up to s = n-2 now, so the first proposal reads only the rest: a long prompt's
        pairs then come a chunk a round, beside the target's chunks, instead of in one pass
        (6,000 positions took 0.57 s, a stall for every other row of that round)."""
        if common_prefix(self.fed, prefix_ids) >= prefix_ids.numel():
            return  # read already (a proposal would read its last pair again, for its logits)
        first = self._first_to_read(prefix_ids, 1)  # what a one-token proposal would read
        if first is not None:
            _read_pairs(self.model, [self], [prefix_ids], [first])

    def _first_to_read(self, history: torch.Tensor, k: int) -> int | None:
        """The first position whose pair (f_s, x_{s+1}) this round reads, or None when it
        cannot draft (no k, or the target has no features for the history yet)."""
        if self.runner is None:
            raise RuntimeError("FeatureDrafter.follow(target runner) must come first")
        length = int(history.numel())
        self.runner.settle(history)  # a tree's accepted path, into place
        # The target's features are good for the positions whose tokens it saw as they are.
        if k <= 0 or length < 2 or common_prefix(self.runner.cached_ids, history) < length - 1:
            return None
        # Pairs read in earlier rounds stay good up to where the history still agrees; the last
        # one (s = L-2) is always read, its logits start the draft.
        return max(0, min(common_prefix(self.fed, history) - 1, length - 2))


def propose_features_together(drafters: list[FeatureDrafter], histories: list[torch.Tensor],
                              ks: list[int], params: list[SamplingParams],
                              generators: list[torch.Generator | None],
                              greedy_trees: bool = True) -> list[Draft]:
    """FeatureDrafter.propose for many sequences in lockstep: each draft step is one pass of the
    shared head over the rows that still want a token. Rows draw with their own params and
    generators, exactly as alone. Where the drafter has a tree width for them, sampled rows
    draw token trees, and greedy rows grow them if `greedy_trees` (a batch may ask for chains:
    a greedy row's output is the same either way, a sampled row's draws must not depend on the
    batch)."""
    drafts = [empty_draft() for _ in drafters]
    firsts = [d._first_to_read(h, k) for d, h, k in zip(drafters, histories, ks, strict=True)]
    rows = [i for i, first in enumerate(firsts) if first is not None]
    if not rows:
        return drafts
    model = drafters[rows[0]].model
    if any(drafters[i].model is not model for i in rows):
        raise ValueError("feature drafters drafting together must share one head")
    # 1. Every row reads its new real pairs, in one pass.
    logits = _read_pairs(model, [drafters[i] for i in rows], [histories[i] for i in rows],
                         [firsts[i] for i in rows])  # per row [1, Vh]
    # 2. Rows whose drafter has a tree width for them grow trees; the others draft chains.
    tree_rows = [n for n, i in enumerate(rows) if drafters[i].width_for(params[i]) > 1
                 and (greedy_trees or not params[i].greedy)]
    if tree_rows:
        grown = _grow_trees(model, [drafters[rows[n]] for n in tree_rows],
                            [histories[rows[n]] for n in tree_rows],
                            [ks[rows[n]] for n in tree_rows], [logits[n] for n in tree_rows],
                            [params[rows[n]] for n in tree_rows],
                            [generators[rows[n]] for n in tree_rows])
        for n, draft in zip(tree_rows, grown, strict=True):
            drafts[rows[n]] = draft
        logits = [row_logits for n, row_logits in enumerate(logits) if n not in tree_rows]
        rows = [i for n, i in enumerate(rows) if n not in tree_rows]
        if not rows:
            return drafts
    positions = {i: int(histories[i].numel()) - 2 for i in rows}
    ks = list(ks)  # a row's chain may stop early (below)
    tokens: dict[int, list[torch.Tensor]] = {i: [] for i in rows}
    probs: dict[int, list[torch.Tensor]] = {i: [] for i in rows}
    for step in range(max(ks[i] for i in rows)):
        # 3. Each drafting row draws its next token from its own warped distribution.
        for i, head_logits in zip(rows, logits, strict=True):  # [1, Vh]
            if params[i].greedy:  # the head's best token, without spreading it over V
                token = drafters[i].head_token_ids[greedy_tokens(head_logits).cpu()]  # [1]
            else:
                row_logits = fit_vocab(head_logits, drafters[i].vocab_size,
                                       drafters[i].head_token_ids)  # [1, V]
                draft_probs = warp(row_logits, params[i])  # [1, V]
                if not has_mass(draft_probs):  # nothing to draw from (a draft gone NaN)
                    ks[i] = step
                    continue
                token = draw(draft_probs, params[i], generators[i],
                             int(histories[i].numel()) + step).cpu()
                probs[i].append(draft_probs[0])
            tokens[i].append(token)
        # 4. Rows that want more read (their predicted feature, the token) in one pass.
        rows = [i for i in rows if ks[i] > step + 1]
        if not rows:
            break
        passes = []
        for i in rows:
            cache, position = drafters[i].cache, positions[i]
            passes.append((cache, cache.features[position:position + 1], tokens[i][-1],
                           position + 1))
            positions[i] = position + 1
        logits = model.step_rows(passes)
    for i, row_tokens in tokens.items():
        if row_tokens:
            drafts[i] = Draft(torch.cat(row_tokens), torch.stack(probs[i]) if probs[i] else None)
    return drafts


def _read_pairs(model: _FeatureModel, drafters: list[FeatureDrafter],
                histories: list[torch.Tensor], firsts: list[int]) -> list[torch.Tensor]:
    """Each row reads its real pairs (f_s, x_{s+1}), s = first..L-2, all rows in one pass, with
    the target's taps there when the head reads them -> per row logits [1, Vh] of its last
    pair; each drafter's `fed` becomes its history."""
    passes, taps = [], []
    for drafter, history, first in zip(drafters, histories, firsts, strict=True):
        target = drafter.runner
        features = target.features(first, history.numel() - 1)  # [T, H]
        passes.append((drafter.cache, features, history[first + 1:], first))
        if model.fc_taps is not None:
            taps.append(target.tapped_states(first, history.numel() - 1))  # [T, n, H]
        drafter.fed = history
    return model.step_rows(passes, torch.cat(taps) if taps else None)


def _grow_trees(model: _FeatureModel, drafters: list[FeatureDrafter],
                histories: list[torch.Tensor], ks: list[int], root_logits: list[torch.Tensor],
                params: list[SamplingParams], generators: list[torch.Generator | None]
                ) -> list[Draft]:
    """Token trees, in lockstep, each depth but the last one head pass over every row's new
    nodes, as tree nodes in the draft's cache (slot L-1 on, under the last real pair at L-2).
    Greedy rows: at every depth up to k, the `tree_width` best children (by the head's
    cumulative log-probability) of the nodes at the depth above. Sampled rows:
    `sampled_tree_width` children of the root drawn from the warped head without replacement,
    then one child each per depth, up to 15 tokens (the shape fixed before any draw, as
    `rejection_sample_tree` needs). root_logits: per row [1, Vh]."""
    trees = []
    for drafter, history, k, logits, row_params, generator in zip(
            drafters, histories, ks, root_logits, params, generators, strict=True):
        width = drafter.width_for(row_params)
        base = int(history.numel()) - 1  # the draft cache's first tree slot
        # every depth but the last feeds `width` nodes into the cache: near the end of the
        # context the tree is cut shallower, so that its slots stay within it
        k = min(k, (drafter.cache.shape.max_positions - base) // width + 1)
        if row_params.greedy:
            trees.append(_Tree(width, k, base))
        else:
            trees.append(_Tree(width, min(k, MAX_TREE_NODES // width), base, row_params,
                               generator, drafter.vocab_size))
        trees[-1].add_children(logits, [-1], drafter.head_token_ids)
    for depth in range(2, max(tree.depth for tree in trees) + 1):
        # (a tree whose last level drew nothing, its distributions gone NaN, stops)
        growing = [n for n, tree in enumerate(trees) if tree.depth >= depth and tree.frontier]
        if not growing:
            break
        passes, links, fed = [], [], []
        for n in growing:
            tree, cache = trees[n], drafters[n].cache
            nodes = tree.frontier
            parent_slots = [tree.slot_of(tree.parents[node]) for node in nodes]
            start = tree.base + len(tree.slots)
            tree.slots.update({node: start + j for j, node in enumerate(nodes)})
            tree.slot_parents.extend(parent_slots)
            passes.append((cache, cache.features[parent_slots],
                           torch.tensor([tree.tokens[node] for node in nodes]), start))
            links.append(TreeLinks(tree.base, torch.tensor(tree.slot_parents)))
            fed.append(nodes)
        logits = model.step_rows(passes, trees=links)  # per row [T, Vh]
        for n, nodes, node_logits in zip(growing, fed, logits, strict=True):
            trees[n].add_children(node_logits, nodes, drafters[n].head_token_ids)
    return [tree.draft() for tree in trees]


class _Tree:
    """A token tree as it grows: nodes in order of depth, each with its parent, token, and,
    once fed to the head, its slot in the draft's cache; greedy trees keep each node's
    cumulative log-probability, sampled ones the distribution it was drawn from."""

    def __init__(self, width: int, depth: int, base: int, params: SamplingParams | None = None,
                 generator: torch.Generator | None = None, vocab_size: int = 0) -> None:
        self.width, self.depth, self.base = width, depth, base
        self.params, self.generator, self.vocab_size = params, generator, vocab_size
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []  # greedy
        self.probs: list[torch.Tensor] = []  # sampled: [V] each
        self.frontier: list[int] = []  # the nodes of the deepest level so far
        self.slots: dict[int, int] = {}  # node -> draft cache slot
        self.slot_parents: list[int] = []  # the parent slot of slot base, base + 1, ...

    def slot_of(self, node: int) -> int:
        return self.base - 1 if node < 0 else self.slots[node]

    def add_children(self, logits: torch.Tensor, nodes: list[int],
                     head_token_ids: torch.Tensor) -> None:
        """logits [len(nodes), Vh]: the head after each of nodes (-1: the root) -> the next
        level joins the tree."""
        if self.params is None:
            self._best_children(logits.float().log_softmax(-1), nodes, head_token_ids)
        else:
            self._drawn_children(logits, nodes, head_token_ids)

    def _best_children(self, log_probs: torch.Tensor, nodes: list[int],
                       head_token_ids: torch.Tensor) -> None:
        """The `width` best children of nodes by cumulative log-probability."""
        base_scores = torch.tensor([0.0 if node < 0 else self.scores[node] for node in nodes])
        top, index = log_probs.topk(self.width, dim=-1)  # [n, w] each
        totals = (base_scores[:, None] + top).flatten()  # [n w]
        best = totals.topk(min(self.width, totals.numel())).indices.tolist()
        candidates = head_token_ids[index.flatten()].tolist()  # [n w] token ids
        totals = totals.tolist()
        self.frontier = []
        for flat in best:
            self.frontier.append(len(self.tokens))
            self.tokens.append(candidates[flat])
            self.parents.append(nodes[flat // self.width])
            self.scores.append(totals[flat])

    def _drawn_children(self, logits: torch.Tensor, nodes: list[int],
                        head_token_ids: torch.Tensor) -> None:
        """`width` children of the root, one of every other node, drawn from the node's warped
        draft distribution without replacement (as many as it has tokens of positive mass)."""
        draft_probs = warp(fit_vocab(logits, self.vocab_size, head_token_ids), self.params)
        self.frontier = []
        for row, node in enumerate(nodes):  # [n, V]
            count = self.width if node < 0 else 1
            if not has_mass(draft_probs[row]):  # nothing to draw from: no children
                continue
            drawn = sample_distinct(draft_probs[row], count, self.generator)
            for token in drawn:
                self.frontier.append(len(self.tokens))
                self.tokens.append(int(token))
                self.parents.append(node)
                self.probs.append(draft_probs[row])

    def draft(self) -> Draft:
        if not self.tokens:  # nothing drawn at the root
            return empty_draft()
        tokens = torch.tensor(self.tokens, dtype=torch.long)
        parents = torch.tensor(self.parents, dtype=torch.long)
        if self.params is None:
            return Draft(tokens, None, 0, parents, torch.tensor(self.scores))
        return Draft(tokens, torch.stack(self.probs), 0, parents)


def tap_inputs(taps: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., n, H] tapped hidden states -> [..., n H]: each RMS-normalised (their scales differ
    by tens across the stack), side by side."""
    return F.rms_norm(taps, (taps.shape[-1],), eps=eps).flatten(-2)


class _FeatureModel:
    """The head's weights on the target's runtime: fc, one layer, the target's norm and head
    rows (a NativeLlama of one layer fed with fused vectors instead of token embeddings).

    Beside a quantised (GGUF) target, whose activations are float32, the head runs on
    verispec's kernels, its layer in one C++ call: in bfloat16 where the bfloat16 kernels run
    (AVX512-BF16 or AMX), else with its matrices quantised to Q8_0 at load on the quantised
    kernels (AVX2, AVX-512 without BF16). A draft only proposes, so its rounding never reaches
    the output, and its float32 PyTorch layer cost most of a quantised target's step (SmolLM2:
    c 0.80 -> 0.15 in bfloat16). Elsewhere it runs in the target's dtype, as training computed
    it."""

    def __init__(self, weights: dict[str, torch.Tensor], head_token_ids: torch.Tensor,
                 target: PreTrainedModel, target_native: NativeLlama) -> None:
        device = target_native.device
        quantised = isinstance(target_native, GGUFLlama) and device.type == "cpu"
        in_bf16 = quantised and bf16_kernels.load() is not None
        in_q8 = quantised and not in_bf16 and target_native.fused is not None
        dtype = torch.bfloat16 if in_bf16 else target_native.dtype

        def cast(name: str) -> torch.Tensor:
            return weights[name].to(dtype=dtype, device=device).contiguous()

        def linear(*names: str):  # y = x W^T, W the named matrices stacked by rows
            if in_q8:
                parts = [_q8_0(name, weights[name]) for name in names]
                return parts[0] if len(parts) == 1 else ConcatLinear(parts)
            return Linear(torch.cat([cast(name) for name in names]))

        layer = LayerWeights(
            attn_norm=cast("attn_norm"), qkv=linear("q.weight", "k.weight", "v.weight"),
            out=linear("o.weight"), mlp_norm=cast("mlp_norm"),
            gate_up=linear("gate.weight", "up.weight"), down=linear("down.weight"))
        head = target.get_output_embeddings().weight.detach()[head_token_ids]
        shape = dataclasses.replace(LlamaShape.from_config(target.config), num_layers=1,
                                    vocab_size=int(head_token_ids.numel()))
        self.embed = target_native.embed  # [V, H], the target's own table
        self.dtype = dtype
        self.fc = linear("fc.weight")  # 2H -> H
        self.fc_taps = linear("fc_taps.weight") if "fc_taps.weight" in weights else None
        self.eps = target_native.shape.rms_norm_eps
        # (the head never embeds ids itself: an empty table of its dtype stands in)
        empty = torch.empty(0, shape.hidden_size, dtype=dtype, device=device)
        norm = target_native.final_norm.to(dtype)
        if in_q8:
            self.native = GGUFLlama(shape, empty, [layer], norm, _q8_0("head", head))
        else:
            self.native = NativeLlama(shape, empty, [layer], norm,
                                      Linear(head.to(dtype=dtype, device=device).contiguous()))

    def step_rows(self, passes: list[tuple], taps: torch.Tensor | None = None,
                  trees: list[TreeLinks] | None = None) -> list[torch.Tensor]:
        """For every (cache, features [T, H], next_ids [T], start): the pairs at positions
        start.. in one pass, with the target's taps [N, n, H] at them if given -> per row
        logits [1, Vh] of its last position; the predicted features land in each cache's
        features. With trees (one per pass), the pairs are tree nodes in those slots, and
        every one's logits come back: [T, Vh]."""
        features = torch.cat([features for _, features, _, _ in passes])  # [N, H]
        next_ids = torch.cat([ids for _, _, ids, _ in passes])  # [N]
        inputs = self.fc(torch.cat([features.to(self.dtype),
                                    self.embed[next_ids].to(self.dtype)], dim=-1))  # [N, H]
        if taps is not None:
            inputs = inputs + self.fc_taps(tap_inputs(taps, self.eps).to(self.dtype))
        trees = trees or [None] * len(passes)
        return self.native.forward_rows(
            [RowPass(cache, ids, start, 1 if tree is None else int(ids.numel()), tree)
             for (cache, _, ids, start), tree in zip(passes, trees, strict=True)], inputs=inputs)


def _q8_0(name: str, weight: torch.Tensor) -> QuantLinear:
    """weight [N, K] quantised to Q8_0 (an int8 code a value, a scale per 32) as a layer of the
    quantised kernels."""
    values = weight.detach().float().cpu().numpy()
    blocks = torch.from_numpy(gguf_quantize(values, GGMLQuantizationType.Q8_0))  # [N, bytes]
    return QuantLinear(QuantMatrix(GGUFTensor(name, GGMLQuantizationType.Q8_0,
                                              tuple(values.shape), blocks)))
