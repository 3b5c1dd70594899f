"""A mixed load with images against the real server process (`python -m appliance --queue Q` on the tiny
Qwen3-VL checkpoint, real sockets): what `tests/system/soak.py --mixed-minutes M` runs, and
tests/system/test_system_soak.py for ~25 s.

- `threads` clients loop until the deadline over a random mix of KINDS: streamed and non-stream chats with
  PNG/JPEG/WebP images of random sizes up to 2000x2000 (one to three per message) or text only, /v1/completions
  with logprobs, structured output (json_schema), tools, Ollama /api/chat with images and /api/generate, the
  Responses API, the official openai and ollama clients, mid-stream disconnects (FIN and RST, some before the
  response head), and bursts of concurrent requests that overflow the queue (429 with Retry-After).
- Every request must get a well-formed response (tests/system/wellformed.py) within RESPONSE_TIMEOUT_S: no 5xx,
  no hang, every stream ended as its API ends one.
- Beside the load (tests/system/monitor.py): /health every 0.5 s (latency recorded; over HEALTH_MAX_S is a
  failure), /metrics every 5 s (at the end: the event loop's lag, no 5xx counted server-side), the server's RSS,
  fds and threads every 3 s.
- Flat: RSS, fds and threads of the idle server (its prefix cache bounded by CACHE_RAM_MB) after a warm-up and
  after the load, within RSS_SLACK_MB / FD_SLACK / THREAD_SLACK. RSS is its anonymous part (what a leak grows;
  mapped files' pages come and go with the page cache), and the warm-up ends with the heaviest request
  (heaviest()). Each is taken IDLE_S after the last request (trio's idle worker threads exit after 10 s) and once no client connection is left (monitor.settle, up to
  SETTLE_S): /metrics' kestrel_open_connections counts only the one asking, and the process holds no socket
  but its listener and unix sockets (monitor.fd_kinds). A connection a client leaves open ends at the server's
  15 s keep-alive timeout; a closed one goes within milliseconds, even on a loaded machine. A socket still
  there after SETTLE_S with the server counting no connection is a leaked descriptor; a connection still
  counted is one that never ends: both fail.
- At the end the server must answer a request with an image, then exit 0 on SIGTERM (the time is reported).
"""
from __future__ import annotations

import base64
import collections
import io
import os
import random
import signal
import socket
import struct
import threading
import time
from typing import Any, Callable

from tests.support.live_server import RawClient, request_bytes
from tests.support.tiny_vl import image_bytes
from tests.system import wellformed as wf
from tests.system.monitor import (
    HEALTH_MAX_S,
    RESPONSE_TIMEOUT_S,
    SETTLE_S,
    Monitor,
    get,
    metric,
    server_5xx,
    settle,
    usage,
)
from tests.system.sigterm_cycles import start

IDLE_S = 12.0
RSS_SLACK_MB, FD_SLACK, THREAD_SLACK = 64, 2, 2
MAX_IMAGE_BYTES = 2_800_000    # base64 of it stays under the 4 MB body limit
REQUEST_IMAGES_B64 = 3_900_000  # the base64 of one request's images together (a 413 otherwise)
GRACE_S = 1.0
# The prefix cache keeps copies of earlier conversations up to --cache-ram (default: a quarter of the available
# memory), so by design RSS grows with every new conversation until then (+191 MB idle to idle in 30 minutes
# here): bounded, "flat" measures leaks, not the cache filling. 16 MB (about ten full 2048-token conversations
# of the tiny model) rather than 64: a 25 s run is still filling it between its two idle measurements, and at
# 64 MB its growth alone could use up RSS_SLACK_MB (+54 and +56 MB were seen idle to idle with 64).
CACHE_RAM_MB = 16
EXIT_HANG_S = 30.0   # the exit's time is reported; the bound (grace + 2 s) is test_sigterm_under_load's and the cycles'
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer"}},
          "required": ["ok", "color", "n"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}
MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}


# ---- the images ---------------------------------------------------------------------------------------------

def encoded_image(w: int, h: int, fmt: str, seed: int) -> bytes:
    """A w x h picture (gradients plus noise at 1/8 scale, upscaled so it compresses like a photo rather than
    noise) in fmt, under MAX_IMAGE_BYTES."""
    from PIL import Image

    mode = "RGBA" if fmt != "JPEG" and seed % 2 else "RGB"
    small = Image.open(io.BytesIO(image_bytes(max(1, w // 8), max(1, h // 8), "PNG", mode=mode, seed=seed)))
    for resample in (Image.BILINEAR, Image.NEAREST):
        buf = io.BytesIO()
        small.resize((w, h), resample).save(buf, fmt, **({} if fmt == "PNG" else {"quality": 80}))
        if buf.tell() <= MAX_IMAGE_BYTES:
            return buf.getvalue()
    return encoded_image(w * 3 // 4, h * 3 // 4, fmt, seed)


def image_pool(n: int, seed: int) -> list[dict]:
    """n images of random sizes (every third at least 1500 px on its long side) in PNG, JPEG and WebP."""
    rng = random.Random(seed)
    pool = []
    for i in range(n):
        fmt = ("PNG", "JPEG", "WEBP")[i % 3]
        long_side = rng.randint(1500, 2000) if i % 3 == 2 else rng.randint(16, 2000)
        short = rng.randint(max(16, long_side // 8), long_side)
        w, h = (long_side, short) if rng.random() < 0.5 else (short, long_side)
        data = encoded_image(w, h, fmt, seed + i)
        from PIL import Image
        w, h = Image.open(io.BytesIO(data)).size
        pool.append({"fmt": fmt, "size": (w, h), "bytes": len(data), "b64": base64.b64encode(data).decode(),
                     "uri": f"data:{MIME[fmt]};base64," + base64.b64encode(data).decode()})
    return pool


# ---- one request and its check ------------------------------------------------------------------------------

class Load:
    """Shared state of one run: the port, the images, the outcome counters (under a lock)."""

    def __init__(self, port: int, pool: list[dict], queue: int):
        self.port, self.pool, self.queue = port, pool, queue
        self.lock = threading.Lock()
        self.by_kind: dict = collections.defaultdict(collections.Counter)
        self.failures: list = []
        self.n_failures = 0
        self.counts: collections.Counter = collections.Counter()
        self.latency: dict = collections.defaultdict(float)

    def record(self, kind: str, status: Any, problem: str | None = None, seconds: float = 0.0) -> None:
        with self.lock:
            self.by_kind[kind][str(status)] += 1
            self.latency[kind] = max(self.latency[kind], seconds)
            if problem is not None:
                self.n_failures += 1
                if len(self.failures) < 30:
                    self.failures.append((kind, str(status), problem[:400]))

    def images(self, rng: random.Random, most: int = 3) -> list[dict]:
        """1 to `most` images from the pool whose base64 fits one request body (4 MB) together."""
        return self.fitting(rng.choice(self.pool) for _ in range(rng.randint(1, most)))

    def largest(self, most: int = 3) -> list[dict]:
        """The pool's largest images (by pixels), up to `most` whose base64 fits one request body together."""
        return self.fitting(sorted(self.pool, key=lambda im: -im["size"][0] * im["size"][1])[:most])

    def fitting(self, candidates) -> list[dict]:
        """The candidates in order, each kept if the base64 of those kept so far fits one body with it (the first
        always), counted as sent."""
        picked: list[dict] = []
        for im in candidates:
            if not picked or sum(len(p["uri"]) for p in picked) + len(im["uri"]) < REQUEST_IMAGES_B64:
                picked.append(im)
        with self.lock:
            self.counts["images_sent"] += len(picked)
            for im in picked:
                self.counts["images_" + im["fmt"]] += 1
        return picked


def chunked(r) -> bool:
    return (r.header("transfer-encoding") or "").lower() == "chunked"


def back_off() -> None:
    """What a client does after a 429 (not the whole Retry-After: the load keeps the queue full)."""
    time.sleep(random.uniform(0.2, 1.0))


def exchange(load: Load, kind: str, path: str, body: dict, check: Callable[[bytes], str | None],
             ollama: bool = False, patient: bool = True) -> int | None:
    """POST body, read the whole response, record it (429 and check(payload) for 200); the status. A patient
    client backs off after a 429."""
    t0 = time.perf_counter()
    c = RawClient(load.port, timeout=RESPONSE_TIMEOUT_S)
    status: Any = "none"
    try:
        c.send(request_bytes("POST", path, body))
        r = c.read_head()
        status = r.status
        if chunked(r):
            c.read_events(r)
            payload = b"".join(e for _, e in r.events) + r._text
            problem = None if r._finished else "chunked body cut before its end"
        else:
            payload = c.read_body(r)
            problem = None if len(payload) == int(r.header("content-length") or -1) else "short body"
        if problem is None and r.status == 429:
            problem = wf.retry_after_problem(r, payload, ollama)
        elif problem is None:
            problem = safe(check, payload) if r.status == 200 else f"status {r.status}: {payload[:300]!r}"
    except (socket.timeout, TimeoutError):
        status, problem = "hang", f"no complete response within {RESPONSE_TIMEOUT_S} s"
    except OSError as e:
        status, problem = "closed", f"connection closed: {e!r}"
    finally:
        c.close()
    load.record(kind, status, problem, time.perf_counter() - t0)
    if status == 429 and patient:
        back_off()
    return status if isinstance(status, int) else None


def safe(check: Callable[[bytes], str | None], payload: bytes) -> str | None:
    try:
        return check(payload)
    except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError) as e:
        return f"{type(e).__name__}: {e} in {payload[:300]!r}"


def user_content(load: Load, rng: random.Random, text: str, with_images: bool) -> Any:
    return image_content(load.images(rng), text) if with_images else text


def image_content(images: list[dict], text: str) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": im["uri"]}} for im in images] + [{"type": "text", "text": text}]


# ---- the kinds of request -------------------------------------------------------------------------------------

def chat(load: Load, rng: random.Random) -> None:
    stream, images = rng.random() < 0.6, rng.random() < 0.5
    body = {"model": "vl", "messages": [{"role": "user", "content": user_content(load, rng, "Describe it.", images)}],
            "max_tokens": rng.randint(1, 48), "stream": stream, "temperature": rng.choice([0, 0.8])}
    if rng.random() < 0.3:
        body["messages"].insert(0, {"role": "system", "content": "Be brief."})
    check = wf.openai_stream_problem if stream else lambda p: wf.body_problem(wf.chat_problem, p)
    exchange(load, f"chat/{'stream' if stream else 'json'}/{'image' if images else 'text'}", "/v1/chat/completions",
             body, check)


def completion_logprobs(load: Load, rng: random.Random) -> None:
    stream, top = rng.random() < 0.3, rng.randint(0, 5)
    body = {"model": "vl", "prompt": "Once upon a time", "max_tokens": rng.randint(1, 24), "logprobs": top,
            "stream": stream, "ignore_eos": True}
    check = wf.openai_stream_problem if stream else \
        lambda p: wf.body_problem(lambda o: wf.completion_logprobs_problem(o, top), p)
    exchange(load, f"completions/{'stream' if stream else 'json'}", "/v1/completions", body, check)


def structured(load: Load, rng: random.Random) -> None:
    stream = rng.random() < 0.3
    body = {"model": "vl", "messages": [{"role": "user", "content": "Give the state as JSON."}], "max_tokens": 64,
            "stream": stream, "response_format": {"type": "json_schema", "json_schema": {"name": "state",
                                                                                        "schema": SCHEMA}}}
    check = (lambda p: wf.openai_stream_problem(p, SCHEMA)) if stream else \
        lambda p: wf.body_problem(lambda o: wf.chat_problem(o, SCHEMA), p)
    exchange(load, "structured", "/v1/chat/completions", body, check)


def tools(load: Load, rng: random.Random) -> None:
    stream, choice = rng.random() < 0.4, rng.choice(["required", "auto"])
    body = {"model": "vl", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [TOOL],
            "tool_choice": choice, "max_tokens": 48, "stream": stream}
    check = wf.openai_stream_problem if stream else \
        lambda p: wf.body_problem(lambda o: wf.chat_problem(o, tool="get_weather"), p)
    exchange(load, f"tools/{choice}", "/v1/chat/completions", body, check)


def ollama_chat(load: Load, rng: random.Random) -> None:
    stream, images = rng.random() < 0.5, rng.random() < 0.6
    msg = {"role": "user", "content": "What is in the picture?"}
    if images:
        msg["images"] = [im["b64"] for im in load.images(rng, 2)]
    body = {"model": "vl", "messages": [msg], "stream": stream, "options": {"num_predict": rng.randint(1, 32)}}
    check = wf.ollama_stream_problem if stream else lambda p: wf.body_problem(lambda o: wf.ollama_problem(o, True), p)
    exchange(load, f"ollama/chat/{'image' if images else 'text'}", "/api/chat", body, check, ollama=True)


def ollama_generate(load: Load, rng: random.Random) -> None:
    stream = rng.random() < 0.5
    body = {"model": "vl", "prompt": "Why is the sky blue?", "stream": stream,
            "options": {"num_predict": rng.randint(1, 32), "temperature": 0.7}}
    check = wf.ollama_stream_problem if stream else lambda p: wf.body_problem(lambda o: wf.ollama_problem(o, False), p)
    exchange(load, "ollama/generate", "/api/generate", body, check, ollama=True)


def responses(load: Load, rng: random.Random) -> None:
    stream, images = rng.random() < 0.6, rng.random() < 0.4
    content: list = [{"type": "input_image", "image_url": im["uri"]} for im in (load.images(rng, 2) if images else [])]
    body = {"model": "vl", "input": [{"role": "user", "content": content + [{"type": "input_text", "text": "Hi."}]}],
            "max_output_tokens": rng.randint(16, 40), "stream": stream}
    check = wf.responses_stream_problem if stream else lambda p: wf.body_problem(wf.responses_problem, p)
    exchange(load, f"responses/{'stream' if stream else 'json'}", "/v1/responses", body, check)


def disconnect(load: Load, rng: random.Random) -> None:
    """A stream (chat, Ollama or Responses) left with FIN or RST: before its head, or after a few lines."""
    rst, api = rng.random() < 0.5, rng.choice(["chat", "ollama", "responses"])
    path, body = {"chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": user_content(
        load, rng, "Tell a story.", rng.random() < 0.3)}], "max_tokens": 400, "stream": True, "ignore_eos": True}),
        "ollama": ("/api/chat", {"messages": [{"role": "user", "content": "Tell a story."}],
                                 "options": {"num_predict": 400}}),
        "responses": ("/v1/responses", {"input": "Tell a story.", "max_output_tokens": 400, "stream": True})}[api]
    when = rng.choice(["before_head", "after_lines"])
    status: Any = "cut"
    try:
        c = RawClient(load.port, timeout=RESPONSE_TIMEOUT_S)
        c.send(request_bytes("POST", path, dict(body, model="vl")))
        if when == "before_head":
            time.sleep(rng.random() * 0.05)
        else:
            r = c.read_head()
            status = r.status
            if r.status == 200:
                k = rng.randint(1, 12)
                c.read_events(r, until=lambda r: r.raw_body.count(b"\n") >= k)
            elif r.status == 429:
                payload = c.read_body(r)
                problem = wf.retry_after_problem(r, payload, api == "ollama")
                c.close()
                load.record(f"disconnect/{api}/429", status, problem)
                back_off()
                return
        if rst:  # SO_LINGER 0: close sends a reset instead of a FIN
            c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close()
    except (socket.timeout, TimeoutError):
        load.record(f"disconnect/{api}", "hang", "no response head")
        return
    load.record(f"disconnect/{api}/{when}/{'rst' if rst else 'fin'}", status,
                None if status in (200, 429, "cut") else f"status {status}")


def burst(load: Load, rng: random.Random) -> None:
    """queue + 3..6 short chats at once: the queue overflows, the ones past it get 429 with Retry-After."""
    n = load.queue + rng.randint(3, 6)
    gate = threading.Barrier(n)
    statuses: list = []

    def one():
        gate.wait()
        statuses.append(exchange(load, "burst", "/v1/chat/completions",
                                 {"model": "vl", "messages": [{"role": "user", "content": "Count."}],
                                  "max_tokens": 12, "ignore_eos": True},
                                 lambda p: wf.body_problem(wf.chat_problem, p), patient=False))
    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RESPONSE_TIMEOUT_S * 2)
    with load.lock:
        load.counts["bursts"] += 1
        load.counts["burst_429"] += statuses.count(429)


def sdk_openai(load: Load, rng: random.Random) -> None:
    """The official openai client (no retries): a streamed chat with an image, read to its end."""
    import openai
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{load.port}/v1", api_key="none", max_retries=0,
                           timeout=RESPONSE_TIMEOUT_S)
    t0, status, problem = time.perf_counter(), 200, None
    try:
        reasons = [ch.finish_reason for chunk in client.chat.completions.create(
            model="vl", stream=True, max_tokens=rng.randint(1, 24),
            messages=[{"role": "user", "content": user_content(load, rng, "Describe.", True)}])
            for ch in chunk.choices if ch.finish_reason]
        problem = None if len(reasons) == 1 else f"finish reasons {reasons}"
    except openai.RateLimitError as e:
        status, ra = 429, e.response.headers.get("retry-after", "")
        problem = None if ra.isdigit() and int(ra) >= 1 else f"429 without Retry-After: {ra!r}"
    except openai.APIStatusError as e:
        status, problem = e.status_code, f"status {e.status_code}: {e.message}"
    except Exception as e:  # connection errors, a cut stream, a timeout
        status, problem = "error", f"{type(e).__name__}: {e}"
    finally:
        client.close()
    load.record("sdk/openai", status, problem, time.perf_counter() - t0)
    if status == 429:
        back_off()


def sdk_ollama(load: Load, rng: random.Random) -> None:
    """The official ollama client: a streamed /api/chat with images (raw bytes; the client base64s them)."""
    import ollama
    client = ollama.Client(host=f"http://127.0.0.1:{load.port}", timeout=RESPONSE_TIMEOUT_S)
    t0, status, problem = time.perf_counter(), 200, None
    try:
        images = [base64.b64decode(im["b64"]) for im in load.images(rng, 2)]
        parts = list(client.chat(model="vl", stream=True, options={"num_predict": rng.randint(1, 24)},
                                 messages=[{"role": "user", "content": "What is this?", "images": images}]))
        problem = None if parts and parts[-1].done and not any(p.done for p in parts[:-1]) else "no final done"
    except ollama.ResponseError as e:
        status, problem = e.status_code, None if e.status_code == 429 else f"status {e.status_code}: {e.error}"
    except Exception as e:
        status, problem = "error", f"{type(e).__name__}: {e}"
    finally:  # else its keep-alive connection stays open until the client is collected (or the server's timeout)
        client.close()
    load.record("sdk/ollama", status, problem, time.perf_counter() - t0)
    if status == 429:
        back_off()


KINDS: dict[Callable[[Load, random.Random], None], int] = {
    chat: 30, completion_logprobs: 8, structured: 6, tools: 6, ollama_chat: 10, ollama_generate: 6, responses: 10,
    disconnect: 12, burst: 2, sdk_openai: 5, sdk_ollama: 5}


# ---- the run ------------------------------------------------------------------------------------------------

def attempt(kind: Callable[[Load, random.Random], None], load: Load, rng: random.Random) -> None:
    try:
        kind(load, rng)
    except Exception as e:  # the client's own failure (a check that met an unexpected shape...)
        load.record(kind.__name__, "client-error", f"{type(e).__name__}: {e}")


def drive(load: Load, seconds: float, threads: int, seed: int) -> int:
    """threads clients over KINDS until the deadline; the number of clients still stuck after it."""
    deadline = time.monotonic() + seconds
    kinds, weights = list(KINDS), list(KINDS.values())

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < deadline:
            attempt(rng.choices(kinds, weights)[0], load, rng)
    workers = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(max(0.0, deadline - time.monotonic()) + 3 * RESPONSE_TIMEOUT_S)
    return sum(t.is_alive() for t in workers)


def idle_usage(port: int, pid: int) -> dict:
    """usage(pid) of the idle server, IDLE_S after the last request and once no client connection is left
    (monitor.settle: its fds by kind, and "settled" False if that took longer than SETTLE_S)."""
    time.sleep(IDLE_S)
    settled = settle(port, SETTLE_S, pid)
    return dict(usage(pid), **settled)


def run(model: str, seconds: float, threads: int = 6, queue: int = 4, pool: int = 24, seed: int = 16,
        warmup_s: float = 60.0, health_max_s: float = HEALTH_MAX_S, log=None) -> dict:
    """The mixed load's report (see the module's docstring; `problems(report)` says what failed). /health
    slower than health_max_s is a failure."""
    t_start = time.monotonic()
    images = image_pool(pool, seed)
    log = log or open(os.devnull, "w")
    proc, port = start(model, GRACE_S, log, "--queue", str(queue), "--ctx", "2048", "--cache-ram", str(CACHE_RAM_MB))
    report: dict = {"seconds": seconds, "threads": threads, "queue": queue, "model": os.path.basename(model),
                    "health_max_s": health_max_s,
                    "images": {"pool": len(images), "formats": dict(collections.Counter(im["fmt"] for im in images)),
                               "largest": max((im["size"] for im in images), key=lambda s: s[0] * s[1]),
                               "max_bytes": max(im["bytes"] for im in images)}}
    try:
        before = server_5xx(get(port, "/metrics")[1].decode())  # the 503s of /health while the model loaded
        warmup = Load(port, images, queue)
        rng = random.Random(seed)
        for kind in KINDS:  # warm-up: every kind once (first compiles, caches), then the load for warmup_s
            attempt(kind, warmup, rng)
        heaviest(warmup)
        stuck = drive(warmup, warmup_s, threads, seed + 1)
        report["warmup"] = outcomes(warmup, stuck)
        report["idle_start"] = idle_usage(port, proc.pid)
        load = Load(port, images, queue)
        with Monitor(port, proc.pid, health_max_s) as mon:
            t0 = time.monotonic()
            stuck = drive(load, seconds, threads, seed + 2)
            report["load_s"] = round(time.monotonic() - t0, 1)
        report.update(outcomes(load, stuck), **mon.summary())
        report["idle_end"] = idle_usage(port, proc.pid)
        status, body = get(port, "/metrics")
        text = body.decode()
        report["loop_lag_max_s"] = metric(text, "kestrel_event_loop_lag_max_seconds")
        report["loop_stalls"] = metric(text, "kestrel_event_loop_stalls_total")
        report["server_5xx"] = {k: n - before.get(k, 0) for k, n in server_5xx(text).items() if n > before.get(k, 0)}
        report["server_counts"] = {k: metric(text, k) for k in (
            "kestrel_rejected_total", "kestrel_cancelled_total", "kestrel_queue_abandoned_total",
            "kestrel_images_decoded_total", "kestrel_generated_tokens_total")}
        last = Load(port, images, queue)
        exchange(last, "final", "/v1/chat/completions", {"model": "vl", "max_tokens": 4, "messages": [{"role": "user", "content": user_content(
            last, random.Random(seed), "Describe.", True)}]}, lambda p: wf.body_problem(wf.chat_problem, p))
        report["final_request"] = dict(last.by_kind["final"]) if not last.failures else last.failures
    finally:
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            report["exit_code"] = proc.wait(EXIT_HANG_S)
        except Exception:
            proc.kill()
            report["exit_code"] = "hang"
        report["exit_s"] = round(time.monotonic() - t_term, 2)
    report["total_s"] = round(time.monotonic() - t_start)
    return report


def heaviest(load: Load) -> None:
    """The heaviest request the load can make, once: the pool's largest images (by pixels) that fit one body.
    The native kernels' per-thread scratch (pool.c) and the allocator's arenas keep the high-water mark of the
    largest image encoded so far: bounded by the image limits, not a leak. Reached in the warm-up, it is in the
    first idle measurement too; left to chance, a short warm-up on a loaded machine can miss the large images
    and the load's first one then reads as growth (+64 MB idle to idle was seen in CI that way)."""
    exchange(load, "chat/json/heaviest", "/v1/chat/completions", {"model": "vl", "max_tokens": 4, "messages": [
        {"role": "user", "content": image_content(load.largest(), "Describe.")}]},
        lambda p: wf.body_problem(wf.chat_problem, p))


def outcomes(load: Load, stuck: int) -> dict:
    by_kind = {k: dict(v) for k, v in sorted(load.by_kind.items())}
    statuses: collections.Counter = collections.Counter()
    for v in load.by_kind.values():
        statuses.update(v)
    return {"requests": sum(statuses.values()), "by_status": dict(statuses), "by_kind": by_kind,
            "n_failures": load.n_failures, "failures": load.failures, "stuck_clients": stuck,
            "counts": dict(load.counts), "max_latency_s": {k: round(v, 2) for k, v in sorted(load.latency.items())}}


def problems(r: dict) -> list[str]:
    """What the run's report says went wrong (empty: passed)."""
    out, w = [], r.get("warmup", {})
    if r.get("n_failures", 1) or w.get("n_failures", 1):
        out.append(f"{r.get('n_failures')} failed requests (+{w.get('n_failures')} in the warm-up)")
    if r.get("stuck_clients", 1) or w.get("stuck_clients", 1):
        out.append(f"{r.get('stuck_clients')} clients stuck (+{w.get('stuck_clients')} in the warm-up)")
    if r.get("health", {}).get("failures", 1):
        out.append(f"/health failed or took > {r.get('health_max_s')} s {r.get('health', {}).get('failures')} times")
    if r.get("metrics", {}).get("failures", [1]):
        out.append("/metrics failed")
    if r.get("server_5xx", {1: 1}):
        out.append(f"server counted 5xx: {r.get('server_5xx')}")
    bursts = [x.get("counts", {}) for x in (r, w)]
    if not sum(c.get("burst_429", 0) for c in bursts):
        out.append(f"no burst overflowed the queue: {bursts}")
    a, b = r.get("idle_start"), r.get("idle_end")
    for when, u in (("warm-up", a), ("load", b)):
        if u and not u["settled"]:
            out.append(f"connections left {SETTLE_S:.0f} s after the {when} (server counts "
                       f"{u['open_connections']} with /metrics' own, fds {u['fd_kinds']})")
    if not a or not b or b["anon_mb"] - a["anon_mb"] > RSS_SLACK_MB or b["fds"] > a["fds"] + FD_SLACK or \
            b["threads"] > a["threads"] + THREAD_SLACK:
        d = {k: round(b[k] - a[k], 1) for k in ("anon_mb", "rss_mb", "fds", "threads")} if a and b else None
        out.append(f"idle RSS/fds/threads not flat: {d} (slack {RSS_SLACK_MB} MB, {FD_SLACK}, {THREAD_SLACK}): {a} -> {b}")
    if r.get("final_request") != {"200": 1}:
        out.append(f"final request: {r.get('final_request')}")
    if r.get("exit_code") != 0:
        out.append(f"exit {r.get('exit_code')} after {r.get('exit_s')} s")
    return out
