"""The native runtime over a quantized GGUF file: a NativeLlama whose linear layers compute from
the file's blocks (`verispec.quant.linear`), float32 activations, norms and caches.

The layers run in NativeLlama's PyTorch loop (the fused C++ decoder takes AMX tiles only). A
float32 pass attends query by query over each query's own keys (NativeLlama probes this), and
quantized products are row-independent, so a position's logits are the same bits in any pass:
speculative greedy output equals plain greedy.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from gguf.quants import dequantize as gguf_dequantize

from verispec.quant.linear import ConcatLinear, QuantLinear, QuantMatrix, kernels
from verispec.quant.model import GGUFModel, qk_order
from verispec.runtime.native.llama import INVARIANT_MAX, LayerWeights, LlamaShape, NativeLlama
from verispec.runtime.native.runner import NativeRunner

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

    Every pass attends query by query, prompt passes too. The kernels quantise activations to
    int8, which turns a last-bit difference in a position's attention output (a prompt pass's
    one causal call rounds unlike a lone query) into a different code and a logit 0.5-1 away;
    then a position computed once in a prompt pass and again in a verification pass (a prompt
    reused from the cache) would part greedy speculative output from plain. One call per
    query keeps a position's bits the same in any pass, at a few ms per query in a prompt."""

    def _attend(self, q: torch.Tensor, cache, index: int, start: int, end: int,
                plan) -> torch.Tensor:
        """q [nh, T, d] -> [nh, T, d]: each query alone over exactly its own keys."""
        if plan is not None or q.shape[1] <= INVARIANT_MAX:
            return super()._attend(q, cache, index, start, end, plan)
        keys, values = cache.keys[index].unsqueeze(0), cache.values[index].unsqueeze(0)
        heads, length, dim = q.shape
        kv_heads = self.shape.num_kv_heads
        grouped = q.view(kv_heads, heads // kv_heads, length, dim)
        return torch.cat([
            F.scaled_dot_product_attention(
                grouped[None, :, :, t], keys[:, :, :start + t + 1],
                values[:, :, :start + t + 1]).view(heads, 1, dim)
            for t in range(length)], dim=1)

    def describe(self) -> str:
        linears = [self.lm_head, *(part for layer in self.layers
                                   for lin in (layer.qkv, layer.out, layer.gate_up, layer.down)
                                   for part in getattr(lin, "parts", [lin]))]
        types = sorted({lin.weight.qtype.name for lin in linears})
        module = kernels()
        products = f"{module.path} kernels" if module is not None else "PyTorch products"
        return f"native float32, GGUF {'/'.join(types)} weights ({products})"

