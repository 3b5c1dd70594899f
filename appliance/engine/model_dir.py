"""Load a model from a local path into a ready Engine: a Hugging Face directory (config.json, safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json / chat_template.jinja).

Policy: models load from local paths only. Every problem with the path or the checkpoint is a ModelLoadError
with a one-line message (the CLI prints it and exits non-zero). Architectures register a builder in
ARCHITECTURES keyed by config.json's `model_type`; checkpoint naming quirks stay in those builders.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable

from .hf_checkpoint import build_qwen3
from .qwen3_moe import build_qwen3_moe
from .qwen3_vl import build_qwen3_vl
from .config import UnsupportedModelError
from .generate import Engine
from .safetensors import SafeTensors, SafetensorsError

DEFAULT_CONTEXT = 4096


class ModelLoadError(Exception):
    """The model path cannot be served; the message is one line for the user."""


@dataclass
class LoadedModel:
    name: str
    path: str
    config: object
    model: object
    tokenizer: object
    chat_template: object
    engine: Engine
    default_sampling: dict = field(default_factory=dict)
    context_length: int = DEFAULT_CONTEXT
    eos_ids: set[int] = field(default_factory=set)
    multimodal: bool = False  # accepts image content parts


# model_type -> builder(SafeTensors, config dict) -> (config, model)
ARCHITECTURES: dict[str, Callable] = {"qwen3": build_qwen3, "qwen2": build_qwen3, "llama": build_qwen3,
                                      "qwen3_moe": build_qwen3_moe, "qwen3_vl": build_qwen3_vl}


def read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None


def eos_ids_of(gen_cfg: dict, cfg: dict, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (gen_cfg.get("eos_token_id"), cfg.get("eos_token_id")):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list):
            ids.update(int(x) for x in src)
    if tokenizer.eos_token is not None and tokenizer.id_of(tokenizer.eos_token) is not None:
        ids.add(tokenizer.id_of(tokenizer.eos_token))
    return ids


def load_model(path: str, context_length: int | None = None, prefill_chunk: int = 256) -> LoadedModel:
    from .chat_template import ChatTemplate
    from .tokenizer import Tokenizer

    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"model path does not exist: {path}")
    if not os.access(path, os.R_OK):
        raise ModelLoadError(f"model path is not readable: {path}")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            from .gguf_model import load_gguf  # issue 4

            return load_gguf(path, context_length=context_length, prefill_chunk=prefill_chunk)
        raise ModelLoadError(f"not a model directory or .gguf file: {path}")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ModelLoadError(f"no config.json in {path}")
    cfg_dict = read_json(cfg_path)
    model_type = cfg_dict.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ModelLoadError(f"unsupported model type {model_type!r} (supported: {', '.join(sorted(ARCHITECTURES))})")
    try:
        st = SafeTensors(path)
        cfg, model = ARCHITECTURES[model_type](st, cfg_dict)
        tokenizer = Tokenizer.from_dir(path)
        template = ChatTemplate.from_dir(path)
    except (SafetensorsError, UnsupportedModelError, KeyError, ValueError, OSError) as e:
        raise ModelLoadError(f"cannot load {path}: {e}") from None
    gen_cfg = read_json(os.path.join(path, "generation_config.json"))
    limit = getattr(cfg, "max_position_embeddings", DEFAULT_CONTEXT)
    ctx = min(context_length or DEFAULT_CONTEXT, limit)
    eos = eos_ids_of(gen_cfg, cfg_dict, tokenizer)
    engine = Engine(model, tokenizer, eos, ctx, prefill_chunk)
    return LoadedModel(name=os.path.basename(path.rstrip("/")), path=path, config=cfg, model=model,
                       tokenizer=tokenizer, chat_template=template, engine=engine, default_sampling=gen_cfg,
                       context_length=ctx, eos_ids=eos, multimodal=getattr(model, "multimodal", False))
