"""The native runtime's model: a compact Llama-family decoder (Llama, SmolLM2, Mistral/Qwen2-style
without sliding windows) over plain weight tensors: RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU, tied or untied head.

Weights are taken from a loaded transformers model; q/k/v and gate/up are fused into one matrix
each (layers.py). Each sequence has its own KV cache (cache.py) and its length is the caller's
business: rolling back is passing a smaller `start` next time. One forward pass serves many
sequences (rows), each at its own position.

Batch invariance: a row's logits are the same bits alone or in any batch and at any position of
a pass. Where verispec's C++ kernels run, a pass is one call (kernels.cpp for bfloat16,
quant/kernels/forward.h for GGUF weights) built that way; the PyTorch loop gets it from linear
layers whose rows do not depend on the row count (layers.py) and attention that gives a query
the same bits in any pass (attention.py). `tests/test_native.py` checks bitwise equality of a
position's logits across pass sizes.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from verispec.runtime.native.attention import (
    INVARIANT_MAX,
    QueryGroup,
    attend,
    attend_tree,
    attention_plan,
    rope_tables,
    rotate,
    rows_are_independent,
)
from verispec.runtime.native.cache import KVCache, TreeLinks
from verispec.runtime.native.layers import LayerWeights, Linear
from verispec.runtime.native.shape import LlamaShape

log = logging.getLogger("verispec")


@dataclass(frozen=True, slots=True)
class RowPass:
    """One sequence's part of a forward pass: ids [T] into cache slots start..start+T-1, at
    positions start..start+T-1, or, where `tree` is given, the slots from tree.base on at their
    positions in the tree."""

    cache: KVCache
    ids: torch.Tensor  # [T] long
    start: int
    num_logits: int  # logits wanted for the last num_logits positions
    tree: TreeLinks | None = None

    def paths(self) -> list[list[int]] | None:
        """Per new slot, the tree slots it attends after slot base - 1 ([] for a slot below
        base); None without a tree."""
        if self.tree is None:
            return None
        length = int(self.ids.numel())
        if self.tree.parents.numel() != self.start + length - self.tree.base:
            raise ValueError("tree links must cover the slots from base to the pass's end")
        if not 1 <= self.tree.base <= self.start + length or length > INVARIANT_MAX:
            raise ValueError("a tree pass is a short pass over a non-empty prefix")
        return [self.tree.path(slot) if slot >= self.tree.base else []
                for slot in range(self.start, self.start + length)]

    def positions(self, paths: list[list[int]] | None) -> list[int]:
        """Each new slot's position: its own slot, or for a tree node base - 1 + its depth."""
        length = int(self.ids.numel())
        if paths is None:
            return list(range(self.start, self.start + length))
        return [self.tree.base - 1 + len(path) if path else self.start + t
                for t, path in enumerate(paths)]


class NativeLlama:
    """forward(ids [T], start, cache) -> logits [num_logits, V] float32, writing K/V into the
    sequence's cache at start..start+T-1; forward_rows does many sequences in one pass."""

    # Whether the PyTorch loop plans prompt passes as short passes (attention_plan's prompts)
    plan_prompts = False
    # Whether a position's logits, keys and values are the same bits in any pass: a prompt's
    # (whole or in chunks of any size) or a verification's. Short passes are (INVARIANT_MAX);
    # a long prompt pass here attends in one causal call, which rounds otherwise.
    pass_invariant = False

    def __init__(self, shape: LlamaShape, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: Linear) -> None:
        self.shape = shape
        self.embed, self.layers, self.final_norm, self.lm_head = embed, layers, final_norm, lm_head
        self.dtype, self.device = embed.dtype, embed.device
        cos, sin = rope_tables(shape)
        self.cos, self.sin = (table.to(self.dtype).to(self.device) for table in (cos, sin))
        self.fused = self._fused_weights()
        # The PyTorch path's attention plan (unused when the C++ kernels run every layer).
        group = shape.num_heads // shape.num_kv_heads
        self.grouped_queries = self.fused is None and rows_are_independent(
            self.dtype, self.device, shape.head_dim, group)

    def _fused_weights(self):
        """The weights as kernels.forward_layers takes them (a `kernels.Decoder`, checked once
        here), where every linear layer runs on verispec's kernels; None otherwise (the
        PyTorch loop runs)."""
        self.kernels = None
        linears = [lin for layer in self.layers
                   for lin in (layer.qkv, layer.out, layer.gate_up, layer.down)]
        if not self.layers or any(lin.tiles is None for lin in linears) \
                or self.shape.head_dim > 256 or self.shape.head_dim % 2:
            return None
        self.kernels = kernels = self.layers[0].qkv.kernels  # the module that packed them

        def packed(linear: Linear):
            return kernels.PackedLinear(tiles=linear.tiles, scales=linear.tile_scales,
                                        bias=linear.bias, out_features=linear.out_features)

        shape = self.shape
        return kernels.Decoder(
            shape=kernels.Shape(hidden=shape.hidden_size, heads=shape.num_heads,
                                kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                                intermediate=shape.intermediate_size, eps=shape.rms_norm_eps),
            layers=[kernels.LayerWeights(attn_norm=layer.attn_norm.contiguous(),
                                         mlp_norm=layer.mlp_norm.contiguous(),
                                         qkv=packed(layer.qkv), out=packed(layer.out),
                                         gate_up=packed(layer.gate_up), down=packed(layer.down))
                    for layer in self.layers],
            cos=self.cos.contiguous(), sin=self.sin.contiguous(), short_pass=INVARIANT_MAX)

    def new_cache(self, tap_layers: tuple[int, ...] = ()) -> KVCache:
        """An empty cache for one sequence; passes over it also keep the hidden states after
        `tap_layers` layers (what a feature draft with taps reads)."""
        return KVCache(self.shape, self.dtype, self.device, tap_layers)

    @classmethod
    def from_hf(cls, model: PreTrainedModel, dtype: torch.dtype | None = None,
                int8: bool = False) -> NativeLlama:
        """Fuse and convert the weights of a transformers Llama-family model. int8: weight-only
        int8 linear layers (bfloat16 activations), quantized here at load time."""
        shape = LlamaShape.from_config(model.config)
        dtype = dtype or next(model.parameters()).dtype
        if int8 and dtype != torch.bfloat16:
            raise ValueError("int8 weights run with bfloat16 activations: use dtype bfloat16")

        def weight(module) -> torch.Tensor:
            return module.weight.detach().to(dtype).contiguous()

        def linear(*modules, bias: torch.Tensor | None = None) -> Linear:
            return Linear(torch.cat([weight(m) for m in modules]), bias, int8=int8)

        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            bias = None
            if shape.attention_bias:
                bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).to(dtype)
            layers.append(LayerWeights(
                attn_norm=weight(layer.input_layernorm),
                qkv=linear(attn.q_proj, attn.k_proj, attn.v_proj, bias=bias),
                out=linear(attn.o_proj),
                mlp_norm=weight(layer.post_attention_layernorm),
                gate_up=linear(mlp.gate_proj, mlp.up_proj),
                down=linear(mlp.down_proj)))
        embed = weight(model.model.embed_tokens)
        lm_head = linear(model.get_output_embeddings())
        return cls(shape, embed, layers, weight(model.model.norm), lm_head)

    def describe(self) -> str:
        int8 = " int8 weights" if self.lm_head.scales is not None else ""
        fused = f" (C++ kernels, {self.kernels.isa.upper()})" if self.fused is not None else ""
        return f"native {str(self.dtype).removeprefix('torch.')}{int8}{fused}"

    def forward(self, ids: torch.Tensor, start: int, num_logits: int, cache: KVCache
                ) -> torch.Tensor:
        return self.forward_rows([RowPass(cache, ids, start, num_logits)])[0]

    @torch.inference_mode()
    def forward_rows(self, rows: list[RowPass], inputs: torch.Tensor | None = None
                     ) -> list[torch.Tensor]:
        """Every row's new positions in one pass -> per row logits [num_logits, V] float32; each
        position's last hidden state goes to its row's cache.features (a feature drafter reads
        them), and the hidden states after the cache's tap_layers to its taps. inputs [N, H]:
        vectors to use instead of the rows' token embeddings.

        The decoder layers run in one C++ call where the kernels can (`_fused_layers`), else
        in PyTorch ops (`_torch_layers`). Either way linear layers see all N = sum(T)
        positions as one matrix, whose rows do not depend on N, and attention goes row by row
        over each row's own cache. So a row's logits are the same bits alone or in any batch
        (tests/test_batch.py, tests/test_kernels.py)."""
        lengths = [int(row.ids.numel()) for row in rows]
        for row, length in zip(rows, lengths, strict=True):
            row.cache.reserve(row.start + length)
        paths = [row.paths() for row in rows]  # per row: None, or each slot's tree path
        own_inputs = inputs is None  # a fresh tensor the pass may update in place
        if own_inputs:
            ids = rows[0].ids if len(rows) == 1 else torch.cat([row.ids for row in rows])
            inputs = self.embed[ids.to(self.device)]
        x = inputs  # [N, H]
        # The pass keeps the hidden states after every layer some row's cache taps.
        tap_layers = list(dict.fromkeys(tap for row in rows for tap in row.cache.tap_layers))
        taps = torch.empty(x.shape[0] if tap_layers else 0, len(tap_layers), x.shape[1],
                           dtype=self.dtype, device=self.device)  # [N, n, H]: only when kept
        ends = list(itertools.accumulate(lengths))
        wanted = [position for row, end in zip(rows, ends, strict=True)
                  for position in range(end - row.num_logits, end)]
        logits = None
        if self.fused is not None:
            # the head in the same call where the kernels' decoder has it (logits [sum, V])
            if getattr(self.fused, "has_head", False) and wanted:
                logits = torch.empty(len(wanted), self.lm_head.out_features)
            x = self._fused_layers(rows, lengths, paths, x if own_inputs else x.clone(),
                                   tap_layers, taps, wanted, logits)
        else:
            x = self._torch_layers(rows, lengths, paths, x, tap_layers, taps)
        for row, length, end in zip(rows, lengths, ends, strict=True):
            row.cache.features[row.start:row.start + length] = x[end - length:end]
            if row.cache.tap_layers:
                columns = [tap_layers.index(tap) for tap in row.cache.tap_layers]
                row.cache.taps[row.start:row.start + length] = taps[end - length:end, columns]
        # The head, only for the positions whose logits are wanted.
        if logits is None:
            logits = self.lm_head(self._norm(x[wanted], self.final_norm)).float()  # [sum, V]
        return [logits] if len(rows) == 1 else list(logits.split([row.num_logits for row in rows]))

    def _fused_layers(self, rows: list[RowPass], lengths: list[int],
                      paths: list[list[list[int]] | None], x: torch.Tensor,
                      tap_layers: list[int], taps: torch.Tensor, wanted: list[int],
                      logits: torch.Tensor | None) -> torch.Tensor:
        """Every decoder layer in one C++ call (kernels.cpp): x [N, H] -> [N, H], the tapped
        hidden states into taps [N, n, H]. Tree rows pass each slot's path, flattened. With
        logits [len(wanted), V] (a decoder that has its head), the wanted positions' logits
        are written there by the same call. x is updated in place (the caller's to give)."""
        x = x.contiguous()
        bases, slots, offsets = [], [], [0]  # offsets [N + 1] into slots, when any row is a tree
        if any(row_paths is not None for row_paths in paths):
            for row, length, row_paths in zip(rows, lengths, paths, strict=True):
                bases.append(-1 if row.tree is None else row.tree.base)
                for path in row_paths or [[]] * length:
                    slots.extend(path)
                    offsets.append(len(slots))
        batch = self.kernels.PassRows(
            keys=[row.cache.keys for row in rows], values=[row.cache.values for row in rows],
            starts=[row.start for row in rows], lengths=lengths, tree_bases=bases,
            path_slots=slots, path_offsets=offsets)
        head = {} if logits is None else {"wanted": wanted, "logits": logits}  # bf16: none
        self.kernels.forward_layers(x, decoder=self.fused, rows=batch, taps=taps,
                                    tap_layers=tap_layers, **head)
        return x

    def _torch_layers(self, rows: list[RowPass], lengths: list[int],
                      paths: list[list[list[int]] | None], x: torch.Tensor,
                      tap_layers: list[int], taps: torch.Tensor) -> torch.Tensor:
        """The decoder layers in PyTorch ops: x [N, H] -> [N, H], the tapped hidden states
        into taps [N, n, H]."""
        shape = self.shape
        total = x.shape[0]
        positions = torch.tensor([position for row, row_paths in zip(rows, paths, strict=True)
                                  for position in row.positions(row_paths)])
        cos, sin = self.cos[positions], self.sin[positions]  # [N, d]
        rotary_width = (shape.num_heads + shape.num_kv_heads) * shape.head_dim
        plans = [attention_plan(row.start, length, shape, self.grouped_queries,
                                prompts=self.plan_prompts)
                 for row, length in zip(rows, lengths, strict=True)]
        for index, layer in enumerate(self.layers):
            # 1. Fused q/k/v for every position, rotary positions on q and k at once.
            qkv = layer.qkv(self._norm(x, layer.attn_norm))  # [N, (nh + 2 nkv) d]
            qk = rotate(qkv[:, :rotary_width].view(total, -1, shape.head_dim), cos, sin)
            q, k = qk.split([shape.num_heads, shape.num_kv_heads], dim=1)  # [N, heads, d]
            v = qkv[:, rotary_width:].view(total, shape.num_kv_heads, shape.head_dim)
            # 2. Row by row: K/V into the row's cache, attention over it.
            attended, offset = [], 0
            for row, length, plan, row_paths in zip(rows, lengths, plans, paths, strict=True):
                span, end = slice(offset, offset + length), row.start + length
                row.cache.keys[index, :, row.start:end] = k[span].transpose(0, 1)  # [nkv, T, d]
                row.cache.values[index, :, row.start:end] = v[span].transpose(0, 1)
                if row_paths is None:
                    attended.append(self._attend(q[span].transpose(0, 1), row.cache, index,
                                                 row.start, end, plan))  # [nh, T, d]
                else:
                    attended.append(attend_tree(q[span].transpose(0, 1), row.cache,
                                                row.tree.base, index, row_paths,
                                                row.positions(row_paths),
                                                self.grouped_queries))
                offset += length
            attended = attended[0] if len(attended) == 1 else torch.cat(attended, dim=1)
            x = x + layer.out(attended.transpose(0, 1).reshape(total, -1))
            # 3. SwiGLU MLP.
            gate, up = layer.gate_up(self._norm(x, layer.mlp_norm)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
            for j, tap in enumerate(tap_layers):
                if tap == index + 1:
                    taps[:, j] = x
        return x

    def _attend(self, q: torch.Tensor, cache: KVCache, index: int, start: int, end: int,
                plan: list[QueryGroup] | None) -> torch.Tensor:
        """q [nh, T, d] -> [nh, T, d], causal over the cache up to `end` (attention.attend)."""
        return attend(q, cache, index, start, end, plan)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, self.shape.rms_norm_eps)
