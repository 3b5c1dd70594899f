"""Disconnects and the queue, end to end: real sockets, the real engine on a tiny real checkpoint.

Assertions are on engine-side counters (the worker's JobTrace, the engine's own chunk/step counters), not on
wall time: "stopped within one chunk/step" means no prefill chunk and at most one decode step started after
the cancel flag was set, and the engine polled the flag exactly once more (and stopped there). The disconnect
during prefill and mid-decode run on the hybrid Qwen3.5 (Gated DeltaNet: recurrent state, chunk snapshots) too.
"""
from __future__ import annotations

import json
import math

import pytest

from tests.support.live_server import LiveServer, RawClient, chat_body, request_bytes

PREFILL_CHUNK = 16


@pytest.fixture(scope="module")
def server(tiny_qwen3_tied):
    with LiveServer(tiny_qwen3_tied, queue=2, prefill_chunk=PREFILL_CHUNK, queue_keepalive_s=0.01) as s:
        yield s


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def any_server(request):
    """The Qwen3 server above, or one serving the tiny hybrid Qwen3.5 with the same settings."""
    if request.param == "qwen3":
        yield request.getfixturevalue("server")
        return
    with LiveServer(request.getfixturevalue("tiny_qwen3_5"), queue=2, prefill_chunk=PREFILL_CHUNK,
                    queue_keepalive_s=0.01) as s:
        yield s


def long_prompt(n_words: int = 1200) -> str:
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "seven", "blue", "quick", "fox"]
    return " ".join(words[(i * 7) % len(words)] + str(i % 13) for i in range(n_words))


def open_stream(server, body) -> tuple[RawClient, object]:
    c = RawClient(server.port)
    c.send(request_bytes("POST", "/v1/chat/completions", body))
    r = c.read_head()
    assert r.status == 200
    return c, r


def finished_trace(server, n_before: int, index: int = 0):
    server.wait_for(lambda: len(server.traces()) > n_before + index, what="the engine to finish the job")
    return server.traces()[n_before + index]


def assert_served(client, r) -> list[dict]:
    client.read_events(r)
    client.close()
    assert r.data_events()[-1] == b"data: [DONE]\n\n"
    return r.json_events()


def test_disconnect_during_prefill_stops_between_chunks(any_server):
    server = any_server
    engine = server.worker.loaded.engine
    n_before = len(server.traces())
    chunks_before = engine.prefill_chunks_run
    a, ra = open_stream(server, chat_body(long_prompt(), stream=True, max_tokens=50))
    a.read_events(ra, stop_after=1)  # the role frame
    b, rb = open_stream(server, chat_body("Next one", stream=True, max_tokens=4, ignore_eos=True))
    server.wait_for(lambda: server.worker.current is not None and server.worker.current.polls >= 3,
                    what="prefill to be under way")
    a.close()  # the client goes away in the middle of prefill

    t = finished_trace(server, n_before)
    n_chunks = math.ceil(t.prompt_tokens / PREFILL_CHUNK)
    assert t.finish_reason == "cancelled" and t.cancel_requested
    assert t.tokens == 0                                  # it never reached decode
    assert 3 <= t.prefill_chunks < n_chunks               # stopped part-way through the prompt
    assert t.prefill_chunks <= t.polls_at_cancel          # no chunk started after the flag was set
    assert t.polls_after_cancel == 1                      # the very next poll saw it, and generation ended
    assert engine.prefill_chunks_run - chunks_before >= t.prefill_chunks

    events = assert_served(b, rb)                         # the next request is served
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    t_b = finished_trace(server, n_before, 1)
    assert t_b.finish_reason == "length" and t_b.started >= t.finished


def test_disconnect_mid_decode_stops_within_one_step(any_server):
    server = any_server
    engine = server.worker.loaded.engine
    n_before = len(server.traces())
    steps_before = engine.decode_steps_run
    a, ra = open_stream(server, chat_body("Tell me a long story.", stream=True, max_tokens=2000, ignore_eos=True))
    a.read_events(ra, stop_after=6)  # role frame + 5 token events
    b, rb = open_stream(server, chat_body("Next one", stream=True, max_tokens=3, ignore_eos=True))
    a.close()

    t = finished_trace(server, n_before)
    assert t.finish_reason == "cancelled"
    assert 5 <= t.tokens < 2000
    assert t.tokens_after_cancel <= 1                     # at most the step that was running
    assert t.polls_after_cancel == 1
    # the engine's own step counter agrees: one forward per token after the first, none after the stop
    assert engine.decode_steps_run - steps_before >= t.tokens - 1

    events = assert_served(b, rb)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert finished_trace(server, n_before, 1).started >= t.finished


def test_disconnect_of_non_stream_request(server):
    n_before = len(server.traces())
    c = RawClient(server.port)
    c.send(request_bytes("POST", "/v1/chat/completions", chat_body("Hello", max_tokens=2000, ignore_eos=True)))
    server.wait_for(lambda: server.worker.current is not None and server.worker.current.tokens >= 3,
                    what="decode to be under way")
    c.close()
    t = finished_trace(server, n_before)
    assert t.finish_reason == "cancelled" and t.tokens < 2000
    assert t.tokens_after_cancel <= 1 and t.polls_after_cancel == 1


def test_queue_order_and_429(server):
    n_before = len(server.traces())
    started_before = server.worker.stats.requests_started
    a, ra = open_stream(server, chat_body("Running", stream=True, max_tokens=2000, ignore_eos=True))
    a.read_events(ra, stop_after=2)
    # B and C wait in line (queue=2), with different prompt lengths to tell their traces apart
    b, rb = open_stream(server, chat_body("Second", stream=True, max_tokens=3, ignore_eos=True))
    server.wait_for(lambda: server.worker.waiting == 1, what="B to queue")
    c = RawClient(server.port)
    c.send(request_bytes("POST", "/v1/chat/completions",
                         chat_body("Third request, longer prompt here", max_tokens=3, ignore_eos=True)))
    server.wait_for(lambda: server.worker.waiting == 2, what="C to queue")

    d = RawClient(server.port)
    d.send(request_bytes("POST", "/v1/chat/completions", chat_body("Fourth", stream=True, max_tokens=3)))
    rd = d.read_head()
    body = json.loads(d.read_body(rd))
    d.close()
    assert rd.status == 429
    assert int(rd.header("Retry-After")) >= 1
    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "queue_full"
    assert server.worker.stats.requests_started == started_before + 1  # only A has run so far

    a.close()
    assert_served(b, rb)
    rc = c.read_head()
    resp = json.loads(c.read_body(rc))
    c.close()
    assert rc.status == 200 and resp["choices"][0]["finish_reason"] == "length"
    ta, tb, tc = (finished_trace(server, n_before, i) for i in range(3))
    assert ta.finish_reason == "cancelled"
    assert tb.prompt_tokens < tc.prompt_tokens          # B (shorter prompt) ran before C
    assert ta.finished <= tb.started and tb.finished <= tc.started
    assert server.worker.waiting == 0


def test_client_leaving_the_queue_never_runs(server):
    started_before = server.worker.stats.requests_started
    a, ra = open_stream(server, chat_body("Running", stream=True, max_tokens=2000, ignore_eos=True))
    a.read_events(ra, stop_after=2)
    b, rb = open_stream(server, chat_body("Waiting", stream=True, max_tokens=3))
    b.read_events(rb, until=lambda r: any(e == b": queued\n\n" for _, e in r.events))
    assert server.worker.waiting == 1
    b.close()
    server.wait_for(lambda: server.worker.waiting == 0, what="B to leave the line")
    a.close()
    server.wait_for(lambda: not server.worker.busy, what="the engine to go idle")
    assert server.worker.stats.requests_started == started_before + 1


def test_keepalive_comments_during_a_long_prefill(server):
    """A long prefill sends `: prefill` comments (so proxies with read timeouts keep the stream), and they
    stop with the first token event."""
    prompt = long_prompt(1600)
    c, r = open_stream(server, chat_body(prompt, stream=True, max_tokens=5, ignore_eos=True))
    c.read_events(r)
    c.close()
    kinds = [e for _, e in r.events]
    first_token = next(i for i, e in enumerate(kinds) if b'"content":"' in e and b'"role"' not in e)
    assert b": prefill\n\n" in kinds[1:first_token]
    assert all(not e.startswith(b":") for e in kinds[first_token:])
    assert kinds[-1] == b"data: [DONE]\n\n"


def test_metrics_count_cancellations_and_tokens(server):
    n_before = len(server.traces())
    a, ra = open_stream(server, chat_body("Going away", stream=True, max_tokens=2000, ignore_eos=True))
    a.read_events(ra, stop_after=3)
    a.close()
    assert finished_trace(server, n_before).finish_reason == "cancelled"
    c = RawClient(server.port)
    c.send(request_bytes("GET", "/metrics"))
    r = c.read_head()
    text = c.read_body(r).decode()
    c.close()
    s = server.worker.stats
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert int(values["kestrel_cancelled_total"]) == s.requests_cancelled >= 1
    assert int(values["kestrel_generated_tokens_total"]) == s.completion_tokens > 0
    assert int(values['kestrel_generations_total{reason="cancelled"}']) >= 1
    assert values["kestrel_busy"] == "0" and values["kestrel_queue_depth"] == "0"


def test_disconnect_during_accepted_drafts_stops_within_one_token(tiny_qwen3_tied):
    """Speculation with drafts accepted (an oracle drafter: the plain greedy continuation, every fifth token
    wrong): a verified run is emitted token by token with a poll before each, so a client leaving in the middle
    of a run gets at most one more token (the one whose poll came before the flag), and no forward starts after
    the stop. A verify forward is one engine step that yields several tokens, so the step count is exactly the
    tokens that were not accepted drafts, less the last: steps = tokens - 1 - accepted."""
    from appliance.engine.generate import GenerationRequest
    from appliance.engine.load import LoadOptions, load_model
    from appliance.engine.sampling import SamplingParams
    from appliance.engine.speculative import SpecOptions
    from tests.engine.test_speculative import OracleDrafter, ids_of, run
    from tests.support.live_server import serving_model

    prompt, max_tokens = "Tell me a long story.", 600

    def load():
        plain = load_model(tiny_qwen3_tied, LoadOptions(prefill_chunk=PREFILL_CHUNK, spec=SpecOptions("none")))
        ids = ids_of(plain, prompt)  # the server's rendering of one user message
        _, fin = run(plain, GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens=max_tokens,
                                              ignore_eos=True))
        loaded = serving_model(tiny_qwen3_tied, None, PREFILL_CHUNK)
        vocab = loaded.config.vocab_size
        loaded.engine.drafter = lambda: OracleDrafter(len(ids), fin.token_ids, vocab)
        return loaded

    with LiveServer(tiny_qwen3_tied, prefill_chunk=PREFILL_CHUNK, load=load) as server:
        engine, stats = server.worker.loaded.engine, server.worker.stats
        steps_before, accepted_before = engine.decode_steps_run, stats.draft_tokens_accepted
        a, ra = open_stream(server, chat_body(prompt, stream=True, max_tokens=max_tokens, ignore_eos=True,
                                              temperature=0))
        a.read_events(ra, stop_after=6)  # role frame + 5 token events
        a.close()
        t = finished_trace(server, 0)
        accepted = stats.draft_tokens_accepted - accepted_before  # counted when the job ended, before its trace
        assert t.finish_reason == "cancelled" and t.cancel_requested
        assert 5 <= t.tokens < max_tokens
        assert t.tokens_after_cancel <= 1 and t.polls_after_cancel == 1
        assert accepted > 0 and stats.draft_tokens > accepted      # drafts accepted (and some rejected) before it
        assert engine.decode_steps_run - steps_before == t.tokens - 1 - accepted
