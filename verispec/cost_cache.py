"""The cost-model cache: cost models measured once per machine and model, kept as JSON.

A cost model (verispec.costs) times the real runtime, so it changes with what the runtime runs
on and with nothing else. Its key holds all of that:

    machine      the CPU's model name and the flags that pick kernels, VERISPEC_KERNELS,
                 torch's version and thread count
    verispec     its version, and a hash of its own sources (kernels included): a development
                 checkout measures again after an edit
    models       each model file or folder loaded (target, draft): path, size, modification
                 time (a folder: those of its files)
    runtime      the target runner's own description (runtime, dtype, kernel path), its
                 vocabulary and context; the drafter's kind and settings
    measurement  the measurement's own parameters (K max, contexts, repeats, tree settings)

`CostCache(key)` keeps every model measured under one key (the one-row model and each batch
size's) in one file, <folder>/<hash of the key>.json, the key written beside the models; the
folder is $XDG_CACHE_HOME/verispec/costs (default ~/.cache/verispec/costs). A file is written
whole to a temporary name and renamed over the old one, so no reader sees half a file. A file
that cannot be read or parsed, or that holds another key, is ignored (logged) and measured
again.

VERISPEC_COST_CACHE=0 turns the cache off (neither read nor written: every process measures);
VERISPEC_COST_CACHE=DIR keeps it in DIR instead.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from verispec import cpu, kernel_build
from verispec.costs import CostModel
from verispec.version import installed_version

log = logging.getLogger("verispec")

ENV = "VERISPEC_COST_CACHE"
FORMAT = 1  # of the file; a file of another format is measured again


def folder() -> Path | None:
    """Where the cost cache lives (None: turned off with VERISPEC_COST_CACHE=0)."""
    setting = os.environ.get(ENV, "").strip()
    if setting.lower() in ("0", "off", "false", "no"):
        return None
    if setting and setting.lower() not in ("1", "on", "true", "yes"):
        return Path(setting).expanduser()
    return kernel_build.cache_folder("costs")


def machine_key() -> dict:
    """What about this machine and process changes a measurement."""
    setting = kernel_build.kernel_setting()
    return {"cpu": cpu.model_name(), "cpu_flags": cpu.kernel_flags(),
            "kernels": setting.ceiling if setting.enabled else "off",
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "verispec": installed_version(), "sources": sources_hash()}


@functools.cache
def sources_hash() -> str:
    """A hash of verispec's own sources (Python and C++): its code, kernels included."""
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(p for suffix in ("*.py", "*.cpp", "*.h") for p in package.rglob(suffix)):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def file_identity(path: str | os.PathLike) -> dict:
    """A model file's (or folder's) path, size and modification time; a folder's files'.
    Example: {"path": "/m/a.gguf", "size": 98362432, "mtime_ns": 1733300000000000000}."""
    path = Path(path).expanduser().resolve()
    try:
        if path.is_dir():
            return {"path": str(path), "files": [
                [entry.name, entry.stat().st_size, entry.stat().st_mtime_ns]
                for entry in sorted(path.iterdir()) if entry.is_file()]}
        stat = path.stat()
    except OSError:
        return {"path": str(path), "missing": True}
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def drafter_settings(drafter) -> dict | None:
    """The drafter's kind and what changes the time of its step (None: no drafter)."""
    from verispec.drafters.feature import FeatureDrafter
    from verispec.drafters.hybrid import HybridDrafter
    from verispec.drafters.model import ModelDrafter
    from verispec.drafters.ngram import NgramDrafter
    from verispec.drafters.suffix import SuffixDrafter

    if drafter is None:
        return None
    settings: dict = {"kind": getattr(drafter, "name", type(drafter).__name__)}
    if isinstance(drafter, HybridDrafter):
        settings.update(model=drafter_settings(drafter.model),
                        lookup=drafter_settings(drafter.lookup))
    elif isinstance(drafter, NgramDrafter):
        settings.update(max_ngram=drafter.max_ngram, min_ngram=drafter.min_ngram)
    elif isinstance(drafter, SuffixDrafter):
        settings.update(max_match=drafter.max_match, min_match=drafter.min_match)
    elif isinstance(drafter, FeatureDrafter):
        settings.update(tree_width=drafter.tree_width,
                        sampled_tree_width=drafter.sampled_tree_width, taps=list(drafter.taps),
                        head_vocab=int(drafter.head_token_ids.numel()))
    elif isinstance(drafter, ModelDrafter):
        settings.update(runtime=drafter.runner.describe(), head_vocab=None
                        if drafter.head_token_ids is None else int(drafter.head_token_ids.numel()))
    return settings


def cost_key(target, drafter, files: Sequence[str | os.PathLike], measurement: dict) -> dict:
    """The key of the cost models measured with runner `target` and `drafter` (loaded from
    `files`) by a measurement with these parameters (see the module docstring)."""
    return {"machine": machine_key(),
            "models": [file_identity(path) for path in files],
            "runtime": {"target": target.describe(), "vocab_size": target.vocab_size,
                        "max_positions": target.max_positions,
                        "draft": drafter_settings(drafter)},
            "measurement": measurement}


def to_json(model: CostModel) -> dict:
    return dataclasses.asdict(model)


def from_json(data: dict) -> CostModel:
    """The CostModel `to_json` wrote; ValueError for anything else."""
    names = {field.name for field in dataclasses.fields(CostModel)}
    if not isinstance(data, dict) or not set(data) <= names:
        raise ValueError(f"not a cost model: {data!r}"[:200])

    def curve(values) -> tuple[float, ...] | None:
        if values is None:
            return None
        values = tuple(float(v) for v in values)
        if not values:
            raise ValueError("an empty verification curve")
        return values

    optional, long_step = data.get("long_draft_step"), data.get("long_step")
    return CostModel(draft_step=float(data["draft_step"]), verify=curve(data["verify"]),
                     target_step_s=float(data["target_step_s"]),
                     long_verify=curve(data.get("long_verify")),
                     contexts=tuple(int(c) for c in data.get("contexts", (128, 1024))),
                     long_draft_step=None if optional is None else float(optional),
                     long_step=None if long_step is None else float(long_step),
                     sampling_step=float(data.get("sampling_step", 0.0)),
                     draft_catch_up_s=float(data.get("draft_catch_up_s", 0.0)))


class CostCache:
    """The cost models of one key, by batch size (1: the one-row model), in one file."""

    def __init__(self, key: dict, root: Path) -> None:
        self.key = json.loads(json.dumps(key))  # as it reads back: lists, string keys
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()
        self.path = root / f"{digest[:24]}.json"

    def load(self) -> dict[int, CostModel]:
        """The models kept under this key; none where the file is missing or unreadable."""
        try:
            text = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as err:
            log.warning("cost cache: cannot read %s (%s); measuring instead", self.path, err)
            return {}
        try:
            data = json.loads(text.decode())
            if data.get("format") != FORMAT or data.get("key") != self.key:
                log.info("cost cache: %s holds another configuration; measuring again",
                         self.path)
                return {}
            return {int(size): from_json(model) for size, model in data["models"].items()}
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            log.warning("cost cache: ignoring %s, which cannot be read (%s: %s); measuring "
                        "again", self.path, type(err).__name__, str(err)[:200])
            return {}

    def store(self, models: dict[int, CostModel], replace: bool = False) -> None:
        """Keep `models`, beside those another process may have kept under this key meanwhile
        (replace: instead of them). A cache that cannot be written is logged and left."""
        kept = {} if replace else self.load()
        kept.update(models)
        text = json.dumps({"format": FORMAT, "key": self.key,
                           "models": {str(size): to_json(kept[size]) for size in sorted(kept)}},
                          indent=1)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".", suffix=".tmp")
            try:
                with os.fdopen(handle, "w") as file:
                    file.write(text)
                os.replace(temporary, self.path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
        except OSError as err:
            log.warning("cost cache: cannot write %s (%s)", self.path, err)
