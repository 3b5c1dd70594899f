"""The built-in chat page (GET / for browsers, GET /chat/) and the /props endpoint it reads.

Policies:
- One self-contained page: index.html with the stylesheet and the scripts of this directory inlined at
  first use (no CDN, no build step; the files ship in the package and in the one-file executable). The page
  speaks only our own API (/v1/chat/completions, /v1/models, /health, /props) on the same origin.
- The page itself is open (it is what asks for the API key); every API call it makes carries the key.
- Defence in depth against injected markup: a Content-Security-Policy that allows exactly the inlined
  script and stylesheet (by SHA-256), same-origin fetches, and data:/blob: images; no frames, no forms
  posting elsewhere, no plugins. Model output is escaped by the page's renderer before any markup is added.
- `GET /` serves the page only to clients that ask for text/html (browsers); other clients keep whatever the
  API answers at `/` (see server/ollama.py, OllamaApi.root).
"""
from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from typing import Any

from ..resources import resource_path

SCRIPTS = ("sse.js", "markdown.js", "chat.js")
STYLES = ("chat.css",)


def _read(name: str) -> str:
    with open(resource_path("web", name), encoding="utf-8") as f:
        return f.read()


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


class ChatPage:
    """The assembled page: body bytes and the response headers (with its CSP hashes)."""

    def __init__(self, html: str, css: str, js: str):
        # Inlined text must not close its element early.
        if re.search(r"</script", js, re.I) or re.search(r"</style", css, re.I):
            raise ValueError("inlined script/style contains a closing tag")
        page = html.replace("/*STYLE*/", css, 1).replace("/*SCRIPT*/", js, 1)
        self.body = page.encode("utf-8")
        csp = ("default-src 'none'; "
               f"script-src {_sha256(js)}; style-src {_sha256(css)}; "
               "img-src 'self' data: blob:; connect-src 'self'; manifest-src 'self'; "
               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
        self.headers: list[tuple[bytes, bytes]] = [
            (b"Content-Type", b"text/html; charset=utf-8"),
            (b"Content-Security-Policy", csp.encode("ascii")),
            (b"Cache-Control", b"no-cache"),
            (b"X-Content-Type-Options", b"nosniff"),
            (b"Referrer-Policy", b"no-referrer"),
        ]

    @classmethod
    def from_package(cls) -> "ChatPage":
        css = "\n".join(_read(n) for n in STYLES)
        js = "\n".join(_read(n) for n in SCRIPTS)
        return cls(_read("index.html"), css, js)


@lru_cache(maxsize=1)
def chat_page() -> ChatPage:
    return ChatPage.from_package()


def wants_html(accept: str | None) -> bool:
    """True when the Accept header names text/html (what a browser sends when it navigates)."""
    if not accept:
        return False
    for part in accept.split(","):
        kind, _, params = part.strip().partition(";")
        if kind.strip().lower() in ("text/html", "application/xhtml+xml"):
            q = re.search(r"q\s*=\s*(\d+(?:\.\d*)?)", params)   # always a float (q=. once raised: a 500)
            return not q or float(q.group(1)) > 0
    return False


def props(model_name: str, loaded: Any, build: str) -> dict[str, Any]:
    """GET /props: what the page (and llama.cpp-style tools) need to know about the served model.

    Named like llama.cpp's /props where it has a name (model_alias, modalities, default_generation_settings.n_ctx,
    total_slots, chat_template); `thinking_toggle` says whether the template reads enable_thinking; `image` gives the vision preprocessor's pixel bounds so a client can resize before sending."""
    out: dict[str, Any] = {"model_alias": model_name, "total_slots": 1, "build_info": build,
                           "modalities": {"vision": False, "audio": False}}
    if loaded is None:
        return out
    out["default_generation_settings"] = {"n_ctx": loaded.context_length}
    template = loaded.chat_template.source_for()
    out["chat_template"] = template
    out["thinking_toggle"] = "enable_thinking" in template   # the template reads the enable_thinking switch
    if loaded.multimodal:
        proc = loaded.model.image_processor
        out["modalities"]["vision"] = True
        out["image"] = {"min_pixels": proc.min_pixels, "max_pixels": proc.max_pixels,
                        "pixels_per_token": proc.factor * proc.factor}
    return out
