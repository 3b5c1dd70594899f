"""Load a model from a local path into a ready Engine: a Hugging Face directory (hf.py) or a .gguf file (gguf.py).

Policies:
- Models load from local paths only. Every problem with the path or the checkpoint is a ModelLoadError with
  a one-line message (the CLI prints it and exits non-zero: 2 for a ModelFileError, a model file whose content
  is refused (invalid, inconsistent with itself, or holding what we do not serve, like a tensor type no kernel
  runs: UnsupportedTensorType; an mmproj file that is not the text model's pair: MismatchedPair; a chat
  template that breaks its sandbox: UnsafeTemplate), naming the file, the tensor or key and the problem; 1 otherwise).
- A file is validated before it is trusted: its container (gguf_file.py, safetensors.py), then what the
  architecture needs of it (gguf_check.py, hf_check.py), all before any byte is wrapped into a weight or
  reaches the C kernels.
- Everything a deployment chooses at load time travels in one LoadOptions, passed into loading; nothing is
  set on the loaded model afterwards. The format loaders build (config, model, tokenizer, template, eos ids,
  default sampling); `finish` is the one shared tail that applies the options and builds the Engine.
- `--draft-model` (options.draft_model) is read like the model itself, after it, and must share its tokenizer
  (MismatchedDraft, exit status 2, otherwise); its KV cache (the same context and type) counts in the memory
  cap of the context and, per position of the active sequence, against --cache-ram (draft_model.py).
- The model's display name (what /v1/models lists) is `model_name(path)`, worked out here only.
- Memory (decided in `finish`, logged once): the KV cache is float16 unless asked otherwise (float32 for an
  embedding model or a reranker, whose outputs are compared to float32 references at 1e-5); the context
  defaults to the model's trained context capped so a full cache takes at most half of the memory available
  at load (the cache's pages are committed only as positions are used); --cache-ram defaults to a quarter of
  that available memory, for the active sequence plus copies of earlier ones.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Union, cast

from ..speculative import SpecOptions
from .phases import Phases

if TYPE_CHECKING:
    from ..chat_template import ChatTemplate
    from ..config import Qwen3Config
    from ..embedding import ModelTask
    from ..generate import CausalLM, Engine
    from ..qwen3 import Qwen3Model
    from ..qwen3_vl import Qwen3VLModel
    from ..tokenizer import Tokenizer

    DecoderModel = Union[Qwen3Model, Qwen3VLModel]  # what a loader builds

DEFAULT_CONTEXT = 4096  # when the model does not say its trained context
KV_TYPES = ("f16", "f32")
log = logging.getLogger("appliance.load")


class ModelLoadError(Exception):
    """The model path cannot be served; the message is one line for the user."""


class ModelFileError(ModelLoadError):
    """The model file's content is refused: invalid, inconsistent, or of a kind we do not serve."""


class UnsupportedTensorType(ModelFileError):
    """A weight is stored in a type no kernel serves (the message names the tensor and its type)."""


class UnsafeTemplate(ModelFileError):
    """The model's chat template broke the sandbox or its budget when rendered at load (chat_template.vet)."""


class MismatchedPair(ModelFileError):
    """A vision projector (mmproj file) that does not belong to the text model: another width, projector, ..."""


class MismatchedDraft(ModelFileError):
    """A --draft-model whose tokenizer is not the model's."""


@dataclass(frozen=True)
class LoadOptions:
    """Deployment choices made at load time (the CLI's flags; tests pass a few)."""
    context_length: int | None = None  # tokens; None -> the trained context, capped by memory
    prefill_chunk: int = 256  # prompt tokens per prefill step
    threads: int | None = None  # the C kernels' pool size (None: the library's default)
    kv_type: str = "f16"  # KV cache element type: "f16" (half the memory) or "f32"
    kv_type_given: bool = False  # kv_type was chosen (--kv-type); else embedding models and rerankers use f32
    cache_ram_mb: int | None = None  # active + cached sequences' KV; None -> a quarter of the available memory
    prefix_reuse: bool = True  # reuse the KV of a cached prefix across requests
    prompt_cache_dir: str | None = None  # keep shared prompt prefixes' KV on disk across restarts
    moe_release_pages: bool = False  # MoE: give an expert's weight pages back to the kernel after each use
    image_max_pixels: int | None = None  # multimodal: cap on resized image pixels (lowers the model's own bound)
    max_resident_mib: int | None = None  # dense: keep at most this many MiB of mapped weights resident (resident.py)
    spec: SpecOptions = SpecOptions()  # speculative decoding (drafts from the prompt by default)
    draft_model: str | None = None  # --draft-model: drafts from this model (same tokenizer) instead of the prompt
    mmproj: str | None = None  # GGUF Qwen3-VL: the vision projector file (None: the one mmproj*.gguf beside it)
    task: str | None = None  # "embedding" / "rerank" (--embedding / --reranking); None: what the checkpoint says
    pooling: str | None = None  # an embedding model's pooling (--pooling last|mean|cls); None: the checkpoint's


@dataclass
class LoadedModel:
    name: str
    path: str
    config: Qwen3Config
    model: DecoderModel
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    engine: Engine
    options: LoadOptions = field(default_factory=LoadOptions)
    default_sampling: dict = field(default_factory=dict)
    context_length: int = DEFAULT_CONTEXT
    eos_ids: set[int] = field(default_factory=set)
    multimodal: bool = False  # accepts image content parts
    images_hint: str = ""  # not multimodal: what a refused image part is told (a VL text model without --mmproj)
    phases: Phases = field(default_factory=Phases)  # where the load's time went (phases.py)
    task: ModelTask | None = None  # an embedding model's or a reranker's (embedding.py); None: a generative model

    @property
    def kind(self) -> str:
        """'generate', 'embedding' or 'rerank'."""
        return "generate" if self.task is None else self.task.kind


@dataclass
class Checkpoint:
    """What a format loader read: the pieces `finish` turns into a LoadedModel."""
    config: Qwen3Config
    model: DecoderModel
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    eos_ids: set[int]
    default_sampling: dict
    images_hint: str = ""  # see LoadedModel.images_hint
    task_hint: dict | None = None  # what the checkpoint says it is for: {kind, pooling, normalize, source, head}


def model_name(path: str) -> str:
    """The name the service lists for the model at `path` (the file or directory name)."""
    return os.path.basename(os.path.abspath(path).rstrip("/")) or "model"


@dataclass
class ModelRead:
    """The first part of a load (read_model): the checkpoint (and draft) read and checked, not yet run.
    `finish_model` turns it into the LoadedModel. The server reads before its event loop starts: the read
    holds the load's GIL-bound native calls (the tokenizer's build)."""
    path: str
    options: LoadOptions
    checkpoint: Checkpoint
    draft: Checkpoint | None
    phases: Phases

    @property
    def generates(self) -> bool:
        """A text generation model (not an embedding model or a reranker: model_task would say None)."""
        return self.options.task is None and not (self.checkpoint.task_hint or {}).get("kind")


def load_model(path: str, options: LoadOptions | None = None, **overrides) -> LoadedModel:
    """A model path -> LoadedModel. `overrides` are LoadOptions fields (load_model(p, context_length=256))."""
    return finish_model(read_model(path, options, **overrides))


def finish_model(read: ModelRead) -> LoadedModel:
    return finish(read.path, read.checkpoint, read.options, read.phases, read.draft)


def read_model(path: str, options: LoadOptions | None = None, **overrides) -> ModelRead:
    """The checkpoint at `path` (and options.draft_model's) read and checked: load_model up to `finish`."""
    options = replace(options or LoadOptions(), **overrides)
    if options.kv_type not in KV_TYPES:
        raise ModelLoadError(f"KV cache type {options.kv_type!r} is not supported (supported: {', '.join(KV_TYPES)})")
    path = os.path.abspath(path)
    phases = Phases()
    from appliance.native import kernels  # noqa: F401  (loads the C library, starts its thread pool)
    phases.mark("native library")
    if options.threads:
        set_native_threads(options.threads)
    ckpt = read_checkpoint(path, options, phases)
    from ..chat_template import UnsafeTemplateError
    try:
        ckpt.chat_template.vet()
    except UnsafeTemplateError as e:
        raise UnsafeTemplate(f"cannot load {path}: {e}") from None
    phases.mark("chat template check")
    draft = read_draft(options.draft_model, ckpt, options, phases) if options.draft_model else None
    return ModelRead(path, options, ckpt, draft, phases)


def read_checkpoint(path: str, options: LoadOptions, phases: Phases, what: str = "model path") -> Checkpoint:
    """The format loader's Checkpoint of an absolute path (a .gguf file or a Hugging Face directory)."""
    if not os.path.exists(path):
        raise ModelLoadError(f"{what} does not exist: {path}")
    if not os.access(path, os.R_OK):
        raise ModelLoadError(f"{what} is not readable: {path}")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelLoadError(f"not a model directory or .gguf file: {path}")
        from .gguf import read_gguf as read
    else:
        if options.mmproj:
            raise ModelLoadError("--mmproj goes with a .gguf text model; a Hugging Face directory holds its own "
                                 "vision tower")
        from .hf import read_hf_dir as read
    phases.mark("imports (model code)")
    return read(path, options, phases)


def read_draft(path: str, target: Checkpoint, options: LoadOptions, phases: Phases) -> Checkpoint:
    """The --draft-model checkpoint, checked against the model: the same tokenizer."""
    from ..draft_model import vocabulary_mismatch
    path = os.path.abspath(path)
    if target.task_hint is not None or options.task is not None:
        raise ModelLoadError("--draft-model goes with a text generation model, not an embedding model or reranker")
    draft = read_checkpoint(path, replace(options, mmproj=None, max_resident_mib=None, image_max_pixels=None),
                            phases, "--draft-model path")
    problem = vocabulary_mismatch(target.tokenizer, draft.tokenizer)
    if problem is not None:
        raise MismatchedDraft(f"--draft-model {path}: not the model's tokenizer ({problem})")
    phases.mark("draft model")
    return draft


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


def decoder_of(model: DecoderModel) -> Qwen3Model:
    """The Qwen3Model that runs the text layers (the model itself, or a Qwen3-VL / Qwen3.5-VL model's text
    decoder)."""
    from ..qwen3_5_vl import Qwen35VLModel
    from ..qwen3_vl import Qwen3VLModel
    return model.text if isinstance(model, (Qwen3VLModel, Qwen35VLModel)) else model


def finish(path: str, ckpt: Checkpoint, options: LoadOptions, phases: Phases | None = None,
           draft: Checkpoint | None = None) -> LoadedModel:
    """The shared tail: page-release policies, the layer runner, context length, the Engine (with its draft
    model, when given); marks its parts in `phases` (the load's record, which the LoadedModel keeps)."""
    phases = phases if phases is not None else Phases()
    from ..generate import Engine
    from ..layer_runner import choose_runner
    from ..qwen3_moe import set_release_pages

    if options.moe_release_pages:
        set_release_pages(ckpt.model, True)
    recurrent = getattr(ckpt.model, "recurrent", False)  # Qwen3.5: recurrent states beside a KV cache
    if options.max_resident_mib and recurrent:
        raise ModelLoadError("--max-resident is not supported for this model (hybrid linear-attention layers)")
    if options.max_resident_mib:
        from ..resident import ResidentBudgetError, set_max_resident
        try:
            plan = set_max_resident(ckpt.model, options.max_resident_mib << 20)
        except ResidentBudgetError as e:
            raise ModelLoadError(f"--max-resident {options.max_resident_mib}: {e}") from None
        log.info("low-memory mode: %s", plan.describe(len(decoder_of(ckpt.model).layers)))
    choose_runner(decoder_of(ckpt.model))  # native or numpy layers: once, after the weights took their form
    if draft is not None:
        choose_runner(decoder_of(draft.model))
    phases.mark("layers")
    import numpy as np

    from ..kv_cache import KV_TYPES as KV_DTYPES

    cfg = ckpt.config
    task = model_task(ckpt, options)
    if task is not None and not options.kv_type_given:  # one short sequence per input: exact keys cost little
        options = replace(options, kv_type="f32")
    dtype = np.dtype(KV_DTYPES[options.kv_type])
    per_token = 2 * getattr(cfg, "kv_layers", cfg.num_hidden_layers) * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
    if draft is not None:
        dc = decoder_of(draft.model).config
        per_token += 2 * dc.num_hidden_layers * dc.num_key_value_heads * dc.head_dim * dtype.itemsize
    trained = getattr(cfg, "max_position_embeddings", None) or DEFAULT_CONTEXT
    avail = available_memory()
    fits = max(256, avail // 2 // per_token)
    ctx = min(options.context_length, trained) if options.context_length else min(trained, fits)
    cache_bytes = options.cache_ram_mb * 2**20 if options.cache_ram_mb is not None else avail // 4
    log.info("context %d tokens (%s; trained %d), KV cache %s: %d bytes/token, %.0f MB at full context; "
             "prefix cache %s, budget %.0f MB", ctx, "--ctx" if options.context_length else "default: trained, "
             "capped by memory", trained, options.kv_type, per_token, ctx * per_token / 2**20,
             "on" if options.prefix_reuse else "off", cache_bytes / 2**20)
    draft_model = None
    if draft is not None and options.draft_model:
        from ..draft_model import DraftModel
        draft_model = DraftModel(decoder_of(draft.model), ctx, dtype, options.prefill_chunk,
                                 vocab_limit=decoder_of(ckpt.model).config.vocab_size,
                                 name=model_name(options.draft_model), reuse_prefix=options.prefix_reuse)
        log.info("speculative decoding: drafts from %s (up to %d tokens a step; %s)", draft_model.name,
                 options.spec.draft_max, "off: --spec none" if not options.spec.enabled else "instead of the prompt's")
    decoder = decoder_of(ckpt.model)  # a Qwen3.5-VL model's head is its text decoder's
    head = getattr(decoder, "mtp", None)  # Qwen3.5's multi-token-prediction head (qwen3_5_mtp.py)
    if options.spec.mode == "mtp" and head is None:
        raise ModelLoadError("--spec mtp: this model has no multi-token-prediction head (mtp.* tensors)")
    use_mtp = head is not None and draft_model is None and options.spec.mode in ("auto", "mtp")
    if use_mtp:
        cast(Any, decoder).mtp_on = True  # its caches keep the head's keys; each forward feeds it
        log.info("speculative decoding: drafts from the model's MTP head (up to %d tokens a step)",
                 options.spec.draft_max)
    # cast: Qwen3VLModel.forward takes the MRopeCache its own new_cache makes (the Engine only passes that one)
    engine = Engine(cast("CausalLM", ckpt.model), ckpt.tokenizer, ckpt.eos_ids, ctx, options.prefill_chunk, kv_dtype=dtype,
                    cache_bytes=cache_bytes, reuse_prefix=options.prefix_reuse, spec=options.spec,
                    draft_model=draft_model)
    if use_mtp:
        from ..qwen3_5_mtp import mtp_drafter
        engine.drafter = mtp_drafter(decoder, engine.cache)
    phases.mark("engine (KV and prefix caches)")
    if options.prompt_cache_dir and options.prefix_reuse:
        from ..prompt_disk import PromptDiskCache, model_identity
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        states: tuple[tuple[int, ...], ...] = ()
        if recurrent:  # the full-attention layers' KV (and the MTP head's), then each linear layer's states
            hybrid: Any = engine.cache
            n_kv, _, hd = hybrid.kv.k[0].shape  # (n_kv, max_len, hd)
            shape = (len(hybrid.kv.k), n_kv, hd)
            states = tuple(a.shape for st in hybrid.state.values() for a in (st.conv, st.ssm))
        try:
            engine.disk = PromptDiskCache(options.prompt_cache_dir, model_identity(path, shape, dtype, states), shape,
                                          dtype, states=states)
            engine.adopt(engine.disk.load_all())
        except OSError as e:
            raise ModelLoadError(f"--prompt-cache-dir {options.prompt_cache_dir}: {e.strerror or e}") from None
    if options.prompt_cache_dir:
        phases.mark("prompt cache")
    if task is not None:
        log.info("serving %s (%s): /v1/embeddings, /api/embed%s", task.description, task.source,
                 ", /v1/rerank" if task.kind == "rerank" else "")
    return LoadedModel(name=model_name(path), path=path, config=ckpt.config, model=ckpt.model,
                       tokenizer=ckpt.tokenizer, chat_template=ckpt.chat_template, engine=engine, options=options,
                       default_sampling=ckpt.default_sampling, context_length=ctx, eos_ids=ckpt.eos_ids,
                       multimodal=getattr(ckpt.model, "multimodal", False), images_hint=ckpt.images_hint,
                       phases=phases, task=task)


def model_task(ckpt: Checkpoint, options: LoadOptions) -> ModelTask | None:
    """The ModelTask of an embedding model or a reranker (None: a generative model): the CLI's --embedding /
    --reranking / --pooling over what the checkpoint says (ckpt.task_hint); the tokenizer's post-processor
    affixes and the reranker's "yes"/"no" ids are read here."""
    from ..embedding import POOLINGS, ModelTask
    hint = dict(ckpt.task_hint or {})
    kind = options.task or hint.get("kind")
    if kind is None:
        if options.pooling:
            raise ModelLoadError("--pooling applies to an embedding model (add --embedding)")
        return None
    if getattr(ckpt.model, "multimodal", False) or getattr(ckpt.model, "moe_config", None) is not None:
        raise ModelLoadError(f"--{'reranking' if kind == 'rerank' else 'embedding'} serves dense text decoders only")
    source = hint.get("source", "") if hint.get("kind") == kind else f"--{'reranking' if kind == 'rerank' else 'embedding'}"
    tok: Any = ckpt.tokenizer
    if kind == "rerank":
        yes, no = tok.id_of("yes"), tok.id_of("no")
        if yes is None or no is None:
            raise ModelLoadError("a reranker's vocabulary needs the tokens 'yes' and 'no'")
        return ModelTask("rerank", "last", False, yes_no=(yes, no), head=hint.get("head"), source=source)
    pooling = options.pooling or hint.get("pooling") or "last"
    if pooling not in POOLINGS:
        raise ModelLoadError(f"pooling {pooling!r} is not supported (supported: {', '.join(POOLINGS)})")
    affixes = hint.get("affixes") or post_processor_affixes(tok)
    return ModelTask("embedding", pooling, bool(hint.get("normalize", True)), affixes=affixes,
                     source=source + (" (--pooling)" if options.pooling else ""))


def post_processor_affixes(tok) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids the tokenizer's post-processor puts before and after a text (BOS, Qwen3-Embedding's trailing
    <|endoftext|>), found by encoding one text with and without it."""
    plain = tok.encode("a")
    full = tok.encode("a", add_special_tokens=True)
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return tuple(full[:i]), tuple(full[i + len(plain):])
    return (), ()
