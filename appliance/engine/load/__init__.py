"""Load a model from a local path into a ready Engine: a Hugging Face directory (hf.py) or a .gguf file (gguf.py).

Policies:
- Models load from local paths only. Every problem with the path or the checkpoint is a ModelLoadError with
  a one-line message (the CLI prints it and exits non-zero: 2 for a ModelFileError, a model file whose content
  is refused (invalid, inconsistent with itself, or holding what we do not serve, like a tensor type no kernel
  runs: UnsupportedTensorType), naming the file, the tensor or key and the problem; 1 otherwise).
- A file is validated before it is trusted: its container (gguf_file.py, safetensors.py), then what the
  architecture needs of it (gguf_check.py, hf_check.py), all before any byte is wrapped into a weight or
  reaches the C kernels.
- Everything a deployment chooses at load time travels in one LoadOptions, passed into loading; nothing is
  set on the loaded model afterwards. The format loaders build (config, model, tokenizer, template, eos ids,
  default sampling); `finish` is the one shared tail that applies the options and builds the Engine.
- The model's display name (what /v1/models lists) is `model_name(path)`, worked out here only.
- Memory (decided in `finish`, logged once): the KV cache is float16 unless asked otherwise; the context
  defaults to the model's trained context capped so a full cache takes at most half of the memory available
  at load (the cache's pages are committed only as positions are used); --cache-ram defaults to a quarter of
  that available memory, for the active sequence plus copies of earlier ones.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace

from .phases import Phases

DEFAULT_CONTEXT = 4096  # when the model does not say its trained context
KV_TYPES = ("f16", "f32")
log = logging.getLogger("appliance.load")


class ModelLoadError(Exception):
    """The model path cannot be served; the message is one line for the user."""


class ModelFileError(ModelLoadError):
    """The model file's content is refused: invalid, inconsistent, or of a kind we do not serve."""


class UnsupportedTensorType(ModelFileError):
    """A weight is stored in a type no kernel serves (the message names the tensor and its type)."""


@dataclass(frozen=True)
class LoadOptions:
    """Deployment choices made at load time (the CLI's flags; tests pass a few)."""
    context_length: int | None = None  # tokens; None -> the trained context, capped by memory
    prefill_chunk: int = 256  # prompt tokens per prefill step
    threads: int | None = None  # the C kernels' pool size (None: the library's default)
    kv_type: str = "f16"  # KV cache element type: "f16" (half the memory) or "f32"
    cache_ram_mb: int | None = None  # active + cached sequences' KV; None -> a quarter of the available memory
    prefix_reuse: bool = True  # reuse the KV of a cached prefix across requests
    prompt_cache_dir: str | None = None  # keep shared prompt prefixes' KV on disk across restarts
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
    phases: Phases = field(default_factory=Phases)  # where the load's time went (phases.py)


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
    if options.kv_type not in KV_TYPES:
        raise ModelLoadError(f"KV cache type {options.kv_type!r} is not supported (supported: {', '.join(KV_TYPES)})")
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"model path does not exist: {path}")
    if not os.access(path, os.R_OK):
        raise ModelLoadError(f"model path is not readable: {path}")
    phases = Phases()
    from appliance.native import kernels  # noqa: F401  (loads the C library, starts its thread pool)
    phases.mark("native library")
    if options.threads:
        set_native_threads(options.threads)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelLoadError(f"not a model directory or .gguf file: {path}")
        from .gguf import read_gguf as read
    else:
        from .hf import read_hf_dir as read
    phases.mark("imports (model code)")
    ckpt = read(path, options, phases)
    return finish(path, ckpt, options, phases)


def available_memory() -> int:
    """Bytes the kernel says are available now (MemAvailable), or a quarter of physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (OSError, ValueError):
        return 2**30


def set_native_threads(n: int) -> int | None:
    """The C kernels' pool size: big cores first, pinned, then the next biggest (None without the library)."""
    from appliance.native import kernels
    if not kernels.available():
        return None
    return kernels.configure_threads(n)


def decoder_of(model):
    """The Qwen3Model that runs the text layers (the model itself, or a Qwen3-VL model's text decoder)."""
    from ..qwen3_vl import Qwen3VLModel
    return model.text if isinstance(model, Qwen3VLModel) else model


def finish(path: str, ckpt: Checkpoint, options: LoadOptions, phases: Phases | None = None) -> LoadedModel:
    """The shared tail: page-release policies, the layer runner, context length, the Engine; marks its parts
    in `phases` (the load's record, which the LoadedModel keeps)."""
    phases = phases if phases is not None else Phases()
    from ..generate import Engine
    from ..layer_runner import choose_runner
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
    choose_runner(decoder_of(ckpt.model))  # native or numpy layers: once, after the weights took their form
    phases.mark("layers")
    import numpy as np

    from ..kv_cache import KV_TYPES as KV_DTYPES

    cfg = ckpt.config
    dtype = np.dtype(KV_DTYPES[options.kv_type])
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
    trained = getattr(cfg, "max_position_embeddings", None) or DEFAULT_CONTEXT
    avail = available_memory()
    fits = max(256, avail // 2 // per_token)
    ctx = min(options.context_length, trained) if options.context_length else min(trained, fits)
    cache_bytes = options.cache_ram_mb * 2**20 if options.cache_ram_mb is not None else avail // 4
    log.info("context %d tokens (%s; trained %d), KV cache %s: %d bytes/token, %.0f MB at full context; "
             "prefix cache %s, budget %.0f MB", ctx, "--ctx" if options.context_length else "default: trained, "
             "capped by memory", trained, options.kv_type, per_token, ctx * per_token / 2**20,
             "on" if options.prefix_reuse else "off", cache_bytes / 2**20)
    engine = Engine(ckpt.model, ckpt.tokenizer, ckpt.eos_ids, ctx, options.prefill_chunk, kv_dtype=dtype,
                    cache_bytes=cache_bytes, reuse_prefix=options.prefix_reuse)
    phases.mark("engine (KV and prefix caches)")
    if options.prompt_cache_dir and options.prefix_reuse:
        from ..prompt_disk import PromptDiskCache, model_identity
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        try:
            engine.disk = PromptDiskCache(options.prompt_cache_dir, model_identity(path, shape, dtype), shape, dtype)
            engine.adopt(engine.disk.load_all())
        except OSError as e:
            raise ModelLoadError(f"--prompt-cache-dir {options.prompt_cache_dir}: {e.strerror or e}") from None
    if options.prompt_cache_dir:
        phases.mark("prompt cache")
    return LoadedModel(name=model_name(path), path=path, config=ckpt.config, model=ckpt.model,
                       tokenizer=ckpt.tokenizer, chat_template=ckpt.chat_template, engine=engine, options=options,
                       default_sampling=ckpt.default_sampling, context_length=ctx, eos_ids=ckpt.eos_ids,
                       multimodal=getattr(ckpt.model, "multimodal", False), phases=phases)
