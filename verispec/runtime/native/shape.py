"""What the native runtime reads off a model's configuration: the Llama-family shape it runs, and
the architectures it supports."""

from __future__ import annotations

from dataclasses import dataclass

from verispec.errors import VerispecError

SUPPORTED = ("llama", "mistral", "qwen2")


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
