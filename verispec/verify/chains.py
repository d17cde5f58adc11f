"""Chains: token-wise and block verification of padded rows, and the steps every procedure
shares. Pure functions over tensors.

Vocabulary, per row with K draft tokens:
  accepted tokens   the longest prefix of the draft that passes verification (0..K tokens);
  recovered token   at the first rejected position, a token drawn from the residual
                    max(0, p - q) / sum(max(0, p - q)), which corrects the draft's bias;
  bonus token       when all K draft tokens pass, one more token drawn from the target at
                    position K + 1, for free.
Each row therefore emits num_accepted + 1 tokens: accepted + (recovered or bonus).

Indices: target_probs[:, i] is p(. | x_<=i), the target's distribution of token i + 1 after the
first i draft tokens; draft_probs[:, i] is q(. | x_<=i), the one draft token i + 1 was drawn from.

`token_wise` and `block` are the PyTorch reference of the two sampled procedures; on the CPU,
float32 chains run in C++ (`verispec.verify.native`: the same decisions from the same uniforms),
and `verify_chains` picks. `procedure` decides, once, which of the two a row runs.
"""

from __future__ import annotations

import numpy as np
import torch

from verispec.invariant import invariant_draw, wrap_int64
from verispec.sampling import inverse_cdf
from verispec.verify import native

PAD_TOKEN = -1  # fills `tokens` after the last emitted token of a row


def procedure(method: str, num_draft: int) -> str:
    """The procedure that verifies a row of `method` with num_draft draft tokens: block
    verification of one token (or none) is token-wise verification (h_1 = p_1 = min(1, p(x_1) /
    q(x_1)), the same residual), run by its cheaper code with the same uniforms."""
    return "token" if method == "block" and num_draft <= 1 else method


PAD_TOKEN = -1  # fills `tokens` after the last emitted token of a row


def verify_chains(method, draft_tokens, num_draft, coins, next_uniform, target, target_at, draft,
            draft_at):
    """Token-wise ("token") or block ("block") verification of G padded rows, num_draft [G]
    real tokens each, uniforms drawn ahead (coins [G, K], next_uniform [G, 1]), whose
    distributions are rows of `target` [R, V] (row g's p(. | x_<=i) at target_at [G, K+1]) and
    of `draft` [R', V] (at draft_at [G, K]; None: a deterministic draft). Returns (tokens
    [G, K+1], num_accepted [G], ok [G]). The C++ code (verify.native) where it runs: float32 on
    the CPU; else the PyTorch reference below on gathered rows: the same decisions."""
    if native.runs(target, draft):
        return native.verify_chains(method, draft_tokens, num_draft, coins, next_uniform,
                                           target, target_at, draft, draft_at)
    reference = block if method == "block" else token_wise
    return reference(draft_tokens, None if draft is None else draft[draft_at],
                     target[target_at], num_draft, coins, next_uniform)


def token_wise(draft_tokens, draft_probs, target_probs, num_draft, coins, next_uniform):
    """Token-wise rejection sampling (Leviathan et al. 2023; Chen et al. 2023) of rows of
    num_draft [B] real tokens, with its uniforms drawn ahead (coins [B, K], next_uniform
    [B, 1]): x_i is accepted with probability min(1, p(x_i) / q(x_i)) until the first
    rejection; the next token comes from max(0, p - q) normalised there, from p after K.
    Returns (tokens [B, K+1] padded with -1, num_accepted [B], ok [B]).

    draft_probs=None means the drafter proposes tokens deterministically (n-gram lookup): q is
    a point mass on the drafted token, so x is accepted with probability p(x) and the recovered
    token comes from p with x removed. Edges: p(x) = 0 always rejects; q(x) = 0 < p(x) always
    accepts; p == q always accepts. K = 0 draws the bonus token from target_probs[:, 0].

    Example (one row, V = 3, K = 1): draft [[0]], q = [[[1, 0, 0]]], p = [[[.5, .5, 0], ...]]:
    token 0 is accepted with probability .5; otherwise the recovered token is 1, because
    max(0, p - q) = [0, .5, 0]."""
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


def block(draft_tokens, draft_probs, target_probs, num_draft, coins, next_uniform):
    """Block verification (Sun et al. 2025, arXiv 2403.10444) of rows of num_draft [B] real
    tokens, with its uniforms drawn ahead (coins [B, K], next_uniform [B, 1]): the draft is
    judged as a whole, and never fewer tokens are accepted in expectation than token by token.
    Rows of at least two draft tokens (`procedure` sends shorter ones to `token_wise`).

    With p_0 = 1 and, for i = 1..K, p_i = min(1, p_{i-1} p(x_i) / q(x_i)) (the chance, carried
    along the draft, that the prefix x_<=i is kept); Z_i = sum_x max(0, p_i p(x | x_<=i) -
    q(x | x_<=i)) (the mass a stop after x_i can still give back) and h_i = Z_i / (Z_i + 1 - p_i)
    for i < K, h_K = p_K: a coin with chance h_i at every position i = 1..K (no early stop);
    tau = the last position whose coin came up, 0 if none; the next token is drawn from
    max(0, p_tau p(. | x_<=tau) - q(. | x_<=tau)) normalised, or from p(. | x_<=K) when tau = K.
    The output is distributed as the target's, and E[tau] is never below token-wise
    verification's on the same draft law.

    Degenerate cases, defined so that the law stays exact: h_i = 0 where Z_i = 0 (0/0 included);
    p(x_i) = 0 gives p_i = 0 (and from there h = 0); q(x_i) = 0 < p(x_i) gives p_i = 1 (a
    drafter proposing a token it gives no mass is not sampling from q). A residual with no mass
    (rounding) falls back to p. draft_probs=None (n-gram lookup): q is a point mass on each
    draft token; p_i is then the product of p(x_j), Z_i = p_i (1 - p(x_{i+1})), and the law is
    token-wise verification's (the same tokens in distribution, other draws).

    Example (the paper's toy case): V = {A, B}, p = (1/3, 2/3), q = (2/3, 1/3) at every
    position, K = 2, draft [A, B]: p_1 = 1/2, p_2 = min(1, 1/2 * 2) = 1, Z_1 = 0 so h_1 = 0,
    h_2 = p_2 = 1: both tokens are always kept, where token-wise verification keeps them half
    the time. Over all drafts, 11/9 tokens are accepted on average against token-wise's 10/9.
    """
    batch_size, num_positions = draft_tokens.shape
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


def follow(draft_tokens: torch.Tensor, target_choice: torch.Tensor, num_draft: torch.Tensor
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


def invariant_choice(target_probs, seed, start_position):
    """The target's invariant draws at positions start + 0..K: (choice [B, K+1], ok [B, K+1])."""
    batch_size, num_targets = target_probs.shape[:2]
    device = target_probs.device
    starts = _per_row(start_position, batch_size, device)
    seeds = _per_row(seed, batch_size, device)
    positions = starts[:, None] + torch.arange(num_targets, device=device)  # [B, K+1]
    return invariant_draw(target_probs, seeds[:, None], positions)


def uniforms(batch_size: int, num_positions: int, generator: torch.Generator | None,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled verification's draws, in order: coins [B, K] (float32), then the next token's
    uniform [B, 1] (float64, as `sample` draws it)."""
    coins = torch.rand((batch_size, num_positions), generator=generator, device=device)
    next_uniform = torch.rand((batch_size, 1), generator=generator, dtype=torch.float64,
                              device=device)
    return coins, next_uniform


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


def _per_row(values, batch_size: int, device) -> torch.Tensor:
    """An int, or B integers (a sequence or tensor), as [B] int64 on device."""
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=torch.long).expand(batch_size)
    if is_int(values):
        values = [values] * batch_size
    values = list(values)
    if len(values) != batch_size or not all(is_int(v) for v in values):
        raise ValueError(f"expected an integer or {batch_size} integers, got {values}")
    return torch.tensor([wrap_int64(v) for v in values], dtype=torch.long, device=device)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
