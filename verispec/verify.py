"""Verification of a draft against the target: pure functions over tensors.

Vocabulary, per row of a batch with K draft tokens:
  accepted tokens   the longest prefix of the draft that passes verification (0..K tokens);
  recovered token   at the first rejected position, a token drawn from the residual
                    max(0, p - q) / sum(max(0, p - q)), which corrects the draft's bias;
  bonus token       when all K draft tokens pass, one more token drawn from the target at
                    position K + 1, for free.
Each row therefore emits num_accepted + 1 tokens: accepted + (recovered or bonus).

Indices: target_probs[:, i] is p(. | x_<=i), the target's distribution of token i + 1 after the
first i draft tokens; draft_probs[:, i] is q(. | x_<=i), the one draft token i + 1 was drawn from.

Three lossless procedures, each a pure function (one row's random draws are the same alone or in
a batch: `verify_rows` is the ragged batch form of all of them):
  token-wise  (`rejection_sample`) x_i is accepted with probability min(1, p(x_i) / q(x_i)) until
              the first rejection (Leviathan et al. 2023; Chen et al. 2023);
  block       (`block_verify`) decides on the whole draft at once and never accepts fewer tokens
              in expectation (Sun et al. 2025, arXiv 2403.10444);
  invariant   (`invariant_verify`) accepts a draft token exactly when it equals the target's own
              position-keyed draw (Daliri, Musco, Suresh 2024): the output is the very output of
              plain `invariant_sample` for that seed, whatever the drafter, K, tree or batch.
The first two are exact in distribution, for any q; the third token for token, for a seed.
Greedy decoding (`greedy_verify`) accepts while the draft equals the target's argmax.
On the CPU, token-wise and block verification of float32 chains run in C++ (`verify_native`,
the same decisions from the same uniforms); the PyTorch code here is their reference and runs
everywhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from verispec import verify_native
from verispec.sampling import greedy_tokens, invariant_draw, inverse_cdf, sample, wrap_int64

PAD_TOKEN = -1  # fills `tokens` after the last emitted token of a row


def rejection_sample(
    draft_tokens: torch.Tensor,  # [B, K] long
    draft_probs: torch.Tensor | None,  # [B, K, V] float, or None for a deterministic draft
    target_probs: torch.Tensor,  # [B, K+1, V] float
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a sampled draft. Returns (tokens [B, K+1] long padded with -1, num_accepted [B]).

    draft_probs=None means the drafter proposes tokens deterministically (n-gram lookup): q is a
    point mass on the drafted token, so x is accepted with probability p(x) and the recovered
    token comes from p with x removed.

    Edges: p(x) = 0 always rejects; q(x) = 0 < p(x) always accepts (a drafter that proposes a
    token it gives no mass is not sampling from q, and the guarantee needs q to be the truth);
    p == q always accepts. K = 0 draws the bonus token from target_probs[:, 0]: plain sampling.

    Example (one row, V = 3, K = 1): draft [[0]], q = [[[1, 0, 0]]], p = [[[.5, .5, 0], ...]]:
    token 0 is accepted with probability .5; otherwise the recovered token is 1, because
    max(0, p - q) = [0, .5, 0].
    """
    batch_size, num_draft = draft_tokens.shape
    coins, next_uniform = _uniforms(batch_size, num_draft, generator, target_probs.device)
    tokens, num_accepted, ok = _chains(
        "token", draft_tokens, _lengths(batch_size, num_draft, None, draft_tokens), coins,
        next_uniform, *_flat(draft_probs, target_probs))
    _check_mass(ok)
    return tokens, num_accepted


def _chains(method, draft_tokens, num_draft, coins, next_uniform, target, target_at, draft,
            draft_at):
    """Token-wise ("token") or block ("block") verification of G padded rows, num_draft [G]
    real tokens each, uniforms drawn ahead (coins [G, K], next_uniform [G, 1]), whose
    distributions are rows of `target` [R, V] (row g's p(. | x_<=i) at target_at [G, K+1]) and
    of `draft` [R', V] (at draft_at [G, K]; None: a deterministic draft). Returns (tokens
    [G, K+1], num_accepted [G], ok [G]). The C++ code (verify_native) where it runs: float32 on
    the CPU; else the PyTorch reference below on gathered rows: the same decisions."""
    if verify_native.runs(target, draft):
        return verify_native.verify_chains(method, draft_tokens, num_draft, coins, next_uniform,
                                           target, target_at, draft, draft_at)
    reference = _block if method == "block" else _token_wise
    return reference(draft_tokens, None if draft is None else draft[draft_at],
                     target[target_at], num_draft, coins, next_uniform)


def _flat(draft_probs, target_probs):
    """[B, K, V] and [B, K+1, V] as rows and row indices (target, target_at, draft, draft_at),
    as _chains reads them."""
    batch_size, positions, vocab = target_probs.shape
    device = target_probs.device
    target_at = torch.arange(batch_size * positions, device=device).view(batch_size, positions)
    if draft_probs is None:
        return target_probs.reshape(-1, vocab), target_at, None, None
    draft_at = torch.arange(batch_size * (positions - 1), device=device)
    return (target_probs.reshape(-1, vocab), target_at, draft_probs.reshape(-1, vocab),
            draft_at.view(batch_size, positions - 1))


def _token_wise(draft_tokens, draft_probs, target_probs, num_draft, coins, next_uniform):
    """rejection_sample on rows of num_draft [B] real tokens, with its uniforms drawn ahead
    (coins [B, K], next_uniform [B, 1]). Returns (tokens, num_accepted, ok [B])."""
    num_positions = draft_tokens.shape[1]
    real = _real(num_draft, num_positions)  # [B, K]
    # 1. Acceptance test at every draft position: u * q(x) < p(x)  <=>  u < min(1, p(x)/q(x)).
    target_at_draft, draft_at_draft = _at_draft(draft_tokens, draft_probs, target_probs, real)
    passed = (coins * draft_at_draft < target_at_draft) & real  # [B, K]
    # 2. Accepted prefix: stop at the first rejection.
    num_accepted = passed.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    # 3. The token after the prefix: from the residual at a rejection, from p at K + 1.
    next_dist = _next_distribution(draft_tokens, draft_probs, target_probs, num_draft, real,
                                   num_accepted, None)
    return _finish(draft_tokens, num_accepted, next_dist, next_uniform)


def block_verify(
    draft_tokens: torch.Tensor,  # [B, K] long
    draft_probs: torch.Tensor | None,  # [B, K, V] float, or None for a deterministic draft
    target_probs: torch.Tensor,  # [B, K+1, V] float
    generator: torch.Generator | None = None,
    num_draft: Sequence[int] | torch.Tensor | None = None,  # [B]: real draft tokens per row
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification (Sun et al. 2025): decide on the whole draft at once. Returns, as
    rejection_sample, (tokens [B, K+1] long padded with -1, num_accepted [B]).

    With p_0 = 1 and, for i = 1..K, p_i = min(1, p_{i-1} p(x_i) / q(x_i)) (the chance, carried
    along the draft, that the prefix x_<=i is kept); Z_i = sum_x max(0, p_i p(x | x_<=i) -
    q(x | x_<=i)) (the mass a stop after x_i can still give back) and h_i = Z_i / (Z_i + 1 - p_i)
    for i < K, h_K = p_K: a coin with chance h_i at every position i = 1..K (no early stop);
    tau = the last position whose coin came up, 0 if none; the next token is drawn from
    max(0, p_tau p(. | x_<=tau) - q(. | x_<=tau)) normalised, or from p(. | x_<=K) when tau = K.
    The output is distributed as the target's, and E[tau] is never below token-wise
    verification's on the same draft law (it is the optimum over verifiers of one draft).

    Degenerate cases, defined so that the law stays exact: h_i = 0 where Z_i = 0 (0/0 included:
    p_i = 1 and p = q at position i + 1; then p_{i+1} = 1 too, so a later position carries the
    stop and the empty residual is never drawn from); p(x_i) = 0 gives p_i = 0 (and from there
    h = 0); q(x_i) = 0 < p(x_i) gives p_i = 1 (a drafter proposing a token it gives no mass is
    not sampling from q, so nothing is guaranteed for it; as in rejection_sample). A residual
    with no mass (rounding; or tau = 0 with p = q at position 1, reachable only when the draft
    token has no mass under either) falls back to p. draft_probs=None (n-gram lookup): q is a
    point mass on each draft token; p_i is then the product of p(x_j), Z_i = p_i (1 - p(x_{i+1})),
    P(tau >= i) telescopes to p_i and the residual is p without x_{tau+1}: the very law of
    token-wise verification (the same tokens in distribution, other draws). num_draft: row b's
    tokens past num_draft[b] are padding (any values); its bonus distribution is then
    target_probs[b, num_draft[b]]. K = 0, as rejection_sample, is plain sampling; K = 1 is
    token-wise verification (h_1 = p_1 = min(1, p(x_1) / q(x_1)), the same residual), and
    runs rejection_sample's cheaper code with the same uniforms.

    Random draws: torch.rand((B, K)) for the coins, then one float64 uniform [B, 1] for the next
    token, from `generator`: a row verified alone draws what it draws in `verify_rows`.

    Example (the paper's toy case): V = {A, B}, p = (1/3, 2/3), q = (2/3, 1/3) at every
    position, K = 2, draft [A, B]: p_1 = min(1, (1/3)/(2/3)) = 1/2, p_2 = min(1, 1/2 * 2) = 1,
    Z_1 = 0 so h_1 = 0, h_2 = p_2 = 1: both tokens are always kept, where token-wise
    verification keeps them half the time. Over all drafts, 11/9 tokens are accepted on average
    against token-wise's 10/9 (theory.expected_accepted).
    """
    batch_size, num_positions = draft_tokens.shape
    coins, next_uniform = _uniforms(batch_size, num_positions, generator, target_probs.device)
    tokens, num_accepted, ok = _chains(
        "block", draft_tokens, _lengths(batch_size, num_positions, num_draft, draft_tokens),
        coins, next_uniform, *_flat(draft_probs, target_probs))
    _check_mass(ok)
    return tokens, num_accepted


def _block(draft_tokens, draft_probs, target_probs, num_draft, coins, next_uniform):
    """block_verify on rows of num_draft [B] real tokens, with its uniforms drawn ahead."""
    batch_size, num_positions = draft_tokens.shape
    if num_positions <= 1:  # one draft token: the token-wise procedure (block_verify's doc)
        return _token_wise(draft_tokens, draft_probs, target_probs, num_draft, coins,
                           next_uniform)
    device = draft_tokens.device
    real = _real(num_draft, num_positions)  # [B, K]
    target_at_draft, draft_at_draft = _at_draft(draft_tokens, draft_probs, target_probs, real)
    # 1. p_i = min(1, p_{i-1} p(x_i) / q(x_i)), p_0 = 1, in float64 (p(x_i) = 0 -> 0).
    weight = _carried(target_at_draft.double(), draft_at_draft.double())  # [B, K+1]: p_0 .. p_K
    # 2. Z_i and h_i at positions i = 1..K-1 (h_0 is never drawn: tau = 0 is "no coin"; its
    #    Z_0 would be a pass over the vocabulary for nothing).
    inner = weight[:, 1:num_positions]  # [B, K-1]
    mass = _residual_mass(inner, None if draft_probs is None else draft_probs[:, 1:],
                          target_probs[:, 1:num_positions], target_at_draft[:, 1:])
    stop = torch.where(mass > 0, mass / (mass + 1.0 - inner).clamp(min=1e-300), 0.0)
    # 3. The coin at position i = 1..K: h_i before a row's last token, p_K at it, 0 past it.
    position = torch.arange(1, num_positions + 1, device=device)  # [K]
    chance = torch.cat([stop, stop.new_zeros(batch_size, min(num_positions, 1))], dim=1)
    chance = torch.where(position == num_draft[:, None], weight[:, 1:], chance)  # [B, K]
    chance = chance.masked_fill(position > num_draft[:, None], 0.0)
    came_up = coins < chance  # [B, K]
    num_accepted = (came_up.long() * position).amax(dim=-1) if num_positions else (
        torch.zeros(batch_size, dtype=torch.long, device=device))  # [B] tau
    # 4. The next token: from the scaled residual at tau < num_draft, from p at tau = num_draft.
    rows = torch.arange(batch_size, device=device)
    next_dist = _next_distribution(draft_tokens, draft_probs, target_probs, num_draft, real,
                                   num_accepted, weight[rows, num_accepted])
    return _finish(draft_tokens, num_accepted, next_dist, next_uniform)


def _carried(target_mass: torch.Tensor, draft_mass: torch.Tensor) -> torch.Tensor:
    """p_0 .. p_K [B, K+1] float64 from p(x_i) and q(x_i) [B, K] float64: p_0 = 1, p_i = 1
    where p_{i-1} p(x_i) >= q(x_i), else p_{i-1} p(x_i) / q(x_i); 0 where p_{i-1} p(x_i) = 0.
    A recursion over K positions of [B] numbers: on the CPU in NumPy, the same float64
    operations (the same bits) at ~1 us a call against torch's ~5."""
    cpu = target_mass.device.type == "cpu"
    target = target_mass.detach().numpy() if cpu else target_mass
    draft = draft_mass.detach().numpy() if cpu else draft_mass
    safe_draft = np.maximum(draft, 1e-300) if cpu else draft.clamp(min=1e-300)
    xp = np if cpu else torch
    weights = [np.ones(target.shape[0]) if cpu else
               torch.ones(target.shape[0], dtype=torch.float64, device=target.device)]
    for i in range(target.shape[1]):
        carried = weights[-1] * target[:, i]  # [B]
        weight = xp.where(carried >= draft[:, i], 1.0, carried / safe_draft[:, i])
        weights.append(xp.where(carried > 0, weight, 0.0))
    return torch.from_numpy(np.stack(weights, 1)) if cpu else torch.stack(weights, 1)


def _residual_mass(weight, draft_probs, target_probs, target_at_draft):
    """Z_i = sum_x max(0, p_i p(x | x_<=i) - q(x | x_<=i)) [B, n] float64, weight = p_i [B, n],
    draft_probs and target_probs [B, n, V], target_at_draft p(x_{i+1}) [B, n]. A point-mass
    draft (None) on x_{i+1}: p_i (1 - p(x_{i+1})), since p_i p(x) <= 1."""
    if draft_probs is None:
        return weight * (1.0 - target_at_draft.double())
    excess = weight.to(target_probs.dtype).unsqueeze(-1) * target_probs  # [B, n, V]
    # in place where the types allow it (they do after `warp`): at V = 152k a fresh
    # [B, n, V] tensor costs as much as the arithmetic
    excess = excess.sub_(draft_probs) if excess.dtype == draft_probs.dtype else (
        excess - draft_probs)
    return excess.clamp_(min=0.0).sum(dim=-1, dtype=torch.float64)


def residual(
    target_probs: torch.Tensor,  # [..., V]
    draft_probs: torch.Tensor,  # [..., V]
) -> torch.Tensor:
    """The recovery distribution after a rejection: max(0, p - q) / sum(max(0, p - q)).

    A rejection implies p != q, so the mass is positive; if rounding leaves no mass, fall back to
    p rather than divide by zero. Example: p = [.5, .5, 0], q = [1, 0, 0] -> [0, 1, 0].
    """
    excess = (target_probs - draft_probs).clamp_(min=0.0)
    mass = excess.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, excess.div_(mass.clamp(min=1e-30)), target_probs)


def greedy_verify(
    draft_tokens: torch.Tensor,  # [B, K] long
    target_logits: torch.Tensor,  # [B, K+1, V]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy counterpart: accept while the draft equals the target's argmax.

    Returns (tokens [B, K+1] padded with -1, num_accepted [B]); the emitted tokens are exactly
    the target's argmax at positions 0..num_accepted, so the output is plain greedy decoding.

    Example: draft [[5, 7, 9]], target argmax [[5, 7, 2, 4]] -> tokens [[5, 7, 2, -1]], 2 accepted.
    """
    target_choice = greedy_tokens(target_logits)  # [B, K+1]
    batch_size, num_draft = draft_tokens.shape
    return _follow(draft_tokens, target_choice, _lengths(batch_size, num_draft, None,
                                                         draft_tokens))


def _follow(draft_tokens: torch.Tensor, target_choice: torch.Tensor, num_draft: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept while the draft equals the target's own choice [B, K+1] (its argmax, or its
    invariant draw); emit the target's choices up to the first difference."""
    num_positions = draft_tokens.shape[1]
    matches = (draft_tokens == target_choice[:, :num_positions]) & _real(num_draft,
                                                                         num_positions)
    num_accepted = matches.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    positions = torch.arange(num_positions + 1, device=target_choice.device)
    tokens = target_choice.masked_fill(positions > num_accepted.unsqueeze(-1), PAD_TOKEN)
    return tokens, num_accepted


def greedy_verify_tree(
    draft_tokens: torch.Tensor,  # [K] long, in order of depth
    parents: torch.Tensor,  # [K] long: each token's parent index, -1 for the root's children
    target_logits: torch.Tensor,  # [K+1, V]: after the root, then after each draft token
) -> tuple[list[int], list[int]]:
    """Greedy verification of a token tree: from the root, follow the child that equals the
    target's argmax while there is one. Returns (tokens: the accepted path's tokens, then the
    target's argmax after it; path: the accepted draft indices). As with a chain, the emitted
    tokens are exactly the target's argmax along the way: plain greedy decoding.

    Example: tokens [5, 6, 7], parents [-1, -1, 1], argmax after root 6, after node 1 (6) 7,
    after node 2 (7) 3 -> tokens [6, 7, 3], path [1, 2].
    """
    choice = greedy_tokens(target_logits).tolist()  # [K+1], the one host sync
    return _walk_tree(draft_tokens.tolist(), parents.tolist(), choice)


def _walk_tree(tokens: list[int], parents: list[int], choice: list[int]
               ) -> tuple[list[int], list[int]]:
    """From the root, follow the child that equals the target's choice after its parent
    (choice[0]: after the root, choice[j + 1]: after node j) while there is one."""
    path, node = [], -1
    while True:
        want = choice[node + 1]
        child = next((i for i, (p, t) in enumerate(zip(parents, tokens, strict=True))
                      if p == node and t == want), None)
        if child is None:
            return [tokens[i] for i in path] + [want], path
        path.append(child)
        node = child


def rejection_sample_tree(
    draft_tokens: torch.Tensor,  # [K] long, in order of depth
    parents: torch.Tensor,  # [K] long: each token's parent index, -1 for the root's children
    draft_probs: torch.Tensor,  # [K, V]: the distribution q each token's parent drew from
    target_probs: torch.Tensor,  # [K+1, V]: after the root, then after each draft token
    generator: torch.Generator | None = None,
) -> tuple[list[int], list[int]]:
    """Verify a sampled token tree whose siblings were drawn from their parent's q without
    replacement (each from q with the earlier siblings removed): recursive rejection sampling.
    From the root, try its children in order: child x is accepted with probability
    min(1, p(x)/q(x)); on a rejection p becomes residual(p, q) and x leaves q (q renormalised)
    for the next sibling. At an accepted child go on with its children and its own p. Where
    no child passes, the next token is drawn from the last p (a residual after rejections, the
    target's own p at a node without children: the bonus token). Each step is an ordinary
    speculative sampling step of a token drawn from the current q against the current p, so
    the emitted tokens follow the target exactly. Returns (tokens: the accepted path's tokens,
    then that token; path: the accepted draft indices).

    Example: root children [0, 1] drawn from q = [.5, .5, 0], p = [.25, .25, .5]: 0 passes
    with probability .5; if not, p becomes [0, 0, 1] and q [0, 1, 0], 1 fails, and the next
    token is 2.
    """
    tokens, parents_list = draft_tokens.tolist(), parents.tolist()
    path, node = [], -1
    while True:
        probs = target_probs[node + 1]  # [V]
        draft_row = None
        for child in (i for i, parent in enumerate(parents_list) if parent == node):
            token = tokens[child]
            if draft_row is None:
                draft_row = draft_probs[child]
            uniform = torch.rand((), generator=generator, device=probs.device)
            if uniform * draft_row[token] < probs[token]:
                path.append(child)
                node = child
                break
            probs = residual(probs, draft_row)
            draft_row = draft_row.clone()
            draft_row[token] = 0.0  # the next sibling was drawn without this one
            draft_row = draft_row / draft_row.sum().clamp(min=1e-30)
        else:
            next_token = int(sample(probs.unsqueeze(0), generator)[0])
            return [tokens[i] for i in path] + [next_token], path


def _assemble(
    draft_tokens: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor
) -> torch.Tensor:
    """tokens [B, K+1]: the accepted draft prefix, then next_token, then padding."""
    batch_size, num_draft = draft_tokens.shape
    positions = torch.arange(num_draft + 1, device=draft_tokens.device)
    tokens = torch.full((batch_size, num_draft + 1), PAD_TOKEN, dtype=torch.long,
                        device=draft_tokens.device)
    tokens[:, :num_draft] = draft_tokens
    tokens = tokens.masked_fill(positions >= num_accepted.unsqueeze(-1), PAD_TOKEN)
    tokens[torch.arange(batch_size, device=tokens.device), num_accepted] = next_token
    return tokens


# --- Drafter-invariant verification ---------------------------------------------------------


def invariant_verify(
    draft_tokens: torch.Tensor,  # [B, K] long
    target_probs: torch.Tensor,  # [B, K+1, V] float, warped
    seed: int | Sequence[int] | torch.Tensor,  # per request, or one for all rows
    start_position: int | Sequence[int] | torch.Tensor,  # [B]: absolute position of token 1
    num_draft: Sequence[int] | torch.Tensor | None = None,  # [B]: real draft tokens per row
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter-invariant verification: the target draws its own token at every position,
    `invariant_sample(target_probs[:, i], seed, start_position + i)`; a draft token is accepted
    exactly when it equals that draw; the draw at the first mismatch is the correction, and
    after K accepted tokens the draw at position start + K is the bonus. Returns, as
    rejection_sample, (tokens [B, K+1] padded with -1, num_accepted [B]).

    The emitted tokens are the target's draws along its own path, so they are exactly the
    tokens plain invariant sampling gives for this seed, whatever was drafted; no random state
    is consumed. A drafter maximises agreement by drawing its tokens with the same noise,
    `invariant_sample(draft_probs, seed, positions)` at the same absolute positions (the
    Gumbel coupling: agreement at least (1 - TV) / (1 + TV)); correctness does not depend on it.
    start_position is the row's history length (prompt + output so far).

    Example: target draws [5, 7, 2, 4] at positions 10..13, draft [5, 7, 9] -> tokens
    [5, 7, 2, -1], 2 accepted; the same call with any other draft gives a prefix of 5, 7, 2, 4.
    """
    batch_size, num_positions = draft_tokens.shape
    lengths = _lengths(batch_size, num_positions, num_draft, draft_tokens)
    choice, ok = _invariant_choice(target_probs, seed, start_position)
    tokens, num_accepted = _follow(draft_tokens, choice, lengths)
    _check_mass(ok | (torch.arange(num_positions + 1, device=ok.device) > lengths[:, None]))
    return tokens, num_accepted


def invariant_verify_tree(
    draft_tokens: torch.Tensor,  # [K] long, in order of depth
    parents: torch.Tensor,  # [K] long: each token's parent index, -1 for the root's children
    target_probs: torch.Tensor,  # [K+1, V]: after the root, then after each draft token
    seed: int,
    start_position: int,  # absolute position of the root's children
) -> tuple[list[int], list[int]]:
    """A token tree under drafter-invariant verification: a node is accepted when it equals
    the target's draw at its position (start_position + depth - 1) after its parent. From the
    root, follow the child equal to the draw while there is one; then emit the draw. Returns
    (tokens: the accepted path's tokens, then that draw; path: the accepted draft indices):
    plain invariant sampling's tokens, as for a chain.

    Example: tokens [5, 6, 7], parents [-1, -1, 1], draws 6 (after the root, position s),
    7 (after node 1, position s + 1), 3 (after node 2, position s + 2) -> [6, 7, 3], [1, 2].
    """
    parents_list = parents.tolist()
    depths: list[int] = []
    for parent in parents_list:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    positions = [start_position] + [start_position + depth for depth in depths]  # [K+1]
    choice, ok = invariant_draw(target_probs, seed, positions)
    choice_list, ok_list = choice.tolist(), ok.tolist()  # the one host sync
    tokens, path = _walk_tree(draft_tokens.tolist(), parents_list, choice_list)
    if not all(ok_list[node + 1] for node in [-1, *path]):
        raise ValueError("invariant_verify_tree() needs positive target mass on its path; got "
                         "a row of zeros or NaN")
    return tokens, path


def _invariant_choice(target_probs, seed, start_position):
    """The target's invariant draws at positions start + 0..K: (choice [B, K+1], ok [B, K+1])."""
    batch_size, num_targets = target_probs.shape[:2]
    device = target_probs.device
    starts = _per_row(start_position, batch_size, device)
    seeds = _per_row(seed, batch_size, device)
    positions = starts[:, None] + torch.arange(num_targets, device=device)  # [B, K+1]
    return invariant_draw(target_probs, seeds[:, None], positions)


# --- Ragged batches -------------------------------------------------------------------------

METHODS = ("greedy", "token", "block", "invariant")


@dataclass(frozen=True, slots=True)
class RowVerification:
    """How one row of a ragged batch is verified, and the state its draws come from.

    method "greedy": argmax matching (no draws); "token": rejection_sample; "block":
    block_verify (both draw from `generator`, the row's own, exactly as the one-row functions
    do); "invariant": invariant_verify with `seed` and `start_position` (the absolute position
    of the row's first draft token: its history length). draft_has_probs=False: the row's draft
    is deterministic (n-gram lookup; q a point mass), its rows of draft_probs are ignored.
    """

    method: str
    generator: torch.Generator | None = None
    seed: int | None = None
    start_position: int = 0
    draft_has_probs: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.method == "invariant" and not _is_int(self.seed):
            raise ValueError(f"invariant verification needs an integer seed, got {self.seed!r}")
        if not _is_int(self.start_position) or self.start_position < 0:
            raise ValueError(f"start_position must be an integer >= 0, got "
                             f"{self.start_position!r}")


def verify_rows(
    draft_tokens: torch.Tensor,  # [T] long: row b's draft is draft_tokens[cu[b]:cu[b+1]]
    cu_num_draft: Sequence[int] | torch.Tensor,  # [B+1] offsets, on the host: cu[0] = 0, cu[B] = T
    draft_probs: torch.Tensor | None,  # [T, V] float, or None: every row deterministic
    target_probs: torch.Tensor,  # [T+B, V]: row b's K_b + 1 rows at cu[b] + b ... cu[b+1] + b
    rows: Sequence[RowVerification],  # [B]
) -> tuple[list[list[int]], list[int]]:
    """Verify a ragged batch, each row by its own method, with one host sync (at the end).
    Returns (each row's emitted tokens: accepted + recovered or bonus; each row's number of
    accepted draft tokens). Row b's result equals the one-row function's (rejection_sample,
    block_verify, greedy_verify, invariant_verify on its [1, K_b] slice with the same generator
    or seed) token for token, whatever else is in the batch: its uniforms are drawn from its
    own generator, in the shapes the one-row function draws them.

    target_probs holds warped probabilities for sampled rows; a greedy row's rows are only
    argmaxed, so they may hold its logits. Trees are verified one row at a time
    (rejection_sample_tree, greedy_verify_tree, invariant_verify_tree).

    Example: cu [0, 2, 2], rows (block, greedy): row 0 has 2 draft tokens and target rows 0..2,
    row 1 none and target row 3 (its plain step).
    """
    offsets = cu_num_draft.tolist() if isinstance(cu_num_draft, torch.Tensor) else list(
        cu_num_draft)
    lengths = _check_ragged(draft_tokens, offsets, draft_probs, target_probs, rows)
    batch_size, device = len(rows), target_probs.device
    longest = max(lengths, default=0)
    # 1. Each row's uniforms, in row order, in the shapes its one-row function draws.
    uniforms = {b: _uniforms(1, lengths[b], row.generator, device)
                for b, row in enumerate(rows) if row.method in ("token", "block")}
    # 2. Rows grouped by procedure, each group in the padded layout of the one-row functions.
    groups: dict[tuple[str, bool], list[int]] = {}
    for b, row in enumerate(rows):
        # a block row of one draft token verifies token-wise, as block_verify does it alone
        method = "token" if row.method == "block" and lengths[b] <= 1 else row.method
        groups.setdefault((method, row.draft_has_probs and draft_probs is not None),
                          []).append(b)
    tokens_out = torch.full((batch_size, longest + 1), PAD_TOKEN, dtype=torch.long, device=device)
    accepted_out = torch.zeros(batch_size, dtype=torch.long, device=device)
    ok_out = torch.ones(batch_size, dtype=torch.bool, device=device)
    for (method, has_probs), members in groups.items():
        group_k = max(lengths[b] for b in members)
        num_draft = torch.tensor([lengths[b] for b in members], device=device)
        if method in ("token", "block"):  # read in place: no gathered copies of the rows
            draft_at, target_at = _positions(offsets, lengths, members, group_k, device)
            coins = torch.cat([torch.cat([uniforms[b][0], uniforms[b][0].new_zeros(
                1, group_k - lengths[b])], dim=1) for b in members])  # [G, K_g]
            next_uniform = torch.cat([uniforms[b][1] for b in members])  # [G, 1]
            out, accepted, ok = _chains(method, draft_tokens[draft_at], num_draft, coins,
                                        next_uniform, target_probs, target_at,
                                        draft_probs if has_probs else None, draft_at)
            at = torch.tensor(members, device=device)
            tokens_out[at, : group_k + 1] = out
            accepted_out[at], ok_out[at] = accepted, ok
            continue
        tokens, probs, targets = _padded(draft_tokens, draft_probs if has_probs else None,
                                         target_probs, offsets, lengths, members, group_k)
        if method == "greedy":
            out, accepted = _follow(tokens, greedy_tokens(targets), num_draft)
            ok = torch.ones_like(num_draft, dtype=torch.bool)
        elif method == "invariant":
            choice, ok_at = _invariant_choice(targets, [rows[b].seed for b in members],
                                              [rows[b].start_position for b in members])
            out, accepted = _follow(tokens, choice, num_draft)
            beyond = torch.arange(group_k + 1, device=device) > num_draft[:, None]
            ok = (ok_at | beyond).all(dim=-1)
        at = torch.tensor(members, device=device)
        tokens_out[at, : group_k + 1] = out
        accepted_out[at], ok_out[at] = accepted, ok
    # 3. The one host sync.
    table = torch.cat([tokens_out, accepted_out[:, None], ok_out[:, None].long()], dim=1).tolist()
    if not all(row[-1] for row in table):
        bad = [b for b, row in enumerate(table) if not row[-1]]
        raise ValueError(f"verify_rows() needs positive target mass; rows {bad} have a row of "
                         "zeros or NaN")
    return [row[: row[-2] + 1] for row in table], [row[-2] for row in table]


def _check_ragged(draft_tokens, offsets, draft_probs, target_probs, rows) -> list[int]:
    """Each row's draft length, after checking that the ragged layout is consistent."""
    total = int(draft_tokens.shape[0]) if draft_tokens.dim() == 1 else -1
    if total < 0:
        raise ValueError(f"draft_tokens must be [T], got shape {tuple(draft_tokens.shape)}")
    if len(offsets) != len(rows) + 1 or offsets[0] != 0 or offsets[-1] != total or any(
            b < a for a, b in zip(offsets[:-1], offsets[1:], strict=True)):
        raise ValueError(f"cu_num_draft must rise from 0 to T = {total} over B + 1 = "
                         f"{len(rows) + 1} entries, got {offsets}")
    if target_probs.dim() != 2 or target_probs.shape[0] != total + len(rows):
        raise ValueError(f"target_probs must be [T + B, V] = [{total + len(rows)}, V], got "
                         f"{tuple(target_probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (total, target_probs.shape[1]):
        raise ValueError(f"draft_probs must be [T, V] = [{total}, {target_probs.shape[1]}], "
                         f"got {tuple(draft_probs.shape)}")
    return [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def _padded(draft_tokens, draft_probs, target_probs, offsets, lengths, members, group_k):
    """A group's rows as [G, K_g] tokens, [G, K_g, V] draft and [G, K_g + 1, V] target
    tensors: views when the group is the whole batch at one K, else gathered copies (slots
    past a row's length repeat its last draft row and its bonus row; they are masked)."""
    batch_size, vocab = len(lengths), target_probs.shape[1]
    if len(members) == batch_size and len(set(lengths)) == 1:
        tokens = draft_tokens.reshape(batch_size, group_k)
        probs = None if draft_probs is None else draft_probs.reshape(batch_size, group_k, vocab)
        return tokens, probs, target_probs.reshape(batch_size, group_k + 1, vocab)
    draft_at, target_at = _positions(offsets, lengths, members, group_k, target_probs.device)
    probs = None if draft_probs is None else draft_probs[draft_at]
    return draft_tokens[draft_at], probs, target_probs[target_at]


def _positions(offsets, lengths, members, group_k, device):
    """A group's rows of the ragged layout: draft_at [G, K_g] (indices into draft_tokens and
    draft_probs) and target_at [G, K_g + 1] (into target_probs); slots past a row's length
    repeat its last draft row and its bonus row (they are masked)."""
    last = max(offsets[-1] - 1, 0)
    draft_at = torch.tensor([[min(offsets[b] + min(i, max(lengths[b] - 1, 0)), last)
                              for i in range(group_k)] for b in members],
                            dtype=torch.long).reshape(len(members), group_k)
    target_at = torch.tensor([[offsets[b] + b + min(i, lengths[b]) for i in range(group_k + 1)]
                              for b in members], dtype=torch.long)
    return draft_at.to(device), target_at.to(device)


# --- Shared steps ---------------------------------------------------------------------------


def _uniforms(batch_size: int, num_positions: int, generator: torch.Generator | None,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled verification's draws, in order: coins [B, K] (float32), then the next token's
    uniform [B, 1] (float64, as `sample` draws it)."""
    coins = torch.rand((batch_size, num_positions), generator=generator, device=device)
    next_uniform = torch.rand((batch_size, 1), generator=generator, dtype=torch.float64,
                              device=device)
    return coins, next_uniform


def _lengths(batch_size: int, num_positions: int, num_draft, draft_tokens) -> torch.Tensor:
    """num_draft [B] long on draft_tokens' device: K for every row when None."""
    device = draft_tokens.device
    if num_draft is None:
        return torch.full((batch_size,), num_positions, dtype=torch.long, device=device)
    values = num_draft.tolist() if isinstance(num_draft, torch.Tensor) else list(num_draft)
    if len(values) != batch_size or not all(_is_int(v) and 0 <= v <= num_positions
                                            for v in values):
        raise ValueError(f"num_draft must be {batch_size} integers in [0, {num_positions}], "
                         f"got {values}")
    return torch.tensor(values, dtype=torch.long, device=device)


def _real(num_draft: torch.Tensor, num_positions: int) -> torch.Tensor:
    """[B, K] bool: which draft slots hold real tokens."""
    return torch.arange(num_positions, device=num_draft.device) < num_draft.unsqueeze(-1)


def _at_draft(draft_tokens, draft_probs, target_probs, real):
    """p(x_i) and q(x_i) [B, K] at the draft tokens (q = 1 for a deterministic draft; padding
    slots read token 0)."""
    num_positions = draft_tokens.shape[1]
    index = draft_tokens.masked_fill(~real, 0).unsqueeze(-1)  # [B, K, 1]
    target_at_draft = target_probs[:, :num_positions].gather(-1, index).squeeze(-1)
    if draft_probs is None:
        return target_at_draft, torch.ones_like(target_at_draft)
    return target_at_draft, draft_probs.gather(-1, index).squeeze(-1)


def _next_distribution(draft_tokens, draft_probs, target_probs, num_draft, real, num_accepted,
                       scale):
    """[B, V]: max(0, scale * p - q) at a stop before the row's last token (scale: block
    verification's p_tau [B]; None: 1), p itself after it (the bonus)."""
    batch_size, num_positions = draft_tokens.shape
    rows = torch.arange(batch_size, device=target_probs.device)
    next_target = target_probs[rows, num_accepted]  # [B, V]
    if num_positions == 0:
        return next_target
    at = num_accepted.clamp(max=num_positions - 1)
    if draft_probs is None:
        next_draft = torch.zeros_like(next_target)
        next_draft[rows, draft_tokens.masked_fill(~real, 0)[rows, at]] = 1.0
    else:
        next_draft = draft_probs[rows, at]
    scaled = next_target if scale is None else scale.to(next_target.dtype)[:, None] * next_target
    rejected = (num_accepted < num_draft).unsqueeze(-1)  # [B, 1]
    # drawn from unnormalised (inverse_cdf scales the uniform by the row's sum); the residual
    # falls back to p where rounding leaves it no mass, as `residual` does
    excess = (scaled - next_draft).clamp_(min=0.0)
    excess = torch.where(excess.sum(dim=-1, keepdim=True) > 0, excess, scaled)
    return torch.where(rejected, excess, next_target)


def _finish(draft_tokens, num_accepted, next_dist, next_uniform):
    """Draw the next token and assemble the row: (tokens, num_accepted, ok [B])."""
    ok = next_dist.sum(dim=-1) > 0  # False for a row of zeros or NaN
    next_token = inverse_cdf(next_dist, next_uniform).clamp(max=next_dist.shape[-1] - 1)
    return _assemble(draft_tokens, num_accepted, next_token), num_accepted, ok


def _check_mass(ok: torch.Tensor) -> None:
    if not bool(ok.all()):  # as torch.multinomial, refuse rather than draw past V
        raise ValueError("verification needs every distribution it draws from to have positive "
                         "mass; got a row of zeros or NaN")


def _per_row(values, batch_size: int, device) -> torch.Tensor:
    """An int, or B integers (a sequence or tensor), as [B] int64 on device."""
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=torch.long).expand(batch_size)
    if _is_int(values):
        values = [values] * batch_size
    values = list(values)
    if len(values) != batch_size or not all(_is_int(v) for v in values):
        raise ValueError(f"expected an integer or {batch_size} integers, got {values}")
    return torch.tensor([wrap_int64(v) for v in values], dtype=torch.long, device=device)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
