"""/metrics text: exact bytes, and parsed back by prometheus_client's own parser (the reference)."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from appliance.protocol.prometheus import CONTENT_TYPE, render_metrics


def test_exact_bytes():
    out = render_metrics({
        "kestrel_requests_total": {(("endpoint", "/v1/chat/completions"), ("status", "200")): 3},
        "kestrel_queue_depth": 0,
        "kestrel_decode_seconds_total": 1.25,
    })
    assert out == (
        b"# HELP kestrel_requests_total HTTP requests handled, by endpoint and status code.\n"
        b"# TYPE kestrel_requests_total counter\n"
        b'kestrel_requests_total{endpoint="/v1/chat/completions",status="200"} 3\n'
        b"# HELP kestrel_queue_depth Requests waiting for the engine.\n"
        b"# TYPE kestrel_queue_depth gauge\n"
        b"kestrel_queue_depth 0\n"
        b"# HELP kestrel_decode_seconds_total Time spent in decode steps.\n"
        b"# TYPE kestrel_decode_seconds_total counter\n"
        b"kestrel_decode_seconds_total 1.25\n")
    assert CONTENT_TYPE == b"text/plain; version=0.0.4; charset=utf-8"
    assert render_metrics({}) == b""


def test_reference_parser_reads_everything_back():
    counters = {
        "kestrel_requests_total": {(("endpoint", "/v1/models"), ("status", "200")): 7,
                                   (("endpoint", "/x\"y\\z\nw"), ("status", "404")): 1},
        "kestrel_generations_total": {(("reason", "stop"),): 2, (("reason", "length"),): 1},
        "kestrel_prompt_tokens_total": 1234,
        "kestrel_generated_tokens_total": 99,
        "kestrel_prefill_seconds_total": 0.5,
        "kestrel_busy": True,
        "kestrel_queue_depth": 2,
        "kestrel_custom_thing": float("inf"),
    }
    fams = {f.name: f for f in text_string_to_metric_families(render_metrics(counters).decode())}
    # the parser strips the _total suffix from counter family names
    req = fams["kestrel_requests"]
    assert req.type == "counter"
    got = {(s.labels["endpoint"], s.labels["status"]): s.value for s in req.samples}
    assert got == {("/v1/models", "200"): 7.0, ("/x\"y\\z\nw", "404"): 1.0}
    gens = {s.labels["reason"]: s.value for s in fams["kestrel_generations"].samples}
    assert gens == {"stop": 2.0, "length": 1.0}
    assert fams["kestrel_prompt_tokens"].samples[0].value == 1234
    assert fams["kestrel_prefill_seconds"].samples[0].value == 0.5
    assert fams["kestrel_busy"].type == "gauge" and fams["kestrel_busy"].samples[0].value == 1
    assert fams["kestrel_queue_depth"].samples[0].value == 2
    assert fams["kestrel_custom_thing"].type == "unknown"
    assert fams["kestrel_custom_thing"].samples[0].value == float("inf")
    assert fams["kestrel_queue_depth"].documentation == "Requests waiting for the engine."
