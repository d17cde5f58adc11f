"""A feature draft (EAGLE-style): one Llama layer that reads the target's own last hidden states.

At position s the draft sees the target's feature f_s (its last hidden state, before the final
norm) and the embedding of the token x_{s+1} that followed, fused by one linear layer, and
predicts f_{s+1}; the target's own final norm and head rows turn that into a distribution over
x_{s+2}. Drafting further feeds the draft's predicted features back in. Knowing the target's
features makes the task far easier than predicting tokens from tokens, so one layer suffices.

Training (here) fits the predicted features to the target's on the distillation data: KL from
the target's next-token distribution (recomputed from its features, over the head's tokens) plus
a smooth-L1 pull on the features themselves. `verispec.drafters.feature` runs the result.

Its folder (written with `verispec.drafters.folder.save_feature_draft`) is described in
`verispec.drafters.folder`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm
from transformers import PreTrainedModel

from verispec.distill.data import Transcript
from verispec.drafters.feature import tap_inputs
from verispec.drafters.folder import taps_fit
from verispec.runtime.native.attention import rope_tables, rotate
from verispec.runtime.native.llama import NativeLlama
from verispec.runtime.native.shape import LlamaShape
from verispec.theory import sampled_acceptance

log = logging.getLogger("verispec.distill")

FEATURE_UNROLL = 2  # drafting depths trained (depth d reads the head's own depth d-1 features)
LAYER_KEYS = ("attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down")


class FeatureHead(nn.Module):
    """fc(f_s, embed(x_{s+1})) -> one causal Llama layer -> predicted f_{s+1}, in float32 for
    training; `verispec.drafters.feature` runs the same weights on the native runtime.

    taps: also read the target's hidden states after these many of its layers at position s
    (EAGLE-3's low and mid-level features), each RMS-normalised, through fc_taps added to fc's
    output. Only the first drafting step has them (the target has not run on drafted tokens):
    deeper steps add nothing there, and training does the same."""

    def __init__(self, shape: LlamaShape, taps: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.shape, self.taps = shape, tuple(taps)
        if not taps_fit(self.taps, shape.num_layers):
            raise ValueError(f"feature taps must lie inside the target's {shape.num_layers} "
                             f"layers, got {self.taps}")
        hidden, heads, kv_heads, dim = (shape.hidden_size, shape.num_heads, shape.num_kv_heads,
                                        shape.head_dim)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        if self.taps:  # starts at zero: a head without taps, until training finds them useful
            self.fc_taps = nn.Linear(len(self.taps) * hidden, hidden, bias=False)
            nn.init.zeros_(self.fc_taps.weight)
        self.attn_norm = nn.Parameter(torch.ones(hidden))
        self.q = nn.Linear(hidden, heads * dim, bias=False)
        self.k = nn.Linear(hidden, kv_heads * dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * dim, bias=False)
        self.o = nn.Linear(heads * dim, hidden, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(hidden))
        self.gate = nn.Linear(hidden, shape.intermediate_size, bias=False)
        self.up = nn.Linear(hidden, shape.intermediate_size, bias=False)
        self.down = nn.Linear(shape.intermediate_size, hidden, bias=False)
        cos, sin = rope_tables(shape)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, features: torch.Tensor, embeddings: torch.Tensor,
                taps: torch.Tensor | None = None) -> torch.Tensor:
        """features, embeddings [B, T, H] (position s: f_s and the embedding of x_{s+1}), taps
        [B, T, n, H] or None -> predicted features [B, T, H] (f_{s+1}), causal over T."""
        batch, length, _ = features.shape
        shape = self.shape
        x = self.fc(torch.cat([features, embeddings], dim=-1))  # [B, T, H]
        if self.taps and taps is not None:
            x = x + self.fc_taps(tap_inputs(taps, shape.rms_norm_eps))
        # 1. Attention with rotary positions, grouped-query.
        h = F.rms_norm(x, (shape.hidden_size,), self.attn_norm, shape.rms_norm_eps)
        q = self.q(h).view(batch, length, shape.num_heads, shape.head_dim)
        k = self.k(h).view(batch, length, shape.num_kv_heads, shape.head_dim)
        v = self.v(h).view(batch, length, shape.num_kv_heads, shape.head_dim)
        cos, sin = self.cos[:length], self.sin[:length]  # [T, d]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        group = shape.num_heads // shape.num_kv_heads
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(attended.transpose(1, 2).reshape(batch, length, -1))
        # 2. SwiGLU MLP.
        h = F.rms_norm(x, (shape.hidden_size,), self.mlp_norm, shape.rms_norm_eps)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))

    def init_from(self, target: PreTrainedModel) -> None:
        """Start from the target's last layer, with fc passing the feature through (the draft's
        first guess: the target's last layer applied once more)."""
        layer = target.model.layers[-1]
        attn, mlp = layer.self_attn, layer.mlp
        sources = {"attn_norm": layer.input_layernorm, "q": attn.q_proj, "k": attn.k_proj,
                   "v": attn.v_proj, "o": attn.o_proj, "mlp_norm": layer.post_attention_layernorm,
                   "gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj}
        with torch.no_grad():
            for name, module in sources.items():
                mine = getattr(self, name)
                (mine if isinstance(mine, nn.Parameter) else mine.weight).copy_(
                    module.weight.detach().float())
            hidden = self.shape.hidden_size
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden] = torch.eye(hidden)
            self.fc.weight[:, hidden:].normal_(0, 0.02 / math.sqrt(hidden))


# -- data ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FeatureExample:
    ids: torch.Tensor  # [T] long: prompt + response
    start: int  # the response starts here
    features: torch.Tensor  # [T, H] bfloat16: the target's last hidden states
    taps: torch.Tensor | None = None  # [T, n, H] bfloat16: its hidden states at the head's taps


def target_features(native: NativeLlama, sequences: list[Transcript], max_length: int,
                    taps: tuple[int, ...] = ()) -> list[FeatureExample]:
    """The target's features for every position of every sequence (cut to max_length): those
    the data shards stored (written by the same runtime), else from a pass of `native`, the
    runtime the drafter will read them from; and its hidden states after `taps` layers (a pass
    of `native`: the shards do not store them)."""
    examples = []
    for seq in tqdm(sequences, desc="target features", unit="seq", mininterval=5):
        ids = seq.ids[:max_length]
        if ids.numel() < 3:
            continue
        tapped = None
        if seq.features is not None and seq.features.dtype == native.dtype and not taps:
            features = seq.features[: ids.numel()]
        else:
            cache = native.new_cache(tuple(taps))
            native.forward(ids, 0, 1, cache)
            features = cache.features[: ids.numel()].clone()
            tapped = cache.taps[: ids.numel()].clone() if taps else None
        examples.append(FeatureExample(ids, seq.start, features, tapped))
    return examples


# -- training -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FeatureTrainSettings:
    steps: int = 600
    batch_size: int = 8
    lr: float = 5e-4
    feature_weight: float = 0.1  # smooth-L1 on features, relative to the KL
    noise: float = 0.05  # uniform noise on input features, relative to their RMS
    unroll: int = FEATURE_UNROLL
    unroll_weight: float = 0.5  # weight of each deeper depth's loss, relative to depth 1
    tv_weight: float = 0.0  # total variation distance between the target's and the draft's
    # distributions, relative to the KL: 1 - TV is the chance that a token drawn from the draft
    # at temperature 1 is accepted, so this term trains for sampling's acceptance directly
    seed: int = 0
    eval_every: int = 100


class FrozenHead:
    """The target's final norm and head rows for head_token_ids: features -> log-probs."""

    def __init__(self, target: PreTrainedModel, head_token_ids: torch.Tensor) -> None:
        self.norm = target.model.norm.weight.detach().float()
        self.weight = target.get_output_embeddings().weight.detach().float()[head_token_ids]
        self.eps = target.config.rms_norm_eps
        self.token_ids = head_token_ids  # [Vh]

    def log_probs(self, features: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(features, self.norm.shape, self.norm, self.eps)
        return torch.log_softmax(normed @ self.weight.T, dim=-1)


def _batch(examples: list[FeatureExample], embed: torch.Tensor):
    """Pad to the longest -> inputs (features, embeddings) [B, T-1, H], targets [B, T-1, H],
    response mask [B, T-1] (the positions that predict response tokens), input taps
    [B, T-1, n, H] (None without taps)."""
    length = max(int(e.ids.numel()) for e in examples) - 1
    hidden = embed.shape[1]
    feats = torch.zeros(len(examples), length + 1, hidden)
    nexts = torch.zeros(len(examples), length, dtype=torch.long)
    response = torch.zeros(len(examples), length, dtype=torch.bool)
    num_taps = 0 if examples[0].taps is None else examples[0].taps.shape[1]
    taps = torch.zeros(len(examples), length, num_taps, hidden) if num_taps else None
    for row, e in enumerate(examples):
        n = int(e.ids.numel()) - 1
        feats[row, : n + 1] = e.features.float()
        nexts[row, :n] = e.ids[1:]
        response[row, max(e.start - 1, 0):n] = True
        if taps is not None:
            taps[row, :n] = e.taps[:n].float()
    return feats[:, :-1], embed[nexts], feats[:, 1:], response, taps


def evaluate(head: FeatureHead, frozen: FrozenHead, examples: list[FeatureExample],
             embed: torch.Tensor) -> dict:
    """Held-out KL, top-1 agreement with the target and acceptance at temperature 1 (sum of
    min(p, q) over the head's tokens) on response positions, from the target's own features
    (depth 1), and top-1 agreement from the draft's own prediction one step back (depth 2)."""
    kl = agree1 = accept = agree2 = count = count2 = 0.0
    with torch.no_grad():
        for i in range(0, len(examples), 8):
            inputs, embeddings, targets, response, taps = _batch(examples[i:i + 8], embed)
            predicted = head(inputs, embeddings, taps)
            target_lp, draft_lp = frozen.log_probs(targets), frozen.log_probs(predicted)
            target_probs, top = target_lp.exp(), target_lp.argmax(-1)
            kl += (target_probs * (target_lp - draft_lp)).sum(-1)[response].sum().item()
            agree1 += (draft_lp.argmax(-1) == top)[response].sum().item()
            accept += sampled_acceptance(target_probs, draft_lp.exp())[response].sum().item()
            count += response.sum().item()
            # Depth 2: position s reads the draft's predicted f_s instead of the target's.
            second = head(torch.cat([inputs[:, :1], predicted[:, :-1]], dim=1), embeddings)
            hits = (frozen.log_probs(second).argmax(-1) == top)[:, 1:][response[:, 1:]]
            agree2 += hits.sum().item()
            count2 += hits.numel()
    return {"kl": kl / max(count, 1), "agreement": agree1 / max(count, 1),
            "acceptance_t1": accept / max(count, 1), "agreement_depth2": agree2 / max(count2, 1)}


def train_feature_head(head: FeatureHead, frozen: FrozenHead, embed: torch.Tensor,
                       examples: list[FeatureExample], heldout: list[FeatureExample],
                       settings: FeatureTrainSettings, checkpoint: Path | None = None,
                       log_file: Path | None = None) -> dict:
    """AdamW with warm-up and cosine decay; resumes from `checkpoint` when it exists."""
    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=0.0)
    first = 0
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        shapes = {name: tuple(value.shape) for name, value in head.state_dict().items()}
        if {name: tuple(value.shape) for name, value in state["head"].items()} != shapes:
            raise ValueError(f"{checkpoint} holds a head of another shape (feature taps "
                             f"differ?): resume with the settings it was trained with, or "
                             f"start a new --out")
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        first = int(state["step"])
        log.info("resumed feature-head training at step %d", first)
    report = {}
    progress = tqdm(range(first, settings.steps), desc="train feature draft", unit="step",
                    initial=first, total=settings.steps, mininterval=5)
    started, tokens = time.perf_counter(), 0
    for step in progress:
        # 1. A batch of whole sequences, drawn with the seeded generator.
        picks = torch.randint(0, len(examples), (settings.batch_size,), generator=generator)
        inputs, embeddings, targets, response, taps = _batch([examples[i] for i in picks],
                                                             embed)
        scale = inputs.pow(2).mean().sqrt()
        noise = (torch.rand(inputs.shape, generator=generator) * 2 - 1) * settings.noise * scale
        # 2. Loss on the response positions (the ones drafting meets): KL from the target's
        #    distribution plus smooth L1 on the features, at depth 1 (the target's features in)
        #    and at each deeper depth, where position s reads the head's own prediction of f_s
        #    from the depth before, as drafting does (and no taps); plus the total variation
        #    distance when tv_weight > 0.
        wanted = targets[response]  # [M, H]
        target_lp = frozen.log_probs(wanted)  # [M, Vh]
        target_probs = target_lp.exp()  # [M, Vh]
        features_in, losses = inputs + noise, []
        for depth in range(settings.unroll):
            predicted = head(features_in, embeddings, taps if depth == 0 else None)  # [B, T, H]
            draft_lp = frozen.log_probs(predicted[response])  # [M, Vh]
            depth_kl = (target_probs * (target_lp - draft_lp)).sum(-1).mean()
            depth_feature = F.smooth_l1_loss(predicted[response] / scale, wanted / scale)
            depth_loss = depth_kl + settings.feature_weight * depth_feature
            if settings.tv_weight > 0:
                depth_tv = 1 - sampled_acceptance(target_probs, draft_lp.exp()).mean()
                depth_loss = depth_loss + settings.tv_weight * depth_tv
            weight = 1.0 if depth == 0 else settings.unroll_weight
            losses.append(weight * depth_loss)
            if depth == 0:
                kl, feature_loss = depth_kl, depth_feature
            features_in = torch.cat([features_in[:, :1], predicted[:, :-1]], dim=1)
        loss = sum(losses)
        # 3. Step, with warm-up and cosine decay.
        lr = settings.lr * min(1.0, (step + 1) / 50) * 0.5 * (
            1 + math.cos(math.pi * step / settings.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        tokens += int(response.sum())
        rate = tokens / (time.perf_counter() - started)
        progress.set_postfix(kl=f"{kl.item():.3f}", tok_s=f"{rate:.0f}", refresh=False)
        line = f"step {step + 1} kl {kl.item():.4f} feature {feature_loss.item():.4f} " \
               f"lr {lr:.2e} {rate:.0f} tokens/s"
        # 4. Evaluate and checkpoint now and then.
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            report = evaluate(head, frozen, heldout, embed)
            line += " | held-out " + " ".join(f"{k} {v:.3f}" for k, v in report.items())
            if checkpoint is not None:
                staging = checkpoint.with_suffix(".tmp")
                torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(),
                            "generator": generator.get_state(), "step": step + 1,
                            "head_token_ids": frozen.token_ids}, staging)
                os.replace(staging, checkpoint)
        if log_file is not None and ((step + 1) % 10 == 0 or "held-out" in line):
            with open(log_file, "a") as handle:
                handle.write(line + "\n")
            log.info("%s", line)
    return report or evaluate(head, frozen, heldout, embed)  # (a resumed, finished run)
