"""`verispec bench`: verispec side by side with plain decoding and transformers' own code."""

from verispec.bench.bench_config import BenchConfig
from verispec.bench.harness import run_bench

__all__ = ["BenchConfig", "run_bench"]
