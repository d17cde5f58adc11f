"""`verispec bench`: verispec side by side with plain decoding and transformers' own code."""

from verispec.bench.config import BenchConfig
from verispec.bench.runner import run_bench

__all__ = ["BenchConfig", "run_bench"]
