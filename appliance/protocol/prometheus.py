"""Prometheus text exposition (format 0.0.4) of the server's counters.

Policy: the caller hands plain values keyed by metric name; HELP and TYPE come from METRICS below, so names and
help texts live in one place. A value is a number, or a mapping of label tuples ((name, value), ...) to numbers
for a labelled family. Names not in METRICS are rendered as `untyped` so nothing is silently dropped.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

# name -> (type, help)
METRICS: dict[str, tuple[str, str]] = {
    "kestrel_requests_total": ("counter", "HTTP requests handled, by endpoint and status code."),
    "kestrel_generations_total": ("counter", "Generations finished, by finish reason."),
    "kestrel_prompt_tokens_total": ("counter", "Prompt tokens of finished generations (reused + prefilled)."),
    "kestrel_prompt_tokens_cached_total": ("counter", "Prompt tokens whose keys/values were reused from the cache."),
    "kestrel_prompt_tokens_prefilled_total": ("counter", "Prompt tokens run through the model (prefill)."),
    "kestrel_generated_tokens_total": ("counter", "Completion tokens generated."),
    "kestrel_prefill_seconds_total": ("counter", "Time spent in prefill."),
    "kestrel_decode_seconds_total": ("counter", "Time spent in decode steps."),
    "kestrel_draft_tokens_total": ("counter", "Tokens drafted for verification (speculative decoding)."),
    "kestrel_draft_tokens_accepted_total": ("counter", "Drafted tokens the model accepted."),
    "kestrel_rejected_total": ("counter", "Requests turned away because the queue was full."),
    "kestrel_cancelled_total": ("counter", "Generations cancelled because the client went away."),
    "kestrel_queue_abandoned_total": ("counter", "Requests that left the queue before their turn (client gone, "
                                                 "shutdown)."),
    "kestrel_images_decoded_total": ("counter", "Request images decoded."),
    "kestrel_event_loop_lag_seconds": ("gauge", "Worst lateness of the event loop's timer wake-ups over the last "
                                                "10-20 s."),
    "kestrel_event_loop_stalls_total": ("counter", "Event loop timer wake-ups later than 100 ms."),
    "kestrel_event_loop_lag_max_seconds": ("gauge", "Worst lateness of the event loop's timer wake-ups since "
                                                    "start."),
    "kestrel_queue_depth": ("gauge", "Requests waiting for the engine."),
    "kestrel_busy": ("gauge", "1 while the engine is generating, else 0."),
    "kestrel_ready": ("gauge", "1 once the model is loaded."),
    "kestrel_context_length": ("gauge", "Context length of the loaded model, in tokens."),
    "kestrel_open_connections": ("gauge", "Client connections open (keep-alive ones included), the one reading "
                                          "this included."),
}


def format_value(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(v)


def _escape_label(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(pairs: Any) -> str:
    items = list(pairs.items()) if isinstance(pairs, Mapping) else list(pairs)
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in items) + "}"


def render_metrics(counters: Mapping[str, Any]) -> bytes:
    lines: list[str] = []
    for name, value in counters.items():
        kind, help_text = METRICS.get(name, ("untyped", ""))
        lines.append(f"# HELP {name} {_escape_help(help_text)}".rstrip())
        lines.append(f"# TYPE {name} {kind}")
        if isinstance(value, Mapping):
            for labels, v in value.items():
                lines.append(f"{name}{_labels(labels)} {format_value(v)}")
        else:
            lines.append(f"{name} {format_value(value)}")
    return ("\n".join(lines) + "\n").encode("utf-8") if lines else b""
