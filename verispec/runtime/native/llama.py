"""A compact Llama-family decoder (Llama, SmolLM2, Mistral/Qwen2-style without sliding windows):
RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, tied or untied head.

Weights are plain tensors taken from a loaded transformers model; q/k/v and gate/up are fused
into one matrix each. Each sequence has its own KV cache, [layers, kv_heads, capacity, d],
grown by doubling, and its length is the caller's business: rolling back is passing a smaller
`start` next time. One forward pass serves many sequences (rows), each at its own position.

Batch invariance: in decode and verification passes (up to INVARIANT_MAX positions) a query at
position p attends over the keys 0..L(p)-1, L(p) = p + 1 rounded up to KEY_BLOCK, with the keys
after p masked, whatever else the pass holds: one attention call for the queries that share an
L, and a one-token step is the case of one query. Whether the attention kernel's rows are then
independent of how many rows a call holds is probed when the model is built (true for bfloat16
on oneDNN CPUs, not for float32); where the probe fails, queries attend one by one over exactly
their own keys. Linear layers run as one GEMM, whose rows do not depend on the row count for
bfloat16 (oneDNN) on CPU. `tests/test_native.py` checks bitwise equality of a position's logits
across pass sizes.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from verispec.errors import VerispecError
from verispec.runtime.native import kernels

log = logging.getLogger("verispec")

SUPPORTED = ("llama", "mistral", "qwen2")
INVARIANT_MAX = 16  # passes up to this many positions attend batch-invariantly
KEY_BLOCK = 64  # such passes attend over keys padded to a multiple of this, the rest masked


class UnsupportedModelError(VerispecError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    attention_bias: bool

    @classmethod
    def from_config(cls, config) -> LlamaShape:
        kind = getattr(config, "model_type", None)
        if kind not in SUPPORTED:
            raise UnsupportedModelError(f"the native runtime supports {', '.join(SUPPORTED)}, "
                                        f"not {kind!r}")
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"rope scaling {rope.get('rope_type')!r} is not supported")
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise UnsupportedModelError("sliding-window attention is not supported")
        if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
            raise UnsupportedModelError("only SwiGLU MLPs without bias are supported")
        heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
            num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)),
            max_positions=config.max_position_embeddings,
            attention_bias=bool(getattr(config, "attention_bias", kind == "qwen2")))


class Linear:
    """y = x W^T + b, in one of these forms, each giving output rows that are bitwise
    independent of how many rows the call holds:
    - on a CPU with AVX512-BF16 (bfloat16 activations): verispec's own kernel (kernels.cpp,
      on AMX tiles where the CPU has them), weights packed once into tile order, bfloat16 or
      int8 (`int8=True`: one fp32 scale per output channel, widened to bfloat16 tile by tile),
      as fast for 16 rows as for one;
    - bfloat16 on other CPUs: prepacked once into oneDNN's blocked layout (faster than
      F.linear re-packing the weights every call, and nearly flat in the row count);
    - int8 on other CPUs: torch's weight-only int8 kernel, which goes row by row (pays for
      1-row steps, loses for wide verification passes);
    - anything else: F.linear.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 int8: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias, self.packed, self.scales = weight, bias, None, None
        self.tiles = None  # [ceil(N/32), K/2, 32, 2]: the AMX kernel's layout
        self.tile_scales = torch.empty(0)  # [N] fp32 for int8 tiles
        cpu_bf16 = weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
        if int8 and not cpu_bf16:
            raise ValueError("int8 weights need bfloat16 activations on the CPU")
        self.kernels = kernels.load() if cpu_bf16 and weight.shape[1] % 32 == 0 else None
        if int8:
            scales = weight.float().abs().amax(dim=1).clamp_min(1e-12) / 127  # [out]
            self.weight = (weight.float() / scales[:, None]).round().clamp(-127, 127).to(
                torch.int8)
            self.scales = scales.to(torch.bfloat16)
            if self.kernels is not None:
                self.tile_scales = scales.contiguous()
        if self.kernels is not None:
            self.tiles = self.kernels.pack(self.weight)
            self.bias = torch.empty(0) if bias is None else bias.float().contiguous()
            self.weight = None
        elif cpu_bf16 and not int8:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
                self.weight = None  # the packed copy replaces it
            except (RuntimeError, AttributeError):
                self.packed = None
        # Calls of fewer rows are padded to this many (see _fewest_rows); the kernel's rows
        # are independent by construction, and there is no bitwise promise outside bf16.
        self.min_rows = _fewest_rows(self) if cpu_bf16 and self.tiles is None else 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.min_rows:  # [M, K] -> [min_rows, K], zero rows after
            padded = x.new_zeros(self.min_rows, x.shape[1])
            padded[:x.shape[0]] = x
            return self._product(padded)[:x.shape[0]]
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None:
            return self.kernels.linear(x, self.tiles, self.bias, self.tile_scales,
                                       self.out_features)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.scales is not None:
            y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


_ROWS_PROBED: dict[tuple, int] = {}


def _fewest_rows(linear: Linear) -> int:
    """Probe (once per kind and shape of layer): the fewest rows from which every call gives a
    row the same bits whatever the other rows are, checked up to INVARIANT_MAX rows and at a few
    wider batches; calls of fewer rows are then padded to it. Which kernel oneDNN picks can
    depend on the row count: on an AMD EPYC (Zen 5) a bf16 layer with K = 1536 rounds a lone
    row differently from 2..256 rows, which made a decode step and a verification pass disagree
    on greedy tokens. For bf16 layers on the CPU outside verispec's kernels."""
    kind = "packed" if linear.packed is not None else "int8" if linear.scales is not None else "F"
    key = (kind, linear.out_features, linear.in_features, linear.bias is not None)
    if key not in _ROWS_PROBED:
        generator = torch.Generator().manual_seed(0)
        widest = 64
        x = torch.randn(widest, linear.in_features, generator=generator).to(torch.bfloat16)
        counts = [*range(1, INVARIANT_MAX + 1), 24, 32, widest]
        with torch.inference_mode():
            together = linear._product(x)
            # every row, in calls of m rows: a differing sum shows only where it crosses a
            # bfloat16 rounding boundary, so one row is too few to see it
            same = [all(torch.equal(linear._product(x[first:first + m]),
                                    together[first:first + m])
                        for first in range(0, widest - m + 1, m)) for m in counts]
        fewest = next((counts[i] for i in range(len(counts)) if all(same[i:])), None)
        if fewest is None or fewest > INVARIANT_MAX:
            log.warning("native runtime: a %s layer [%d x %d] rounds rows differently with the "
                        "row count; greedy speculative output may differ from plain decoding",
                        kind, linear.out_features, linear.in_features)
            fewest = 1
        _ROWS_PROBED[key] = fewest
    return _ROWS_PROBED[key]


@dataclass(frozen=True, slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [H], in the model's dtype
    qkv: Linear  # H -> (nh + 2 nkv) d
    out: Linear  # nh d -> H
    mlp_norm: torch.Tensor  # [H]
    gate_up: Linear  # H -> 2 I
    down: Linear  # I -> H


def check_taps(taps: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Tap layers name hidden states inside the stack: distinct layer counts in
    [1, num_layers - 1] (after all num_layers layers is the feature every cache keeps)."""
    taps = tuple(taps)
    if any(not isinstance(tap, int) or not 0 < tap < num_layers for tap in taps) \
            or len(set(taps)) < len(taps):
        raise ValueError(f"taps must be distinct layer counts inside the target's "
                         f"{num_layers} layers (1..{num_layers - 1}), got {taps}")
    return taps


class KVCache:
    """One sequence's keys and values, [layers, nkv, capacity, d] each, grown by doubling, and
    at every position the last hidden state (`features`) and, for each of `tap_layers`, the
    hidden state after that many layers (`taps`).

    Which positions are valid is the caller's business: rolling back is passing a smaller
    `start` next time, and the stale positions are written over."""

    def __init__(self, shape: LlamaShape, dtype: torch.dtype, device: torch.device,
                 tap_layers: tuple[int, ...] = ()) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self.tap_layers = check_taps(tap_layers, shape.num_layers)
        self.keys = self.values = None
        self.features = None  # [capacity, H]: each position's last hidden state, before the norm
        self.taps = None  # [capacity, n, H]: the hidden states after tap_layers, when any

    def reserve(self, length: int) -> None:
        """Room for `length` positions and the padding short passes attend over."""
        if length > self.shape.max_positions:
            raise ValueError(f"sequence of {length} tokens exceeds the model's context of "
                             f"{self.shape.max_positions}")
        length = padded_keys(length, self.shape.max_positions)
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if length <= capacity:
            return
        capacity = min(self.shape.max_positions, max(length, 2 * capacity, 256))
        size = (self.shape.num_layers, self.shape.num_kv_heads, capacity, self.shape.head_dim)
        self.keys = self._grown(self.keys, size)
        self.values = self._grown(self.values, size)
        self.features = self._grown(self.features, (capacity, self.shape.hidden_size))
        if self.tap_layers:
            self.taps = self._grown(self.taps, (capacity, len(self.tap_layers),
                                                self.shape.hidden_size))

    def move(self, sources: list[int], to: int) -> None:
        """Copy the positions at slots `sources` (increasing, each >= its target) to slots
        to, to + 1, ...: a token tree's accepted path into its place in the sequence."""
        if not sources or sources == list(range(to, to + len(sources))):
            return
        at = torch.tensor(sources, device=self.device)
        span = slice(to, to + len(sources))
        self.keys[:, :, span], self.values[:, :, span] = self.keys[:, :, at], self.values[:, :, at]
        self.features[span] = self.features[at]
        if self.taps is not None:
            self.taps[span] = self.taps[at]

    def _grown(self, old: torch.Tensor | None, size: tuple[int, ...]) -> torch.Tensor:
        """A zeroed buffer of `size` holding `old`'s positions (the position axis is the one
        whose length differs)."""
        new = torch.zeros(size, dtype=self.dtype, device=self.device)
        if old is not None:
            new[tuple(slice(0, n) for n in old.shape)] = old
        return new


@dataclass(frozen=True, slots=True)
class QueryGroup:
    """Queries first..last-1 of a short pass, which attend over the first `keys` cached
    positions with `mask` [group * (last - first), keys] hiding each one's future."""

    first: int
    last: int
    keys: int
    mask: torch.Tensor


def padded_keys(length: int, max_positions: int) -> int:
    """The key length a query at position length-1 attends over in a short pass."""
    return min(-(-length // KEY_BLOCK) * KEY_BLOCK, max_positions)


@dataclass(frozen=True, slots=True)
class TreeLinks:
    """A token tree in a cache: the slots from `base` on hold tree nodes, each the child of an
    earlier slot; slot base - 1 (the last token of the sequence) is the root. A node attends
    over slots 0..base-1 and then its ancestors and itself, in that order, so it sits at
    position base - 1 + depth and sees exactly the keys it would see in a chain."""

    base: int
    parents: torch.Tensor  # [slots - base] long: the parent slot of slot base + j (>= base - 1)

    def path(self, slot: int) -> list[int]:
        """The slots of a node's ancestors below the root, then its own: [s_1, ..., slot]."""
        path = []
        while slot >= self.base:
            path.append(slot)
            slot = int(self.parents[slot - self.base])
        if slot != self.base - 1:
            raise ValueError(f"tree node's root is slot {slot}, not {self.base - 1}")
        return path[::-1]


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
        self.grouped_queries = self.fused is None and _rows_are_independent(
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
        if inputs is None:
            inputs = self.embed[torch.cat([row.ids for row in rows]).to(self.device)]
        x = inputs  # [N, H]
        # The pass keeps the hidden states after every layer some row's cache taps.
        tap_layers = list(dict.fromkeys(tap for row in rows for tap in row.cache.tap_layers))
        taps = torch.empty(x.shape[0] if tap_layers else 0, len(tap_layers), x.shape[1],
                           dtype=self.dtype, device=self.device)  # [N, n, H]: only when kept
        if self.fused is not None:
            x = self._fused_layers(rows, lengths, paths, x, tap_layers, taps)
        else:
            x = self._torch_layers(rows, lengths, paths, x, tap_layers, taps)
        ends = list(itertools.accumulate(lengths))
        for row, length, end in zip(rows, lengths, ends, strict=True):
            row.cache.features[row.start:row.start + length] = x[end - length:end]
            if row.cache.tap_layers:
                columns = [tap_layers.index(tap) for tap in row.cache.tap_layers]
                row.cache.taps[row.start:row.start + length] = taps[end - length:end, columns]
        # The head, only for the positions whose logits are wanted.
        wanted = torch.cat([torch.arange(end - row.num_logits, end)
                            for row, end in zip(rows, ends, strict=True)])
        logits = self.lm_head(self._norm(x[wanted], self.final_norm)).float()  # [sum, V]
        return list(logits.split([row.num_logits for row in rows]))

    def _fused_layers(self, rows: list[RowPass], lengths: list[int],
                      paths: list[list[list[int]] | None], x: torch.Tensor,
                      tap_layers: list[int], taps: torch.Tensor) -> torch.Tensor:
        """Every decoder layer in one C++ call (kernels.cpp): x [N, H] -> [N, H], the tapped
        hidden states into taps [N, n, H]. Tree rows pass each slot's path, flattened."""
        x = x.contiguous().clone()  # updated in place
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
        self.kernels.forward_layers(x, decoder=self.fused, rows=batch, taps=taps,
                                    tap_layers=tap_layers)
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
        plans = [self._plan(row.start, length) for row, length in zip(rows, lengths, strict=True)]
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
                    attended.append(self._attend_tree(q[span].transpose(0, 1), row, index,
                                                      row_paths))
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

    def _plan(self, start: int, length: int) -> list[QueryGroup] | None:
        """How a short pass's queries attend (see the module docstring): the groups of queries
        that share a padded key length, each with its mask; None for a prompt pass, or where
        queries must go one by one."""
        if length > INVARIANT_MAX or not self.grouped_queries:
            return None
        group = self.shape.num_heads // self.shape.num_kv_heads
        positions = torch.arange(start, start + length, device=self.device)  # [T]
        keys = [padded_keys(p + 1, self.shape.max_positions) for p in range(start, start + length)]
        plan, first = [], 0
        for last in range(1, length + 1):
            if last == length or keys[last] != keys[first]:
                allowed = torch.arange(keys[first], device=self.device) <= positions[first:last,
                                                                                      None]
                mask = allowed.expand(group, -1, -1).reshape(-1, keys[first])  # [group Tg, L]
                plan.append(QueryGroup(first, last, keys[first], mask))
                first = last
        return plan

    def _attend(self, q: torch.Tensor, cache: KVCache, index: int, start: int, end: int,
                plan: list[QueryGroup] | None) -> torch.Tensor:
        """q [nh, T, d] -> [nh, T, d], causal over the cache up to `end`."""
        keys, values = cache.keys[index], cache.values[index]  # [nkv, capacity, d]
        heads, length, dim = q.shape
        kv_heads = self.shape.num_kv_heads
        group = heads // kv_heads
        # A query's heads that share a KV head ride as `group` rows of that head: no copies of
        # keys. 4-d inputs take the fused CPU kernel (3-d ones fall back to the unfused math
        # path, several times slower).
        keys, values = keys.unsqueeze(0), values.unsqueeze(0)  # [1, nkv, capacity, d]
        grouped = q.view(kv_heads, group, length, dim)
        if plan is not None:  # padded, masked, the queries of one key length together
            return torch.cat([
                F.scaled_dot_product_attention(
                    grouped[:, :, part.first:part.last].reshape(1, kv_heads, -1, dim),
                    keys[:, :, :part.keys], values[:, :, :part.keys], attn_mask=part.mask
                ).view(heads, part.last - part.first, dim)
                for part in plan], dim=1)
        if length <= INVARIANT_MAX:  # one by one, each over exactly its own keys
            return torch.cat([
                F.scaled_dot_product_attention(
                    grouped[None, :, :, t], keys[:, :, :start + t + 1],
                    values[:, :, :start + t + 1]).view(heads, 1, dim)
                for t in range(length)], dim=1)
        # A prompt pass: one causal call over every head (4-d, so the fused flash kernel runs;
        # a 3-d call took the unfused math path: 15 s instead of ~1 s for 1,334 positions).
        keys = keys[:, :, :end].repeat_interleave(group, dim=1)  # [1, nh, end, d]
        values = values[:, :, :end].repeat_interleave(group, dim=1)
        if start == 0:
            return F.scaled_dot_product_attention(q.unsqueeze(0), keys, values,
                                                  is_causal=True)[0]
        mask = torch.ones(length, end, dtype=torch.bool, device=q.device).tril(start)
        return F.scaled_dot_product_attention(q.unsqueeze(0), keys, values, attn_mask=mask)[0]

    def _attend_tree(self, q: torch.Tensor, row: RowPass, index: int, paths: list[list[int]]
                     ) -> torch.Tensor:
        """q [nh, T, d] -> [nh, T, d] for a tree row: each query alone, over keys laid out as
        the chain to it would hold them (slots 0..base-1, then its path's slots), padded and
        masked as that chain's query would be, so it gets the chain's bits."""
        cache, base = row.cache, row.tree.base
        heads, _, dim = q.shape
        kv_heads = self.shape.num_kv_heads
        out = []
        for t, (path, position) in enumerate(zip(paths, row.positions(paths), strict=True)):
            end = position + 1
            plan = self._plan(position, 1)
            keys_to = end if plan is None else plan[0].keys
            keys, values = cache.keys[index, :, :keys_to], cache.values[index, :, :keys_to]
            if path:  # the path's keys where the chain keeps them, after slot base - 1
                at = torch.tensor(path, device=keys.device)
                keys, values = keys.clone(), values.clone()
                keys[:, base:end], values[:, base:end] = cache.keys[index][:, at], \
                    cache.values[index][:, at]
            grouped = q[:, t].reshape(1, kv_heads, -1, dim)  # [1, nkv, group, d]
            mask = None if plan is None else plan[0].mask
            out.append(F.scaled_dot_product_attention(
                grouped, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask
            ).view(heads, 1, dim))
        return torch.cat(out, dim=1)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, self.shape.rms_norm_eps)


def rope_tables(shape: LlamaShape) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, d] float32: full-width tables with the sign of the rotated half
    folded in, so that rotate(x) = x * cos + swap_halves(x) * sin."""
    half = shape.head_dim // 2
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.outer(torch.arange(shape.max_positions, dtype=torch.float64), inv_freq)
    return (torch.cat([angles.cos(), angles.cos()], -1).float(),
            torch.cat([-angles.sin(), angles.sin()], -1).float())


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, transformers' half-split convention, in x's dtype as transformers
    computes it: x [..., T, heads, d], cos/sin [T, d] from `rope_tables`."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return torch.addcmul(x * cos.unsqueeze(1), swapped, sin.unsqueeze(1))


def _rows_are_independent(dtype: torch.dtype, device: torch.device, head_dim: int,
                          group: int) -> bool:
    """Probe: does the attention kernel give each query row the same bits whether the call holds
    it alone or with up to INVARIANT_MAX others (padded keys, masked)? Random inputs, a few
    positions on both sides of a KEY_BLOCK boundary; a few milliseconds. (float32 on CPU fails
    it: 11 queries of a 3-head group, 33 rows, round differently from 16.)"""
    generator = torch.Generator().manual_seed(0)
    kv_heads, capacity, count = 2, 3 * KEY_BLOCK, INVARIANT_MAX

    def random(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(dtype=dtype, device=device)

    keys, values = random(1, kv_heads, capacity, head_dim), random(1, kv_heads, capacity, head_dim)
    with torch.inference_mode():
        for start in (0, KEY_BLOCK - INVARIANT_MAX, KEY_BLOCK + 5):
            queries = random(kv_heads, group, count, head_dim)
            length = padded_keys(start + count, capacity)
            allowed = torch.arange(length, device=device) <= torch.arange(
                start, start + count, device=device)[:, None]  # [T, L]
            inputs = (queries, keys[:, :, :length], values[:, :, :length], allowed)
            together = _probe_attend(*inputs, 0, count)
            for first in range(count):  # each query alone, and every number of rows
                if not (torch.equal(_probe_attend(*inputs, first, first + 1),
                                    together[:, :, first:first + 1])
                        and torch.equal(_probe_attend(*inputs, 0, first + 1),
                                        together[:, :, :first + 1])):
                    return False
    return True


def _probe_attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  allowed: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """Queries first..last-1 of queries [nkv, group, T, d] in one call -> [nkv, group, Tg, d]."""
    kv_heads, group, _, head_dim = queries.shape
    mask = allowed[first:last].expand(group, -1, -1).reshape(-1, allowed.shape[1])
    out = F.scaled_dot_product_attention(
        queries[:, :, first:last].reshape(1, kv_heads, -1, head_dim), keys, values,
        attn_mask=mask)
    return out.view(kv_heads, group, last - first, head_dim)
