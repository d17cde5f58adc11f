"""A quantized GGUF model as verispec holds it: the file's tensors in their own formats, the
configuration from its metadata. Not a transformers model: it runs on the native runtime
(`verispec.runtime.native.gguf_model`), and offers what drafters and the decoder read off a
target (config, generation_config, the embedding and head tables).

The metadata keys are llama.cpp's, under the architecture's name: for "qwen2",
qwen2.block_count, qwen2.embedding_length, qwen2.attention.head_count, ... Files of architecture
"llama" store the q and k rows of every head with the two rotary halves interleaved (llama.cpp's
rotary pairs adjacent values); `QK_ORDER` puts them back in transformers' order (halves apart).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LlamaConfig, PretrainedConfig, Qwen2Config

from verispec.quant.gguf import GGUFError, GGUFFile
from verispec.quant.linear import QuantMatrix

ARCHITECTURES = {"llama": LlamaConfig, "qwen2": Qwen2Config}
INTERLEAVED_QK = ("llama",)  # architectures whose GGUF q/k rows are interleaved per head


@dataclass(frozen=True, slots=True)
class Table:
    """What `get_input_embeddings()` / `get_output_embeddings()` return: `.weight` is the
    table (a QuantMatrix; indexing it by ids gives float32 rows)."""

    weight: QuantMatrix


class GGUFModel:
    """A GGUF file's model, weights at the file's bit width (see the module docstring)."""

    dtype = torch.float32  # activations and caches on the native runtime
    device = torch.device("cpu")

    def __init__(self, file: GGUFFile) -> None:
        self.file = file
        self.config = gguf_config(file)
        self.generation_config = GenerationConfig(bos_token_id=self.config.bos_token_id,
                                                  eos_token_id=self.config.eos_token_id)
        self.embed = QuantMatrix(file.tensor("token_embd.weight"))
        tied = "output.weight" not in file.tensors
        self.head = self.embed if tied else QuantMatrix(file.tensor("output.weight"))
        self.native = None  # the NativeLlama over these weights, built once (make_runner)

    def get_input_embeddings(self) -> Table:
        return Table(self.embed)

    def get_output_embeddings(self) -> Table:
        return Table(self.head)

    def describe(self) -> str:
        return f"{self.file.path.name} ({self.config.model_type}, {_type_counts(self.file)})"


def gguf_config(file: GGUFFile) -> PretrainedConfig:
    """The transformers configuration the file's metadata describes (llama or qwen2)."""
    architecture = file.architecture
    if architecture not in ARCHITECTURES:
        raise GGUFError(f"{file.path.name}: architecture {architecture!r} is not supported with "
                        f"quantized weights (verispec reads {', '.join(ARCHITECTURES)}); "
                        "--dequantize bf16 loads it through transformers")
    scaling = file.arch_value("rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise GGUFError(f"{file.path.name}: rope scaling {scaling!r} is not supported")

    def need(key: str):
        value = file.arch_value(key)
        if value is None:
            raise GGUFError(f"{file.path.name} has no {architecture}.{key} in its metadata")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(file.arch_value("attention.key_length", hidden // heads))
    rotary = int(file.arch_value("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise GGUFError(f"{file.path.name}: rotary embedding over {rotary} of {head_dim} head "
                        "dimensions (partial rotary) is not supported")
    vocab = int(file.arch_value("vocab_size", file.tensor("token_embd.weight").shape[0]))
    return ARCHITECTURES[architecture](
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")), num_attention_heads=heads,
        num_key_value_heads=int(file.arch_value("attention.head_count_kv", heads)),
        head_dim=head_dim, rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default",
                         "rope_theta": float(file.arch_value("rope.freq_base", 10000.0))},
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in file.tensors,
        attention_bias="blk.0.attn_q.bias" in file.tensors,
        bos_token_id=file.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=file.metadata.get("tokenizer.ggml.eos_token_id"))


def qk_order(architecture: str, heads: int, head_dim: int) -> torch.Tensor | None:
    """The output order that turns a q (or k) product of this architecture's file into
    transformers' layout: y_hf = y_file[:, order]; None when the file is in that layout.

    Per head, the file holds rotary pair i as rows 2i, 2i + 1, transformers rows i and
    i + head_dim / 2: e.g. head_dim 4 -> order [0, 2, 1, 3] within each head."""
    if architecture not in INTERLEAVED_QK:
        return None
    rows = torch.arange(heads * head_dim).view(heads, head_dim // 2, 2)
    return rows.transpose(1, 2).reshape(-1)


def _type_counts(file: GGUFFile) -> str:
    counts: dict[str, int] = {}
    for tensor in file.tensors.values():
        counts[tensor.qtype.name] = counts.get(tensor.qtype.name, 0) + 1
    return " ".join(f"{name} x{n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))
