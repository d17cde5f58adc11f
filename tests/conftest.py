"""Tiny random models built from configs, and a byte-level tokenizer made offline."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # one thread per worker (set before torch loads): two workers' OpenMP teams sharing two
    # cores spin against each other and make tiny ops a hundred times slower
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

BYTE_VOCAB = 256
EOS_ID = 256  # "</s>", the one special token of the byte tokenizer


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: one token per byte, plus </s> (id 256)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>")
    assert tokenizer.eos_token_id == EOS_ID
    return tokenizer


def tiny_llama(vocab_size: int, seed: int, init: float = 0.3, layers: int = 2,
               dtype=torch.float64) -> LlamaForCausalLM:
    """A random Llama; a large init range makes its next-token distributions peaked, so greedy
    argmaxes are not near-ties and sampling tests see distributions far from uniform."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, initializer_range=init,
                         bos_token_id=None, eos_token_id=EOS_ID if vocab_size > EOS_ID else None,
                         pad_token_id=None, tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(dtype).eval()


def tiny_gpt2(vocab_size: int, seed: int, init: float = 0.3, dtype=torch.float64
              ) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=2048,
                        initializer_range=init, bos_token_id=None,
                        eos_token_id=EOS_ID if vocab_size > EOS_ID else None)
    return GPT2LMHeadModel(config).to(dtype).eval()


@pytest.fixture(autouse=True)
def private_cost_cache(request, tmp_path_factory, monkeypatch):
    """Each test keeps its measured cost models in a folder of its own (created when written),
    never in ~/.cache: no test reads what another measured, whatever the order or worker."""
    import hashlib

    name = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]
    folder = tmp_path_factory.getbasetemp() / "cost-cache" / name
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(folder))
    return folder


@pytest.fixture(autouse=True)
def private_requant_cache(request, tmp_path_factory, monkeypatch):
    """Re-quantised drafts of the tests' tiny models go to the session's folder, never
    ~/.cache/verispec/models (the opt-in real-model tests read the real conversions there)."""
    if request.node.get_closest_marker("real_model") is None:
        from verispec.quant import requant

        folder = tmp_path_factory.getbasetemp() / "requant-cache"
        monkeypatch.setattr(requant, "cache_root", lambda: folder)


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return byte_tokenizer()


@pytest.fixture(scope="session")
def text_target() -> LlamaForCausalLM:
    return tiny_llama(EOS_ID + 1, seed=0)


@pytest.fixture(scope="session")
def text_draft() -> LlamaForCausalLM:
    return tiny_llama(EOS_ID + 1, seed=1, layers=1)


@pytest.fixture(scope="session")
def model_folders(tmp_path_factory, tokenizer, text_target, text_draft):
    """Target and draft saved as HF folders (with the tokenizer), as a user would have them."""
    root = tmp_path_factory.mktemp("models")
    for name, model in (("target", text_target), ("draft", text_draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


def feature_drafter(model, vocab: int, tree_width: int = 1):
    """An untrained feature head (the target's last layer, fc passing the feature through),
    drafting trees tree_width wide for greedy and sampled rows."""
    from verispec.distill.feature_head import FeatureHead
    from verispec.drafters.feature import FeatureDrafter
    from verispec.runtime.native.shape import LlamaShape

    head = FeatureHead(LlamaShape.from_config(model.config))
    head.init_from(model)
    return FeatureDrafter(head.state_dict(), torch.arange(vocab), model, vocab,
                          tree_width=tree_width, sampled_tree_width=tree_width)


def perturbed_copy(model, noise: float, seed: int):
    """The model with gaussian noise on every weight: a draft that agrees with it often, not
    always, so both accepted and rejected paths are exercised."""
    import copy

    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * noise)
    return draft


def always_accept_rows(draft_tokens, cu_num_draft, draft_probs, target_probs, rows):
    """`always_accept` in the ragged form the scheduler calls (verify.verify_rows): every
    draft token accepted, the bonus drawn from each row's last target row."""
    tokens, accepted = [], []
    for b, row in enumerate(rows):
        start, end = cu_num_draft[b], cu_num_draft[b + 1]
        last = target_probs[end + b]  # the row's K_b + 1 target rows end here
        if row.method == "greedy":
            bonus = int(last.argmax())
        else:
            bonus = int(torch.multinomial(last.clamp(min=0), 1, generator=row.generator))
        tokens.append(draft_tokens[start:end].tolist() + [bonus])
        accepted.append(end - start)
    return tokens, accepted


def exact_joint(model, prompt: list[int], params) -> torch.Tensor:
    """p(t1, t2) [V, V] of the first two tokens after `prompt` under the warped distribution
    of `model` (an HF causal LM): 1 + V forward passes."""
    from verispec.sampling import warp

    with torch.no_grad():
        first = warp(model(torch.tensor([prompt])).logits[0, -1], params)  # [V]
        vocab = first.shape[-1]
        contexts = torch.tensor([prompt + [t] for t in range(vocab)])
        second = warp(model(contexts).logits[:, -1], params)  # [V, V]
    return (first.unsqueeze(1) * second).double()


def first_two_counts(decoder, prompt: list[int], vocab: int, params, runs: int,
                     verify: str | None = None, **generate_kwargs) -> torch.Tensor:
    """Counts [V, V] of the first two tokens the decoder generates over `runs` seeds (0..runs-1)
    with these params otherwise (and this verification mode, if given: set with the seed, as
    invariant verification is only valid with one); generate_kwargs go to generate."""
    import dataclasses

    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for seed in range(runs):
        mode = {} if verify is None else {"verify": verify}
        request = dataclasses.replace(params, max_new_tokens=2, seed=seed, ignore_eos=True,
                                      **mode)
        first, second = decoder.generate(prompt, request, **generate_kwargs).token_ids
        counts[first, second] += 1
    return counts


def chi2_pvalue(counts: torch.Tensor, joint: torch.Tensor) -> float:
    """Chi-square p-value of observed counts [V, V] against an exact joint [V, V], cells with
    an expected count below 5 merged into one."""
    from scipy.stats import chisquare

    observed, expected = counts.flatten(), joint.flatten() / joint.sum() * counts.sum()
    small = expected < 5
    observed = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = expected > 0
    return chisquare(observed[keep].numpy(), expected[keep].numpy()).pvalue


def replay_verification(monkeypatch) -> list[tuple[list[int], list[int], bool]]:
    """Wrap the engine's `verify_rows` so that every row of every call is verified again by the
    padded reference (tests/padded_verify.py: `block_verify` or `rejection_sample`, by the
    row's method) on the same draft, probabilities and target rows, from the state the row's
    generator had before the call. Returns a list that fills with, per row and call: (the
    tokens the engine's call emitted, the reference's, whether both generators ended in the
    same state: the engine drew exactly the reference's draws)."""
    from padded_verify import block_verify, rejection_sample

    import verispec.verify.drafts as verify_drafts

    references = {"block": block_verify, "token": rejection_sample}
    replays: list[tuple[list[int], list[int], bool]] = []
    real = verify_drafts.verify_rows

    def replaying(draft_tokens, cu_num_draft, draft_probs, target_probs, rows):
        before = [row.generator.get_state() for row in rows]
        emitted, _ = real(draft_tokens, cu_num_draft, draft_probs, target_probs, rows)
        for b, row in enumerate(rows):
            start, end = int(cu_num_draft[b]), int(cu_num_draft[b + 1])
            probs = draft_probs[start:end][None] if row.draft_has_probs else None
            generator = torch.Generator()
            generator.set_state(before[b])
            tokens, accepted = references[row.method](
                draft_tokens[start:end][None], probs, target_probs[start + b:end + b + 1][None],
                generator)
            replays.append((emitted[b], tokens[0, :int(accepted[0]) + 1].tolist(),
                            torch.equal(generator.get_state(), row.generator.get_state())))
        return emitted, _

    monkeypatch.setattr(verify_drafts, "verify_rows", replaying)
    return replays
