"""Part of the `system` tier (scripts/test.sh runs it; alone: `pytest tests/system/test_system_soak.py`, ~4 min): the
soak and fuzz scenarios of tests/system/soak.py with small counts against the real server, the mixed load with
images for ~25 s, and SIGTERM under load through the real command line. The long versions (1,000 disconnects,
100,000 generated requests, 30 minutes of mixed load, 300 start/serve/SIGTERM cycles) are the scripts in
tests/system/, with their figures in the closing note.
"""
from __future__ import annotations

import signal
import threading
import time

import pytest

from tests.support.live_server import LiveServer, RawClient, chat_body, request_bytes
from tests.support.tiny_vl import cached_qwen3_vl
from tests.system import mixed_load, soak

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def server(tiny_qwen3_tied):
    with LiveServer(tiny_qwen3_tied, queue=2, prefill_chunk=16) as s:
        yield s


def test_random_disconnects_leave_rss_fds_threads_flat(server):
    r = soak.disconnect_soak(server.port, 150)
    start, end = r["start"], r["end"]
    assert end["rss_mb"] - start["rss_mb"] < 32, r
    assert end["fds"] <= start["fds"] + 2, r
    assert end["threads"] <= start["threads"] + 2, r
    assert r["settled"]["settled"], r  # every connection ended on the server's side too
    assert r["worst_next_request_s"] < 5, r
    assert len(r["by_kind"]) == 6, r  # queued/prefill/decode x FIN/RST all happened


def test_generated_requests_get_no_5xx_and_never_hang(server):
    r = soak.fuzz(server.port, 1500)
    assert r["n_failures"] == 0, r["failures"]
    assert r["requests"] == 1500
    assert soak.served_at_once(server.port) < 5


def test_mixed_load_with_images(tmp_path_factory):
    """25 s of three clients over every API (images up to 2000x2000, streams, structured output, tools, logprobs,
    disconnects, bursts past --queue 2) against a server process on the tiny Qwen3-VL: every response well formed,
    /health answering, the idle server's RSS, fds and threads flat, the server answering at the end and exiting
    0 on SIGTERM (mixed_load.problems lists what failed)."""
    r = mixed_load.run(cached_qwen3_vl(tmp_path_factory), 25, threads=3, queue=2, pool=6, warmup_s=5,
                       health_max_s=10.0)  # a blocked loop; a loaded shared machine's scheduler alone adds seconds
    problems = mixed_load.problems(r)
    assert not problems, (problems, r["failures"], r["warmup"]["failures"], r["health"], r["by_status"])
    ran = set(r["by_kind"]) | set(r["warmup"]["by_kind"])
    for kind in mixed_load.KINDS:  # every kind ran (the warm-up runs each once) and was recorded
        name = {"chat": "chat/", "completion_logprobs": "completions/", "ollama_chat": "ollama/chat/",
                "ollama_generate": "ollama/generate", "responses": "responses/", "disconnect": "disconnect/",
                "burst": "burst", "sdk_openai": "sdk/openai", "sdk_ollama": "sdk/ollama", "structured": "structured",
                "tools": "tools/"}[kind.__name__]
        assert any(k.startswith(name) for k in ran), (kind.__name__, ran)
    assert r["by_status"].get("200", 0) > 0 and r["warmup"]["counts"]["images_sent"] > 0, r  # how many: the CPU's
    assert r["health"]["polls"] > 0 and r["samples"] > 0, r


def test_sigterm_under_load(tiny_qwen3_tied, cli_server):
    """Six clients streaming and two queued non-stream requests when SIGTERM comes (--grace 1): every stream ends
    properly (finished with [DONE], or a server_shutdown error event and the end of the chunked body), every
    queued request gets 503, the process exits 0 within grace + 2 s."""
    proc, port = cli_server(tiny_qwen3_tied, "--grace", "1", "--queue", "8")
    results: list = []

    def client(i: int, stream: bool):
        c = RawClient(port, timeout=30)
        c.send(request_bytes("POST", "/v1/chat/completions",
                             chat_body(f"Story {i}", stream=stream, max_tokens=3000, ignore_eos=True)))
        r = c.read_head()
        if stream:
            c.read_events(r)
            results.append(("stream", r.status, r._finished, r.data_events()[-1] if r.data_events() else b""))
        else:
            results.append(("json", r.status, True, c.read_body(r)))
        c.close()
    threads = [threading.Thread(target=client, args=(i, i < 6)) for i in range(8)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    assert time.monotonic() - t0 < 1 + 2
    for t in threads:
        t.join(10)
    assert len(results) == 8
    for kind, status, finished, last in results:
        if kind == "stream":
            assert status == 200 and finished
            assert last == b"data: [DONE]\n\n" or b'"server_shutdown"' in last, last
        else:
            assert status == 503 and b"server_shutdown" in last
