"""Request configuration: small frozen dataclasses that validate themselves."""

from __future__ import annotations

from dataclasses import dataclass, field

VERIFY_METHODS = ("block", "token", "invariant")  # how a sampled draft is verified

MAX_SEED = 2**64 - 1  # a torch.Generator's seed is 64 bits; negatives would alias big ones
MIN_TEMPERATURE = 1e-6  # a floor far above ~1e-37, where float32 logits / T overflow (warp: NaN)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request is decoded.

    temperature == 0 means greedy decoding (top_k/top_p/min_p are then irrelevant).
    Otherwise the target's logits are warped in this order: temperature, top-k, top-p,
    min-p; the draft's logits go through the very same warping, and the speculative
    output is distributed exactly as sampling from the warped target.

    verify chooses how a sampled draft is verified (greedy decoding ignores it: it matches
    argmaxes, and its output is already the same whatever the drafter):
      "block" (default)  block verification (verify.chains.block) for chains with draft
            probabilities: the same law as "token", never fewer accepted tokens on average. A
            draft without probabilities (n-gram lookup, predictions) has q a point mass on each
            token, and there block and token-wise verification have the same law of accepted
            length and next token (P(tau >= i) = prod p(x_j) either way), so either runs. Sampled
            trees keep their multi-candidate rule (verify.rejection_sample_tree): block
            verification is defined for one chain, and a tree's siblings already recover what a
            rejected child loses.
      "token"  token-wise rejection sampling (verify.chains.token_wise).
      "invariant"  drafter-invariant sampling: plain decoding and every drafter draw with noise
            keyed by (seed, absolute position), so the output is token for token the output of
            plain sampling with this seed, alone or in any batch, with any drafter or K. It
            needs a seed (the noise is a function of it): without one it is refused.

    lookup_scope names whose earlier requests may speed this one: the text a drafter with a
    cross-request cache (verispec.drafters.SuffixDrafter) may propose to it, and the cached
    keys and values of a prompt start it shares with them (`verispec.scheduler`, where the
    target's caches are exact); and where its own prompt and output go when it ends: requests
    of one scope share (default "": one scope for the process); None: its own text only, and it
    leaves nothing behind. The output is the same whatever the scope (the target verifies every
    token; a reused cache holds the bits a fresh pass would write); only speed, and which text
    a draft is built from, depend on it. A server sets it per API key (`verispec serve
    --suffix-cache`).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    seed: int | None = None  # None: a fresh random seed
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)
    verify: str = "block"  # "block" | "token" | "invariant"
    lookup_scope: str | None = ""  # None: no cross-request lookup

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            _check(self.stop is None or (isinstance(self.stop, (list, tuple))),
                   f"stop must be a string or a list of strings, got {self.stop!r}")
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        _check(_is_int(self.max_new_tokens) and self.max_new_tokens > 0,
               f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        _check(_is_number(self.temperature) and 0 <= self.temperature < float("inf"),
               f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature!r}")
        _check(self.temperature == 0 or self.temperature >= MIN_TEMPERATURE,
               f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got "
               f"{self.temperature!r}")
        _check(_is_int(self.top_k) and self.top_k >= 0,
               f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p < 1,
               f"min_p must be in [0, 1), got {self.min_p!r}")
        _check(self.seed is None or _is_int(self.seed),
               f"seed must be an integer, got {self.seed!r}")
        _check(self.seed is None or 0 <= self.seed <= MAX_SEED,
               f"seed must be in [0, 2**64), got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be non-empty strings, got {self.stop!r}")
        _check(isinstance(self.ignore_eos, bool),
               f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        _check(self.lookup_scope is None or isinstance(self.lookup_scope, str),
               f"lookup_scope must be a string or None, got {self.lookup_scope!r}")
        _check(self.verify in VERIFY_METHODS,
               f"verify must be one of {VERIFY_METHODS}, got {self.verify!r}")
        _check(self.verify != "invariant" or self.greedy or self.seed is not None,
               "verify='invariant' needs a seed: its draws are keyed by (seed, position), so "
               "pass seed=<int> (or use verify='block' or 'token')")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def method(self) -> str:
        """How this row's drafts are verified: "greedy" (argmax matching) at temperature 0,
        else `verify`."""
        return "greedy" if self.greedy else self.verify


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
