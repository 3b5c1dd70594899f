"""Issue 22, on the real CLI server as a subprocess over raw sockets: /metrics counts what clients really got,
and every request leaves one access-log line on stderr (README: "Logs").

- A client that reads the whole response and closes at once (as clients do) was counted as gone (`code="499"`):
  the handler's last checkpoint came after the last byte, so the client's close cancelled it first (17 of 50
  /health requests; 541 of 589 in a soak). A response is now complete once its last byte is written.
- Nothing was logged for a failed request and 4xx were not logged at all: now one line per request with the
  method, path, status, bytes written, duration, request id, and for generations the queue wait and tokens;
  errors carry their reason; a client that left is marked.
"""
from __future__ import annotations

import json
import re
import signal
import socket

from prometheus_client.parser import text_string_to_metric_families

from tests.support.live_server import RawClient, chat_body, drain_stderr, request_bytes

N = 50
ACCESS = re.compile(r" (DEBUG|INFO|WARNING) appliance\.access: (\S+) (\S+) (\S+) (.*)$")


def requests_total(port: int) -> dict[tuple[str, str], float]:
    c = RawClient(port, timeout=30)
    c.send(request_bytes("GET", "/metrics"))
    text = c.read_body(c.read_head()).decode()
    c.close()
    return {(s.labels["endpoint"], s.labels["code"]): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "kestrel_requests_total"}


def read_then_close(port: int, method: str, path: str, body: dict | bytes | None = None,
                    headers: dict | None = None, stream: bool = False) -> tuple[int, bytes]:
    """One request on a fresh connection; the whole response is read, then the socket closes at once.
    Returns the status and every byte received."""
    c = RawClient(port, timeout=60)
    try:
        c.send(request_bytes(method, path, body, headers))
        r = c.read_head()
        if stream:
            c.read_events(r)
        else:
            c.read_body(r)
        return r.status, r.head + r.raw_body
    finally:
        c.close()


def test_fully_read_responses_are_counted_with_their_status(tiny_qwen3_tied, cli_server):
    proc, port = cli_server(tiny_qwen3_tied)
    drain_stderr(proc)
    before = requests_total(port)
    for _ in range(N):
        assert read_then_close(port, "GET", "/health")[0] == 200
    for i in range(3):
        assert read_then_close(port, "POST", "/v1/chat/completions", chat_body(f"Hi {i}", max_tokens=2))[0] == 200
        assert read_then_close(port, "POST", "/v1/chat/completions", chat_body(f"Yo {i}", max_tokens=2, stream=True),
                               stream=True)[0] == 200
    after = requests_total(port)
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert delta.get(("/health", "200")) == N, delta
    assert delta.get(("/v1/chat/completions", "200")) == 6, delta
    assert not [k for k in delta if k[1] == "499"], delta


def access_lines(stderr: str) -> list[tuple[str, str, str, str, dict[str, str], str]]:
    """(level, method, path, status, fields, raw line) of each access-log line."""
    out = []
    for line in stderr.splitlines():
        m = ACCESS.search(line)
        if m:
            level, method, path, status, rest = m.groups()
            fields = dict(re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', rest))
            for flag in ("client_gone", "cut"):
                if re.search(rf"(^| ){flag}( |$)", rest):
                    fields[flag] = "1"
            out.append((level, method, path, status, fields, line))
    return out


def test_one_access_log_line_per_request_with_its_reason(tiny_qwen3_tied, cli_server):
    proc, port = cli_server(tiny_qwen3_tied, "--log-level", "debug")
    sent: dict[str, tuple[int, bytes]] = {}

    def req(rid: str, method: str, path: str, body=None, stream: bool = False):
        sent[rid] = read_then_close(port, method, path, body, {"X-Request-Id": rid}, stream=stream)

    req("t-health", "GET", "/health")
    req("t-404", "GET", "/nope")
    req("t-405", "GET", "/v1/chat/completions")
    req("t-badjson", "POST", "/v1/chat/completions", b"{not json")
    req("t-chat", "POST", "/v1/chat/completions", chat_body("Count.", max_tokens=3, ignore_eos=True))
    req("t-stream", "POST", "/v1/chat/completions", chat_body("Count.", max_tokens=3, ignore_eos=True, stream=True),
        stream=True)
    req("t-ollama", "POST", "/api/chat", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                          "options": {"num_predict": -5}})
    # a stream whose client leaves after the first tokens
    c = RawClient(port, timeout=60)
    c.send(request_bytes("POST", "/v1/chat/completions",
                         chat_body("Tell a story.", max_tokens=3000, ignore_eos=True, stream=True),
                         {"X-Request-Id": "t-gone"}))
    r = c.read_head()
    c.read_events(r, stop_after=3)
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    # a request head that is not HTTP
    raw = socket.create_connection(("127.0.0.1", port), timeout=30)
    raw.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    assert raw.recv(65536).startswith(b"HTTP/1.1 400 ")
    raw.close()
    # the gone stream's line is written once the server has seen the close; SIGTERM then ends the process
    read_then_close(port, "GET", "/health", headers={"X-Request-Id": "t-last"})
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    stderr = proc.stderr.read()
    lines = access_lines(stderr)
    by_id: dict[str, list] = {}
    for entry in lines:
        by_id.setdefault(entry[4].get("id"), []).append(entry)
    for rid in list(sent) + ["t-gone"]:
        assert len(by_id.get(rid, [])) == 1, (rid, [e[5] for e in lines])
    line = {rid: by_id[rid][0] for rid in list(sent) + ["t-gone"]}

    for rid, (status, received) in sent.items():   # status and bytes as the client saw them
        level, method, path, logged_status, f, text = line[rid]
        assert logged_status == str(status), text
        assert int(f["bytes"]) == len(received), (text, len(received))
        assert float(f["ms"]) >= 0 and f["client"].startswith("127.0.0.1:") and "client_gone" not in f, text
    assert line["t-health"][:4] == ("DEBUG", "GET", "/health", "200")   # probes are debug, the rest info
    assert line["t-404"][:4] == ("INFO", "GET", "/nope", "404")
    assert json.loads(line["t-404"][4]["error"]) == "Unknown path: /nope"
    assert line["t-405"][3] == "405" and "error" in line["t-405"][4]
    assert line["t-badjson"][3] == "400" and "JSON" in json.loads(line["t-badjson"][4]["error"])
    assert line["t-ollama"][3] == "400" and "num_predict" in json.loads(line["t-ollama"][4]["error"])
    for rid in ("t-chat", "t-stream"):
        level, method, path, status, f, text = line[rid]
        assert (level, method, path, status) == ("INFO", "POST", "/v1/chat/completions", "200"), text
        assert int(f["prompt_tokens"]) > 0 and f["completion_tokens"] == "3" and f["finish"] == "length", text
        assert float(f["queue_ms"]) >= 0 and "ttft_ms" in f and "error" not in f, text
    level, method, path, status, f, text = line["t-gone"]
    assert (level, status) == ("INFO", "200") and f.get("client_gone") == "1", text
    assert int(f["prompt_tokens"]) > 0 and "finish" not in f, text
    bad_head = [e for e in lines if e[1:4] == ("-", "-", "400")]
    assert len(bad_head) == 1 and "Malformed HTTP request" in json.loads(bad_head[0][4]["error"]), lines
    assert "Traceback" not in stderr
