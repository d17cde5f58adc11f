"""Verification of a draft against the target: pure functions over tensors.

Vocabulary, per row of a batch with K draft tokens:
  accepted tokens   the longest prefix of the draft that passes verification (0..K tokens);
  recovered token   at the first rejected position, a token drawn from the residual
                    max(0, p - q) / sum(max(0, p - q)), which corrects the draft's bias;
  bonus token       when all K draft tokens pass, one more token drawn from the target at
                    position K + 1, for free.
Each row therefore emits num_accepted + 1 tokens: accepted + (recovered or bonus).

Draft token x_i is accepted with probability min(1, p(x_i) / q(x_i)), with p = target_probs and
q = draft_probs at that position. The emitted tokens are distributed exactly as tokens sampled
one by one from the target (Leviathan et al. 2023; Chen et al. 2023), whatever q is.
"""

from __future__ import annotations

import torch

from verispec.sampling import greedy_tokens, sample

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
    rows = torch.arange(batch_size, device=draft_tokens.device)

    # 1. Acceptance test at every draft position: u * q(x) < p(x)  <=>  u < min(1, p(x)/q(x)).
    target_at_draft = target_probs[:, :num_draft].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    uniform = torch.rand(target_at_draft.shape, generator=generator, device=target_probs.device)
    passed = uniform * draft_at_draft < target_at_draft  # [B, K]

    # 2. Accepted prefix: stop at the first rejection.
    num_accepted = passed.long().cumprod(dim=-1).sum(dim=-1)  # [B]

    # 3. The distribution of the token after the prefix: residual at a rejection, p at K + 1.
    next_target = target_probs[rows, num_accepted]  # [B, V]
    if num_draft > 0:
        at = num_accepted.clamp(max=num_draft - 1)
        if draft_probs is None:
            next_draft = torch.zeros_like(next_target)
            next_draft[rows, draft_tokens[rows, at]] = 1.0
        else:
            next_draft = draft_probs[rows, at]
        rejected = (num_accepted < num_draft).unsqueeze(-1)  # [B, 1]
        next_dist = torch.where(rejected, residual(next_target, next_draft), next_target)
    else:
        next_dist = next_target
    next_token = sample(next_dist, generator)  # [B]

    return _assemble(draft_tokens, num_accepted, next_token), num_accepted


def residual(
    target_probs: torch.Tensor,  # [..., V]
    draft_probs: torch.Tensor,  # [..., V]
) -> torch.Tensor:
    """The recovery distribution after a rejection: max(0, p - q) / sum(max(0, p - q)).

    A rejection implies p != q, so the mass is positive; if rounding leaves no mass, fall back to
    p rather than divide by zero. Example: p = [.5, .5, 0], q = [1, 0, 0] -> [0, 1, 0].
    """
    excess = (target_probs - draft_probs).clamp(min=0.0)
    mass = excess.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, excess / mass.clamp(min=1e-30), target_probs)


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
    num_draft = draft_tokens.shape[1]
    matches = draft_tokens == target_choice[:, :num_draft]
    num_accepted = matches.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    positions = torch.arange(num_draft + 1, device=target_choice.device)
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
    tokens, parents = draft_tokens.tolist(), parents.tolist()
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
