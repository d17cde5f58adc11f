"""Token trees: greedy, drafter-invariant and recursive rejection sampling verification of one
row's tree (tokens in order of depth, each with its parent's index)."""

from __future__ import annotations

import torch

from verispec.invariant import invariant_draw
from verispec.sampling import greedy_tokens, sample
from verispec.verify.chains import residual


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
    return walk_tree(draft_tokens.tolist(), parents.tolist(), choice)


def walk_tree(tokens: list[int], parents: list[int], choice: list[int]
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
    tokens, path = walk_tree(draft_tokens.tolist(), parents_list, choice_list)
    if not all(ok_list[node + 1] for node in [-1, *path]):
        raise ValueError("invariant_verify_tree() needs positive target mass on its path; got "
                         "a row of zeros or NaN")
    return tokens, path
