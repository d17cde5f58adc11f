"""The native runtime over a quantized GGUF file: a NativeLlama whose linear layers compute from
the file's blocks (`verispec.quant.linear`), float32 activations, norms and caches.

Where the quantised kernels are built, every decoder layer of a pass runs in one C++ call
(verispec/quant/kernels/forward.h); elsewhere in NativeLlama's PyTorch loop, where a prompt
pass attends as short passes would (GGUFLlama.plan_prompts). Either way quantized products are
row-independent, so a position's logits are the same bits in any pass: speculative greedy
output equals plain greedy.
"""

from __future__ import annotations

import logging

import torch
from gguf.quants import dequantize as gguf_dequantize

from verispec.quant import linear as quant_linear
from verispec.quant.linear import ConcatLinear, QuantLinear, QuantMatrix
from verispec.quant.quant_kernels import compiled
from verispec.quant.quantized_model import GGUFModel, qk_order
from verispec.runtime.native.attention import attend_each_query
from verispec.runtime.native.layers import LayerWeights
from verispec.runtime.native.llama import NativeLlama
from verispec.runtime.native.native_runner import NativeRunner
from verispec.runtime.native.shape import LlamaShape

log = logging.getLogger("verispec")


def gguf_runner(model: GGUFModel, runtime: str = "auto", dtype: str = "auto",
                int8: bool = False) -> NativeRunner:
    """A runner of `model` (its NativeLlama built once and shared). The file's formats are the
    dtype: another dtype, int8 or transformers' runtime mean dequantising the file first."""
    if runtime == "hf" or dtype != "auto" or int8:
        asked = "runtime hf" if runtime == "hf" else "int8" if int8 else f"dtype {dtype}"
        raise ValueError(f"{model.file.path.name} runs at its own quantization on the native "
                         f"runtime; {asked} needs its weights dequantised first "
                         "(--dequantize bf16 / dequantize='bf16')")
    if model.native is None:
        model.native = native_from_gguf(model)
    return NativeRunner(model.native)


def native_from_gguf(model: GGUFModel) -> NativeLlama:
    """Build the NativeLlama over the file's tensors (views of the file; nothing is copied
    except F16/BF16 norms and biases, widened to float32)."""
    file, shape = model.file, LlamaShape.from_config(model.config)
    q_order = qk_order(file.architecture, shape.num_heads, shape.head_dim)
    k_order = qk_order(file.architecture, shape.num_kv_heads, shape.head_dim)

    def vector(name: str) -> torch.Tensor:
        tensor = file.tensor(name)
        if tensor.quantized:  # never seen in practice: norms and biases are F32
            log.info("%s: a %s vector, dequantised at load", name, tensor.qtype.name)
            values = gguf_dequantize(tensor.data.numpy(), tensor.qtype)
            return torch.from_numpy(values).reshape(tensor.shape)
        return tensor.data.float()  # F32 tensors: a view, no copy

    def linear(name: str, order: torch.Tensor | None = None) -> QuantLinear:
        bias = f"{name}.bias" if shape.attention_bias and name.endswith(
            ("attn_q", "attn_k", "attn_v")) else None
        return QuantLinear(QuantMatrix(file.tensor(f"{name}.weight")),
                           None if bias is None else vector(bias), order)

    layers = []
    for index in range(shape.num_layers):
        block = f"blk.{index}"
        layers.append(LayerWeights(
            attn_norm=vector(f"{block}.attn_norm.weight"),
            qkv=ConcatLinear([linear(f"{block}.attn_q", q_order),
                              linear(f"{block}.attn_k", k_order), linear(f"{block}.attn_v")]),
            out=linear(f"{block}.attn_output"),
            mlp_norm=vector(f"{block}.ffn_norm.weight"),
            gate_up=ConcatLinear([linear(f"{block}.ffn_gate"), linear(f"{block}.ffn_up")]),
            down=linear(f"{block}.ffn_down")))
    log.info("native runtime: %s at its own quantization", model.describe())
    return GGUFLlama(shape, model.embed, layers, vector("output_norm.weight"),
                     QuantLinear(model.head))


class GGUFLlama(NativeLlama):
    """A NativeLlama on a GGUF file's blocks; describe() names the formats and the products.

    Where the quantised kernels are built (every x86 path, and the portable one), a pass is one
    C++ call (verispec/quant/kernels/forward.h: norms, rotary, the cache write, attention, the
    MLP and the products), each position's bits independent of the pass and the thread count.

    Without them the layers run in NativeLlama's PyTorch loop, where a prompt pass attends as
    short passes would: in chunks planned as they are where the attention probe allows, else
    query by query. The kernels quantise activations to int8, which turns a last-bit difference
    in a position's attention output (a prompt pass's one causal call rounds unlike a lone
    query) into a different code and a logit 0.5-1 away; then a position computed once in a
    prompt pass and again in a verification pass (a prompt reused from the cache) would part
    greedy speculative output from plain. Attending as a short pass would keeps a position's
    bits the same in any pass."""

    def _fused_weights(self):
        """The weights as the quantised kernels' forward_layers takes them (a `Decoder`,
        checked once here), where every layer's products run on them; None otherwise."""
        self.kernels = None
        module, shape = compiled() if quant_linear.kernels() is not None else None, self.shape
        if module is None or not self.layers or shape.hidden_size % 16 \
                or shape.intermediate_size % 16 or shape.head_dim % 16 or shape.head_dim > 256:
            return None
        projections = [[*getattr(lin, "parts", [lin])] for layer in self.layers
                       for lin in (layer.qkv, layer.out, layer.gate_up, layer.down)]
        if any(not part.weight.quantized for parts in projections for part in parts):
            return None  # a plain-float matrix among the layers: the PyTorch loop

        def projection(linear) -> list:
            return [_part(module, part) for part in getattr(linear, "parts", [linear])]

        # the final norm and head run in the same call where the head is quantised
        head = self.lm_head
        in_pass = isinstance(head, QuantLinear) and head.weight.quantized
        self.kernels = module
        return module.Decoder(
            shape=module.Shape(hidden=shape.hidden_size, heads=shape.num_heads,
                               kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                               intermediate=shape.intermediate_size, eps=shape.rms_norm_eps),
            layers=[module.LayerWeights(attn_norm=layer.attn_norm.float().contiguous(),
                                        mlp_norm=layer.mlp_norm.float().contiguous(),
                                        qkv=projection(layer.qkv), out=projection(layer.out),
                                        gate_up=projection(layer.gate_up),
                                        down=projection(layer.down))
                    for layer in self.layers],
            cos=self.cos.float().contiguous(), sin=self.sin.float().contiguous(),
            final_norm=self.final_norm.float().contiguous() if in_pass else None,
            head=projection(head) if in_pass else [])

    @torch.inference_mode()
    def greedy_chain(self, cache, start: int, unread: list[int], steps: int,
                     head_ids: torch.Tensor | None = None, cut=None, prior: list[float] = ()
                     ) -> tuple[list[int], list[float], int] | None:
        """A lone row's greedy chain in one C++ call (kernels/greedy.h): from the `unread`
        tokens at slots `start` on of `cache` (which holds the slots before them; the first
        pass reads them all), up to `steps` passes, each the
        next position's and its first largest logit (mapped through head_ids [W], a trimmed
        head's token ids), cut as `cut` (a ChainCut; `prior`: the P's of the chain's tokens
        drafted before) decides. Returns (tokens, their cumulative probabilities, passes run);
        the cache and its features hold every position fed, as forward_rows leaves them. None
        where the kernels' decoder has no head, the embedding is not quantised or the cache
        keeps taps (the caller runs forward_rows)."""
        chain = getattr(self.kernels, "greedy_chain", None)
        embed = self.embed
        if chain is None or self.fused is None or not self.fused.has_head or cache.tap_layers \
                or not getattr(embed, "quantized", False):
            return None
        cache.reserve(start + len(unread) - 1 + steps)
        if cache.features.dtype != torch.float32:
            return None
        prices = {}
        if cut is not None:
            chain_steps = range(len(prior), len(prior) + steps)  # the chain's token indices
            keep = [cut.keep_prices(j) for j in chain_steps]
            more = [cut.more_prices(j) for j in chain_steps]
            prices = {"prior": list(prior), "keep_a": [a for a, _ in keep],
                      "keep_b": [b for _, b in keep], "more_a": [a for a, _ in more],
                      "more_b": [b for _, b in more]}
        return chain(decoder=self.fused, embedding=embed.data, embedding_type=int(embed.qtype),
                     unread=unread, features=cache.features, keys=cache.keys,
                     values=cache.values,
                     start=start, steps=steps, logits=torch.empty(1, self.lm_head.out_features),
                     head_ids=torch.empty(0, dtype=torch.long) if head_ids is None else head_ids,
                     **prices)

    # a prompt pass attends as short passes would, where the probe allows (class doc), and the
    # one-call pass is invariant by construction: so is every position's bits
    plan_prompts = True
    pass_invariant = True

    def _attend(self, q: torch.Tensor, cache, index: int, start: int, end: int,
                plan) -> torch.Tensor:
        """q [nh, T, d] -> [nh, T, d]: as planned, else (the probe failed) each query alone
        over exactly its own keys."""
        if plan is not None:
            return super()._attend(q, cache, index, start, end, plan)
        return attend_each_query(q, cache, index, start)

    def describe(self) -> str:
        linears = [self.lm_head, *(part for layer in self.layers
                                   for lin in (layer.qkv, layer.out, layer.gate_up, layer.down)
                                   for part in getattr(lin, "parts", [lin]))]
        types = sorted({lin.weight.qtype.name for lin in linears})
        module = quant_linear.kernels()
        products = f"{module.path} kernels" if module is not None else "PyTorch products"
        if self.fused is not None:
            products += ", one C++ call a pass"
        return f"native float32, GGUF {'/'.join(types)} weights ({products})"


def _part(module, linear: QuantLinear):
    """One QuantLinear as a part of forward_layers' projections: its panels, or the file's rows
    (in its output order), and its bias in that order."""
    bias = torch.empty(0) if linear.bias is None else linear.bias
    data = linear.panels
    if data is None:
        data = linear.weight.data
        if linear.order is not None:  # a copy of the rows in the order the runtime computes
            data, bias = data[linear.order], bias[linear.order] if bias.numel() else bias
    return module.Part(data=data.contiguous(), type=int(linear.weight.qtype),
                       panels=linear.panels is not None, out_features=linear.out_features,
                       in_features=linear.in_features, bias=bias.float().contiguous())

