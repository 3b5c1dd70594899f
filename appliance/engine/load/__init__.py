"""Load a model from a local path into a ready Engine: a Hugging Face directory (hf.py) or a .gguf file (gguf.py).

Policies:
- Models load from local paths only. Every problem with the path or the checkpoint is a ModelLoadError with
  a one-line message (the CLI prints it and exits non-zero).
- Everything a deployment chooses at load time travels in one LoadOptions, passed into loading; nothing is
  set on the loaded model afterwards. The format loaders build (config, model, tokenizer, template, eos ids,
  default sampling); `finish` is the one shared tail that applies the options and builds the Engine.
- The model's display name (what /v1/models lists) is `model_name(path)`, worked out here only.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace

DEFAULT_CONTEXT = 4096
log = logging.getLogger("appliance")


class ModelLoadError(Exception):
    """The model path cannot be served; the message is one line for the user."""


@dataclass(frozen=True)
class LoadOptions:
    """Deployment choices made at load time (the CLI's flags; tests pass a few)."""
    context_length: int | None = None  # tokens; None -> the model's, at most DEFAULT_CONTEXT
    prefill_chunk: int = 256  # prompt tokens per prefill step
    threads: int | None = None  # the C kernels' pool size (None: the library's default)
    kv_type: str = "f32"  # KV cache element type (only "f32" today)
    moe_release_pages: bool = False  # MoE: give an expert's weight pages back to the kernel after each use
    image_max_pixels: int | None = None  # multimodal: cap on resized image pixels (lowers the model's own bound)
    max_resident_mib: int | None = None  # dense: keep at most this many MiB of mapped weights resident (resident.py)


@dataclass
class LoadedModel:
    name: str
    path: str
    config: object
    model: object
    tokenizer: object
    chat_template: object
    engine: object  # generate.Engine
    options: LoadOptions = field(default_factory=LoadOptions)
    default_sampling: dict = field(default_factory=dict)
    context_length: int = DEFAULT_CONTEXT
    eos_ids: set[int] = field(default_factory=set)
    multimodal: bool = False  # accepts image content parts


@dataclass
class Checkpoint:
    """What a format loader read: the pieces `finish` turns into a LoadedModel."""
    config: object
    model: object
    tokenizer: object
    chat_template: object
    eos_ids: set[int]
    default_sampling: dict


def model_name(path: str) -> str:
    """The name the service lists for the model at `path` (the file or directory name)."""
    return os.path.basename(os.path.abspath(path).rstrip("/")) or "model"


def load_model(path: str, options: LoadOptions | None = None, **overrides) -> LoadedModel:
    """A model path -> LoadedModel. `overrides` are LoadOptions fields (load_model(p, context_length=256))."""
    options = replace(options or LoadOptions(), **overrides)
    if options.kv_type != "f32":
        raise ModelLoadError(f"KV cache type {options.kv_type!r} is not supported (supported: f32)")
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"model path does not exist: {path}")
    if not os.access(path, os.R_OK):
        raise ModelLoadError(f"model path is not readable: {path}")
    if options.threads:
        set_native_threads(options.threads)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelLoadError(f"not a model directory or .gguf file: {path}")
        from .gguf import read_gguf
        ckpt = read_gguf(path, options)
    else:
        from .hf import read_hf_dir
        ckpt = read_hf_dir(path, options)
    return finish(path, ckpt, options)


def set_native_threads(n: int) -> int | None:
    """The C kernels' pool size: big cores first, pinned, then the next biggest (None without the library)."""
    from appliance.native import kernels
    if not kernels.available():
        return None
    return kernels.configure_threads(n)


def finish(path: str, ckpt: Checkpoint, options: LoadOptions) -> LoadedModel:
    """The shared tail: page-release policies, context length, the Engine."""
    from ..generate import Engine
    from ..qwen3_moe import set_release_pages

    if options.moe_release_pages:
        set_release_pages(ckpt.model, True)
    if options.max_resident_mib:
        from ..resident import ResidentBudgetError, set_max_resident
        try:
            plan = set_max_resident(ckpt.model, options.max_resident_mib << 20)
        except ResidentBudgetError as e:
            raise ModelLoadError(f"--max-resident {options.max_resident_mib}: {e}") from None
        log.info("low-memory mode: %s", plan.describe(len(ckpt.model.layers)))
    limit = getattr(ckpt.config, "max_position_embeddings", DEFAULT_CONTEXT)
    ctx = min(options.context_length or DEFAULT_CONTEXT, limit)
    engine = Engine(ckpt.model, ckpt.tokenizer, ckpt.eos_ids, ctx, options.prefill_chunk)
    return LoadedModel(name=model_name(path), path=path, config=ckpt.config, model=ckpt.model,
                       tokenizer=ckpt.tokenizer, chat_template=ckpt.chat_template, engine=engine, options=options,
                       default_sampling=ckpt.default_sampling, context_length=ctx, eos_ids=ckpt.eos_ids,
                       multimodal=getattr(ckpt.model, "multimodal", False))
