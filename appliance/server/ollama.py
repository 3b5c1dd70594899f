"""The Ollama API on the appliance's port: /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version,
and the root probe. Request parsing and response shapes live in protocol/ollama_*.py; generation goes through the
same Generation path (admission, queue, keep-alives, cancel on disconnect) as the OpenAI routes.

Policies:
- Errors come in Ollama's shape `{"error": "..."}` with the same status codes as the OpenAI routes (app.py's
  dispatcher renders every ApiError under /api/ that way), including 429 when the queue is full.
- The `model` field is not matched against the served model (one model, named in every answer, as on the
  OpenAI routes): chat, generate and /api/show accept any name, so a client that checks the name it chats with
  by showing it (`model="any"`) works. /api/tags lists the served name only; a client that looks its name up
  there (LangChain's `validate_model_on_init=True`) needs that name.
- capabilities: completion, tools (every model: a template without a tool section gets the generic tool format,
  protocol/generic_tools.py), vision (Qwen3-VL), thinking (a template that reads enable_thinking or has <think>).
- Model management makes no sense on a fixed-model appliance: pull, push, create, delete, copy and blobs answer
  400 naming the served model. /api/embed and /api/embeddings are embeddings.py's.
- `GET /` and `HEAD /` answer "Ollama is running" (text/plain), the probe Ollama clients send; a browser asking
  for text/html gets the `html_root` handler instead when app.py passes one (the chat page).
- /api/version reports OLLAMA_COMPAT_VERSION: the Ollama release whose API this one follows (thinking, tool
  streaming), so clients that gate features on the version enable them.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

import trio

from ..h11_server import Exchange
from ..protocol import Assembler
from ..protocol.errors import ApiError
from ..protocol.fields import load_json_object
from ..protocol.ollama_requests import OllamaRequest, parse_ollama_chat, parse_ollama_generate
from ..protocol.ollama_stream import OllamaChatAssembler, OllamaGenerateAssembler, load_response, rfc3339
from ..protocol.reasoning import prompt_ends_in_reasoning
from ..web import wants_html
from .config import Handler, Routes
from .generation import run_ticket
from .preparer import Preparer

if TYPE_CHECKING:
    from ..engine.config import Qwen3Config
    from ..engine.load import LoadedModel

OLLAMA_COMPAT_VERSION = "0.12.0"
ROOT_TEXT = b"Ollama is running"
REFUSED = ("/api/pull", "/api/push", "/api/create", "/api/delete", "/api/copy")  # /api/embed*: embeddings.py
NEVER_EXPIRES = "2318-01-01T00:00:00Z"     # keep_alive < 0 in Ollama's /api/ps: the model is never unloaded


def is_ollama_path(path: str) -> bool:
    return path == "/api" or path.startswith("/api/")


def model_facts(loaded: LoadedModel, name: str) -> dict[str, Any]:
    """What /api/tags, /api/show and /api/ps say about the served model (reads file sizes: run off the loop)."""
    path = loaded.path
    files = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in sorted(os.listdir(path))]
    size = sum(os.path.getsize(f) for f in files if os.path.isfile(f) and f.endswith((".gguf", ".safetensors")))
    mtime = max((os.path.getmtime(f) for f in files if os.path.isfile(f)), default=time.time())
    cfg = loaded.config
    family = getattr(cfg, "model_type", "") or "unknown"
    fmt = "gguf" if path.endswith(".gguf") else "safetensors"
    quant = _quantization(path, fmt)
    params = parameter_count(cfg)
    template = loaded.chat_template.source_for(None)
    caps = ["completion"]
    if loaded.multimodal:
        caps.append("vision")
    caps.append("tools")
    if "<think>" in template or "enable_thinking" in template:
        caps.append("thinking")
    if getattr(loaded, "kind", "generate") != "generate":  # an embedding model (or a reranker) does not chat
        caps = ["embedding"]
    details = {"parent_model": "", "format": fmt, "family": family, "families": [family],
               "parameter_size": _human(params), "quantization_level": quant}
    digest = hashlib.sha256(f"{os.path.abspath(path)}\0{size}\0{mtime}".encode()).hexdigest()
    return {"name": name, "size": size, "modified_at": rfc3339(mtime), "digest": digest, "details": details,
            "capabilities": caps, "template": template, "parameter_count": params, "family": family}


def parameter_count(cfg: Qwen3Config) -> int:
    """Weights in the decoder from its config (embeddings, attention, MLP or experts, LM head when untied)."""
    g = lambda k, d=0: getattr(cfg, k, d) or d
    h, layers, hd = g("hidden_size"), g("num_hidden_layers"), g("head_dim")
    attn = h * hd * (2 * g("num_attention_heads") + 2 * g("num_key_value_heads"))
    experts = g("num_experts")
    mlp = 3 * h * experts * g("moe_intermediate_size") + h * experts if experts else 3 * h * g("intermediate_size")
    emb = g("vocab_size") * h * (1 if g("tie_word_embeddings", False) else 2)
    return emb + layers * (attn + mlp)


def _human(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def _quantization(path: str, fmt: str) -> str:
    if fmt == "gguf":
        m = re.search(r"(?i)(IQ\d_\w+|Q\d_K(_[SML])?|Q\d_\d|BF16|F16|F32)", os.path.basename(path))
        return m.group(1).upper() if m else "unknown"
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return "unknown"
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or cfg.get("text_config", {}).get("dtype", ""))
    return {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(dtype, dtype.upper() or "unknown")


class OllamaApi:
    def __init__(self, prep: Preparer, html_root: Handler | None = None):
        self.prep = prep
        self.html_root = html_root
        self._facts: dict[str, Any] | None = None

    def routes(self) -> Routes:
        return {
            "/": {"GET": self.root, "HEAD": self.root},
            "/api/chat": {"POST": self.chat},
            "/api/generate": {"POST": self.generate},
            "/api/tags": {"GET": self.tags},
            "/api/show": {"POST": self.show},
            "/api/ps": {"GET": self.ps},
            "/api/version": {"GET": self.version},
            **{p: {"POST": self.refused, "DELETE": self.refused} for p in REFUSED},
        }

    @property
    def name(self) -> str:
        return self.prep.model_name

    async def facts(self) -> dict[str, Any]:
        if self._facts is None:
            loaded = self.prep.loaded()
            self._facts = await trio.to_thread.run_sync(model_facts, loaded, self.name)
        return self._facts

    # ---- probes and model listing ----------------------------------------------------------------------
    async def root(self, ex: Exchange) -> None:
        if self.html_root is not None and wants_html(ex.header("accept")):
            return await self.html_root(ex)
        # HEAD: Exchange.respond sends the GET's headers (Content-Length included) and no body
        await ex.respond(200, [(b"Content-Type", b"text/plain; charset=utf-8")], ROOT_TEXT)

    async def version(self, ex: Exchange) -> None:
        await self.prep.send_json(ex, {"version": OLLAMA_COMPAT_VERSION})

    def _entry(self, f: dict[str, Any]) -> dict[str, Any]:
        return {"name": self.name, "model": self.name, "modified_at": f["modified_at"], "size": f["size"],
                "digest": f["digest"], "details": f["details"]}

    async def tags(self, ex: Exchange) -> None:
        models = [self._entry(await self.facts())] if self.prep.worker.state == "ready" else []
        await self.prep.send_json(ex, {"models": models})

    async def ps(self, ex: Exchange) -> None:
        models = []
        loaded = self.prep.worker.loaded
        if self.prep.worker.state == "ready" and loaded is not None:  # ready: loaded
            f = await self.facts()
            models.append({**self._entry(f), "expires_at": NEVER_EXPIRES, "size_vram": 0,
                           "context_length": loaded.context_length})
        await self.prep.send_json(ex, {"models": models})

    async def show(self, ex: Exchange) -> None:
        loaded = self.prep.loaded()
        data = load_json_object(await ex.read_body())
        wanted = data.get("model", data.get("name"))
        if not isinstance(wanted, str) or not wanted:
            raise ApiError(400, "model is required", param="model")
        f = await self.facts()
        cfg = loaded.config
        arch = f["family"]
        info = {"general.architecture": arch, "general.parameter_count": f["parameter_count"],
                f"{arch}.context_length": loaded.context_length,
                f"{arch}.embedding_length": getattr(cfg, "hidden_size", 0),
                f"{arch}.block_count": getattr(cfg, "num_hidden_layers", 0),
                f"{arch}.attention.head_count": getattr(cfg, "num_attention_heads", 0),
                f"{arch}.attention.head_count_kv": getattr(cfg, "num_key_value_heads", 0)}
        params = "\n".join(f"{k:<16}{v}" for k, v in sorted(loaded.default_sampling.items())
                           if isinstance(v, (int, float)) and not isinstance(v, bool))
        modelfile = (f"# Served by kestrel-appliance (a fixed model; Modelfiles are not used)\n"
                     f"FROM {loaded.path}\n")
        await self.prep.send_json(ex, {"license": "", "modelfile": modelfile, "parameters": params,
                                      "template": f["template"], "details": f["details"], "model_info": info,
                                      "capabilities": f["capabilities"], "modified_at": f["modified_at"]})

    async def refused(self, ex: Exchange) -> None:
        what = ex.path.rstrip("/").rsplit("/", 1)[-1]
        raise ApiError(400, f"{ex.path} is not supported: this appliance serves one fixed model "
                            f"('{self.name}'), so models cannot be {_VERBS.get(what, 'managed')} here.",
                       code="unsupported_endpoint")

    # ---- generation ------------------------------------------------------------------------------------
    async def _parse(self, ex: Exchange, parse: Callable[..., OllamaRequest]):
        """(loaded, body, request), or None when it was a load / unload request (answered here)."""
        loaded = self.prep.loaded()
        body = await ex.read_body()
        o = await self.prep.prepare(lambda: parse(body, defaults=loaded.default_sampling,
                                                 context_length=loaded.context_length,
                                                 images_supported=loaded.multimodal,
                                                 images_hint=loaded.images_hint))
        if o.load_only:
            await self.prep.send_json(ex, load_response(self.name, chat=parse is parse_ollama_chat, unload=o.unload,
                                                       now=rfc3339()))
            return None
        return loaded, body, o

    def _prompt(self, loaded: LoadedModel, o: OllamaRequest, body_size: int):
        """Worker thread: (prompt text, prompt ids, the request fitted to the context, its `format` constraint)."""
        o = replace(o, request=self.prep.fit_tools(loaded, o.request))
        if o.raw:
            prompt = o.prompt
            ids = self.prep.encode(loaded, prompt, o.request.max_tokens, body_size)
        else:
            prompt, ids = self.prep.render_prompt(loaded, o.request, body_size, check=False)
        ids = self.prep.check_token_ids(loaded, o.context, "context") + ids
        return prompt, ids, self._fit(loaded, o, len(ids)), self.prep.compile_constraint(loaded, o.request, prompt,
                                                                                       "format")

    async def chat(self, ex: Exchange) -> None:
        await self._run(ex, parse_ollama_chat)

    async def generate(self, ex: Exchange) -> None:
        await self._run(ex, parse_ollama_generate)

    async def _run(self, ex: Exchange, parse: Callable[..., OllamaRequest]) -> None:
        parsed = await self._parse(ex, parse)
        if parsed is None:
            return
        loaded, body, o = parsed
        prompt, ids, req, constraint = await self.prep.prepare(lambda: self._prompt(loaded, o, len(body)))
        in_reasoning = prompt_ends_in_reasoning(prompt)
        out: Assembler
        if parse is parse_ollama_chat:
            out = OllamaChatAssembler(self.name, in_reasoning=in_reasoning, tools=req.tools or False,
                                      tool_format=req.tool_format)
        else:
            out = OllamaGenerateAssembler(self.name, ids, in_reasoning=in_reasoning)
        await run_ticket(self.prep, ex, loaded, req, ids, out, body_size=len(body), constraint=constraint,
                         messages=req.messages)

    def _fit(self, loaded: LoadedModel, o: OllamaRequest, n_prompt: int):
        """The request checked against the context (num_ctx, when smaller, is this request's context)."""
        req = o.request
        if o.num_ctx is not None and o.num_ctx < loaded.context_length:
            if n_prompt >= o.num_ctx:
                raise ApiError(400, f"The prompt is {n_prompt} tokens; options.num_ctx is {o.num_ctx}.",
                               param="options.num_ctx", code="context_length_exceeded")
            room = o.num_ctx - n_prompt
            req = replace(req, max_tokens=min(req.max_tokens or room, room))
        if req.max_tokens is not None and n_prompt + req.max_tokens > loaded.context_length:
            req = replace(req, max_tokens=max(loaded.context_length - n_prompt, 1))  # Ollama stops at the context
        self.prep.check_context(loaded, n_prompt, req.max_tokens)
        return req


_VERBS = {"pull": "pulled", "push": "pushed", "create": "created", "delete": "deleted", "copy": "copied",
          "embed": "used for embeddings", "embeddings": "used for embeddings"}

