"""Products with GGUF-quantised weights at the file's own bit width (C++ kernels in kernels/).

A weight is the file's raw bytes for one tensor, a uint8 tensor [N, row_bytes] (N output
features; row_bytes = K / block_size * block_bytes, ggml's block layouts), with its type, a
`gguf.GGMLQuantizationType` value: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K.

    y = matmul(x, weight, qtype)       # x [R, K] float32 / bfloat16 -> y [R, N] float32
    w = dequantize(weight, qtype)      # [N, K] float32, the bits of gguf.quants.dequantize
    e = get_rows(weight, qtype, ids)   # ids [...] -> [..., K] float32 (embedding lookup)

matmul quantises each row of x per block of 32 to int8 with one fp32 scale (llama.cpp's Q8_0
activations), takes integer dot products per block and accumulates in fp32 in one fixed order
(kernels/dot.h), so a row's output is the same bits whatever other rows share the call and
whatever the thread count: speculative greedy decoding equals plain greedy. Its error against
x @ dequantize(weight).T comes from the activation codes: at most d_x / 2 (d_x = max|x| / 127
over the element's block) times |w| per element.

Paths, chosen once per process at first use (`path` says which; a log line too):
"avx512" where the CPU has AVX-512 F/BW/VL and VNNI (AMD Zen 4 and later, Intel Ice Lake and
later), "avx2" where it has AVX2, FMA and F16C, "scalar" (portable C++) otherwise. All three
give the same bits. VERISPEC_KERNELS=avx2 or =scalar forces that path; VERISPEC_KERNELS=0 turns
the extension off ("off": the functions here then run `verispec.quant.fallback`, the one
PyTorch path: per-row products over dequantised weights). Each path is a C++ extension
built with the system compiler on first use (~1 min) and cached in
$XDG_CACHE_HOME/verispec/kernels (by default ~/.cache/...; verispec.kernel_build).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from verispec import cpu, kernel_build
from verispec.quant import fallback

log = logging.getLogger("verispec")

SOURCES = Path(__file__).with_name("kernels")
TYPES = fallback.SUPPORTED  # the block types verispec reads, listed once
# -ffp-contract=off: dequantisation must round each product and sum as NumPy does, and the
# products' FMAs are written out, so that both paths run the same operations.
FLAGS = {"scalar": ["-O3", "-fopenmp", "-ffp-contract=off"],
         "avx2": ["-O3", "-fopenmp", "-ffp-contract=off", "-mavx2", "-mfma", "-mf16c"],
         "avx512": ["-O3", "-fopenmp", "-ffp-contract=off", "-mavx2", "-mfma", "-mf16c",
                    "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]}
# The fastest path first; each one runs where its check says so.
RUNS_HERE = {"avx512": lambda: cpu.has_avx512_vnni(), "avx2": lambda: cpu.has_avx2(),
             "scalar": lambda: True}


# The types with a panel layout (kernels/panels.h): the AVX-512 and the AVX2 path each have a
# panel kernel for every one of them, the portable path for none.
PANEL_TYPES = frozenset(GGMLQuantizationType[name] for name in
                        ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"))


def panel_types_here() -> frozenset[GGMLQuantizationType]:
    """The types the kernels will multiply as panels on this CPU, known from its flags and
    VERISPEC_KERNELS without building anything (`panel_types()` asks the built module):
    PANEL_TYPES where the AVX2 or the AVX-512 path runs, none on the portable path or with the
    kernels off."""
    runs = kernel_build.kernel_setting().allows("avx2") and cpu.has_avx2()
    return PANEL_TYPES if runs else frozenset()


def __getattr__(name: str):  # `path` is decided (and the extension built) at first use
    if name == "path":
        return _active()[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load(path: str) -> ModuleType | None:
    """The compiled kernels of one path ("avx512", "avx2" or "scalar"), or None where they cannot
    run or build here. Tests load every path in one process to compare them."""
    if path not in FLAGS:
        raise ValueError(f"unknown kernel path {path!r}; the paths are {sorted(FLAGS)}")
    if not RUNS_HERE[path]():
        return None
    return _build(path)


@functools.cache
def _build(path: str) -> ModuleType | None:
    sources = [SOURCES / "module.cpp", SOURCES / f"{path}.cpp"]
    module = kernel_build.build_extension(f"verispec_quant_{path}", sources,
                                          sorted(SOURCES.glob("*.h")), FLAGS[path],
                                          f"quantised kernels ({path} path)")
    if module is not None:  # measured on Intel and AMD CPUs (panels.h); other vendors alike
        module.set_prefetch(lone_row=cpu.vendor() == "GenuineIntel", far=16)
    return module


@functools.cache
def _active() -> tuple[str, ModuleType | None]:
    setting = kernel_build.kernel_setting()
    if not setting.enabled:
        log.info("quantised kernels: off (VERISPEC_KERNELS=0); products in PyTorch")
        return "off", None
    for path in RUNS_HERE:  # the fastest path first, as far as the setting allows
        if not setting.allows(path):
            continue
        module = load(path)
        if module is not None:
            log.info("quantised kernels: %s path", path)
            return path, module
    log.warning("quantised kernels: none could be built; products in PyTorch")
    return "off", None


def compiled() -> ModuleType | None:
    """The active path's compiled module (its `forward_layers` runs a whole decoder pass,
    kernels/forward.h), or None where the kernels are off or could not be built."""
    return _active()[1]


def _layout(qtype) -> tuple[GGMLQuantizationType, int, int]:
    try:
        qtype = GGMLQuantizationType(int(qtype))
    except (ValueError, TypeError):
        qtype = None
    if qtype not in TYPES:
        names = ", ".join(t.name for t in TYPES)
        raise ValueError(f"GGUF type {qtype!r} has no quantised kernel; supported: {names}")
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    return qtype, block_size, block_bytes


def row_length(weight: torch.Tensor, qtype) -> int:
    """K, the values in one row of `weight` ([N, row_bytes] uint8), checking the row's bytes
    hold whole blocks of `qtype`."""
    qtype, block_size, block_bytes = _layout(qtype)
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.uint8 or weight.dim() != 2:
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else "-"
        raise ValueError(f"a {qtype.name} weight is a uint8 tensor [N, row_bytes]; got {got} "
                         f"of shape {shape}")
    row_bytes = weight.shape[1]
    if row_bytes == 0 or row_bytes % block_bytes:
        raise ValueError(f"{qtype.name} weight rows of {row_bytes} bytes are not whole blocks "
                         f"({block_bytes} bytes per {block_size} values)")
    return row_bytes // block_bytes * block_size


def matmul(x: torch.Tensor, weight: torch.Tensor, qtype) -> torch.Tensor:
    """y [..., N] float32 = x [..., K] @ dequantize(weight).T, by int8 products (module doc)."""
    qtype, block_size, block_bytes = _layout(qtype)
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16) \
            or x.dim() == 0:
        raise ValueError(f"x must be a float32 or bfloat16 tensor [..., K]; got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    features = x.shape[-1]
    if features % block_size:
        raise ValueError(f"K = {features} is not a multiple of {qtype.name}'s block of "
                         f"{block_size} values")
    K = row_length(weight, qtype)
    if features != K:
        raise ValueError(f"x has K = {features} features but the {qtype.name} weight's rows "
                         f"hold {K} ({weight.shape[1]} bytes)")
    rows = x.reshape(-1, K).to(torch.float32).contiguous()  # [R, K]
    module = _active()[1]
    if module is None:
        y = fallback.matmul(rows, weight, qtype)
    else:
        y = module.matmul(rows, weight.contiguous(), int(qtype))  # [R, N]
    return y.reshape(*x.shape[:-1], weight.shape[0])


def dequantize(weight: torch.Tensor, qtype) -> torch.Tensor:
    """weight [N, row_bytes] -> [N, K] float32, bit for bit gguf.quants.dequantize."""
    qtype, _, _ = _layout(qtype)
    row_length(weight, qtype)
    module = _active()[1]
    if module is None:
        return fallback.dequantize(weight, qtype)
    return module.dequantize(weight.contiguous(), int(qtype))


def get_rows(weight: torch.Tensor, qtype, ids: torch.Tensor) -> torch.Tensor:
    """The rows `ids` (any shape of integers in [0, N)) of weight, dequantised: [*ids, K]."""
    qtype, _, _ = _layout(qtype)
    K = row_length(weight, qtype)
    ids = torch.as_tensor(ids)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"ids must be integers; got {ids.dtype}")
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    values = flat.cpu().numpy()  # (NumPy's min and max: no torch reductions a pass)
    if values.size and (values.min() < 0 or values.max() >= weight.shape[0]):
        raise ValueError(f"ids must lie in [0, {weight.shape[0]}); got {values.min()} .. "
                         f"{values.max()}")
    module = _active()[1]
    if module is None:
        rows = dequantize(weight[flat], qtype)
    else:
        rows = module.get_rows(weight.contiguous(), int(qtype), flat)
    return rows.reshape(*ids.shape, K)


def panel_types() -> frozenset[int]:
    """The GGUF types the active path multiplies as panels of 16 weight rows (kernels/panels.h:
    PANEL_TYPES on the AVX-512 and AVX2 paths), empty on the portable path or with none."""
    module = _active()[1]
    return frozenset(module.panel_types()) if module is not None else frozenset()


def pack(weight: torch.Tensor, qtype) -> torch.Tensor:
    """weight [N, row_bytes] (N a multiple of 16, a type of `panel_types()`) as panels:
    [N / 16, panel bytes], the layout `matmul_panels` reads."""
    qtype, _, _ = _layout(qtype)
    row_length(weight, qtype)
    types = panel_types()
    if int(qtype) not in types or weight.shape[0] % 16:
        raise ValueError(f"{qtype.name} [{weight.shape[0]}, ...] has no panel layout on the "
                         f"{_active()[0]} path (panel types: {sorted(types)}, rows a "
                         "multiple of 16)")
    return _active()[1].pack(weight.contiguous(), int(qtype))


def matmul_panels(x: torch.Tensor, panels: torch.Tensor, qtype, features: int) -> torch.Tensor:
    """y [R, N] float32 = x [R, K] times the packed weight's rows, in panels.h's order."""
    qtype, _, _ = _layout(qtype)
    rows = x.reshape(-1, features).to(torch.float32).contiguous()
    return _active()[1].matmul_panels(rows, panels, int(qtype), features)
