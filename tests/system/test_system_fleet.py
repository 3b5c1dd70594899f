"""A fleet: three real `kestrel-appliance` processes (SmolLM2-135M Q4_1, `--queue 1`, one thread each: they share
this machine's two cores) behind a real nginx (the Debian package) running the configuration `kestrel-appliance
fleet-config` prints, all on 127.0.0.1, driven by the real openai client.

- `nginx -t` passes on the generated configuration and on image/nginx/kestrel-fleet.conf.
- Affinity: a conversation's turns land on one board (X-Kestrel-Board), by X-Session-Id or, without it, by its first
  user message, and turn 2 reuses turn 1's whole prompt from that board's cache (cached_tokens >= turn 1's prompt).
- Load: 12 concurrent conversations (2 turns each, 24 streams, 6 places in the fleet) all end complete; the openai
  client retries the 429s as it does by default, and nginx's log shows that every 429 a client saw had been
  answered by all three boards; conversations whose turns each went to their board at the first attempt (no
  spill) kept their board and their cache.
- Failure: SIGKILL of a board mid-stream breaks its streams (the client sees a short chunked body), every new request
  succeeds on the other two, and the board, restarted on its port, gets its conversations back.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.gguf_files import ROOT, fetch_smollm2
from tests.support.live_server import drain_stderr, start_cli_server, wait_healthy
from tests.support.nginx import Nginx, check, free_port, main_config

N_BOARDS = 3
FAIL_TIMEOUT_S = 2
SYSTEM = "You are a terse assistant. Answer in a few words."
# A first message with ~80 tokens of its own: a board keeps an earlier conversation's KV beside another's only when
# it holds more than PrefixStore's slack (64 tokens) that the other does not share (engine/prefix_cache.py).
STORY = ("A fisherman mends his nets on the quay at dawn while gulls circle the harbour and the bakery opens its "
         "shutters. The ferry sounds its horn twice, the tide turns, and the market fills with voices. ")


class Fleet:
    def __init__(self, model: str, d: str):
        self.model, self.dir = model, d
        self.ports = [free_port() for _ in range(N_BOARDS)]
        self.names = [f"board-{i}" for i in range(N_BOARDS)]
        self.procs: list[subprocess.Popen | None] = [None] * N_BOARDS
        self.by_port = dict(zip(self.ports, self.names))

    def start_board(self, i: int) -> None:
        proc, _ = start_cli_server(self.model, "--port", str(self.ports[i]), "--queue", "1", "--threads", "1",
                                   "--ctx", "2048", "--board-name", self.names[i],
                                   stdout=subprocess.DEVNULL)
        drain_stderr(proc)
        self.procs[i] = proc

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def log_lines(self) -> list[dict]:
        """nginx's access log, one dict per request: status, id, the boards tried (names) and what each said."""
        out = []
        with open(os.path.join(self.dir, "access.log")) as f:
            for line in f:
                m = re.search(r'"(\w+) (\S+) [^"]*" (\d+) \d+ id=(\w+) upstream=(.*) upstream_status=(.*) board=',
                              line)
                if m is None:
                    continue
                tried = [self.by_port.get(int(a.rsplit(":", 1)[1]), a) for a in re.split(r"[,:] ", m.group(5))
                         if ":" in a]
                said = [s.strip() for s in re.split(r"[,:] ", m.group(6)) if s.strip()]
                out.append({"method": m.group(1), "path": m.group(2), "status": int(m.group(3)), "id": m.group(4),
                            "tried": tried, "said": said, "spilled": " : " in m.group(6)})
        return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("fleet"))
    f = Fleet(fetch_smollm2(), d)
    try:
        with ThreadPoolExecutor(N_BOARDS) as ex:  # the three start side by side
            list(ex.map(f.start_board, range(N_BOARDS)))
        f.nginx_port = free_port()
        out = subprocess.run([sys.executable, "-m", "appliance", "fleet-config",
                              *[a for p in f.ports for a in ("--board", f"127.0.0.1:{p}")],
                              "--listen", f"127.0.0.1:{f.nginx_port}", "--access-log", os.path.join(d, "access.log"),
                              "--fail-timeout", str(FAIL_TIMEOUT_S)],
                             capture_output=True, text=True, timeout=60, check=True)
        f.config = out.stdout
        nginx = Nginx(d, f.config, f.nginx_port, workers=2)
        f.check = check(nginx.conf, d)
        assert f.check.returncode == 0, f.check.stderr
        with nginx:
            f.nginx = nginx
            yield f
    finally:
        for i in range(N_BOARDS):
            f.kill(i)


def client(fleet, **kw):
    from openai import OpenAI
    return OpenAI(base_url=f"http://127.0.0.1:{fleet.nginx_port}/v1", api_key="none", **kw)


def turn(c, messages, session: str | None, max_tokens: int = 8) -> dict:
    """One streamed turn: its board, answer, usage and request id (nginx's)."""
    headers = {"X-Session-Id": session} if session else {}
    with c.chat.completions.with_streaming_response.create(
            model="any", messages=messages, stream=True, max_tokens=max_tokens, temperature=0,
            stream_options={"include_usage": True}, extra_headers=headers) as resp:
        text, finish, usage = "", None, None
        for chunk in resp.parse():
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        return {"board": resp.headers.get("x-kestrel-board"), "id": resp.headers.get("x-request-id"), "text": text,
                "finish": finish, "prompt": usage.prompt_tokens,
                "cached": usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0}


def conversation(c, n: int, by_header: bool) -> tuple[dict, dict]:
    """Two turns of conversation n (a first message of its own, so its prefix is its own)."""
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Conversation {n}. {STORY * 2}Name a colour, an animal and the number "
                                        f"{n * 7}."}]
    session = f"session-{n}" if by_header else None
    t1 = turn(c, msgs, session)
    msgs += [{"role": "assistant", "content": t1["text"]}, {"role": "user", "content": "And one more?"}]
    t2 = turn(c, msgs, session)
    return t1, t2


def test_nginx_t_passes_on_the_generated_config_and_the_template(fleet, tmp_path):
    assert "syntax is ok" in fleet.check.stderr and "test is successful" in fleet.check.stderr
    assert fleet.config.count("server 127.0.0.1:") == 2 * N_BOARDS and f"proxy_next_upstream_tries {N_BOARDS};" \
        in fleet.config
    with open(os.path.join(ROOT, "image", "nginx", "kestrel-fleet.conf")) as f:
        template = f.read().replace("/var/log/nginx/kestrel-fleet.access.log", str(tmp_path / "access.log"))
    conf = tmp_path / "nginx.conf"
    conf.write_text(main_config(str(tmp_path), template))
    r = check(str(conf), str(tmp_path))
    assert r.returncode == 0, r.stderr


def test_a_conversation_stays_on_its_board_by_header_and_by_first_message(fleet):
    c = client(fleet, max_retries=0)   # one at a time: a board always has room, so no 429 may reach the client
    seen = set()
    for n in range(6):
        t1, t2 = conversation(c, n, by_header=n % 2 == 0)
        assert t1["finish"] and t2["finish"] and t1["board"] in fleet.names
        assert t2["board"] == t1["board"], (n, t1, t2)
        assert t2["cached"] >= t1["prompt"], (n, t1, t2)   # turn 1's whole prompt came from that board's cache
        seen.add(t1["board"])
    assert len(seen) >= 2, seen   # six keys spread over the boards


def test_twelve_concurrent_clients_all_complete_and_429_only_when_every_board_is_full(fleet):
    c = client(fleet, max_retries=30)
    start = len(fleet.log_lines())
    with ThreadPoolExecutor(12) as ex:
        results = list(ex.map(lambda n: conversation(c, n, by_header=n % 2 == 0), range(100, 112)))
    for t1, t2 in results:
        assert t1["finish"] in ("stop", "length") and t2["finish"] in ("stop", "length"), (t1, t2)
        assert t1["text"] and t2["text"]
    lines = [ln for ln in fleet.log_lines()[start:] if ln["path"] == "/v1/chat/completions"]
    served = [ln for ln in lines if ln["status"] == 200]
    assert len(served) == 24, [ln["status"] for ln in lines]
    rejected = [ln for ln in lines if ln["status"] == 429]
    for ln in rejected:   # what the client saw as 429 had been tried on every board, and every board was full
        assert set(ln["tried"]) == set(fleet.names) and set(ln["said"]) == {"429"}, ln
    assert all(set(ln["said"]) <= {"200", "429"} for ln in lines), lines
    by_id = {ln["id"]: ln for ln in served}
    kept = 0
    for t1, t2 in results:
        first_try = not by_id[t1["id"]]["spilled"] and not by_id[t2["id"]]["spilled"]
        if first_try:   # both turns went to the conversation's board at once: same board, turn 1's prompt reused
            assert t2["board"] == t1["board"] and t2["cached"] >= t1["prompt"], (t1, t2)
            kept += 1
    assert kept >= 3, (kept, [(by_id[a["id"]]["tried"], by_id[b["id"]]["tried"]) for a, b in results])
    assert {t1["board"] for t1, _ in results} == set(fleet.names)   # the load reached every board


def board_of(fleet, session: str) -> str:
    return turn(client(fleet, max_retries=0), [{"role": "user", "content": "Hi"}], session, max_tokens=1)["board"]


def test_a_killed_board_breaks_its_streams_the_others_serve_and_it_rejoins(fleet):
    # The load test before this one left 429s in nginx's books: a board they marked failed is skipped until
    # fail_timeout passes, so its keys go to the next board meanwhile. Wait that out, then map keys to boards
    # (a round that still lands a key elsewhere is repeated, at most three rounds).
    sessions: dict[str, str] = {}
    for _ in range(3):
        time.sleep(FAIL_TIMEOUT_S + 1)
        sessions = {board_of(fleet, f"probe-{i}"): f"probe-{i}" for i in range(12)}
        if set(sessions) == set(fleet.names):
            break
    assert set(sessions) == set(fleet.names), sessions
    victim = fleet.names.index("board-0")
    c = client(fleet, max_retries=0)
    outcome: dict = {"chunks": 0}
    started = threading.Event()

    def long_stream():
        try:
            with c.chat.completions.with_streaming_response.create(
                    model="any", messages=[{"role": "user", "content": "Tell me a long story."}], stream=True,
                    max_tokens=400, extra_body={"ignore_eos": True},
                    extra_headers={"X-Session-Id": sessions["board-0"]}) as resp:
                outcome["board"] = resp.headers.get("x-kestrel-board")
                for _ in resp.parse():
                    outcome["chunks"] += 1
                    if outcome["chunks"] == 4:
                        started.set()
            outcome["error"] = None
        except Exception as e:   # the chunked body ended early (the openai client: APIConnectionError)
            outcome["error"] = f"{type(e).__name__}: {e}"
        finally:
            started.set()

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(60) and outcome.get("board") == "board-0" and outcome["chunks"] >= 4, outcome
    fleet.kill(victim)
    t.join(30)
    assert not t.is_alive() and outcome["error"] and outcome["chunks"] < 400, outcome   # a broken stream

    # every new request succeeds on the other two, board-0's conversations included
    c2 = client(fleet, max_retries=0)
    for i in range(6):
        session = sessions[fleet.names[i % N_BOARDS]]
        r = turn(c2, [{"role": "user", "content": f"Question {i}?"}], session, max_tokens=2)
        assert r["finish"] and r["board"] in ("board-1", "board-2"), r

    # restarted on its port, it gets its conversations back once nginx tries it again (after fail_timeout)
    fleet.start_board(victim)
    assert wait_healthy(fleet.ports[victim], 60)
    deadline = time.monotonic() + FAIL_TIMEOUT_S + 20
    while board_of(fleet, sessions["board-0"]) != "board-0":
        assert time.monotonic() < deadline, "board-0 did not rejoin"
        time.sleep(0.5)
    assert board_of(fleet, sessions["board-1"]) == "board-1"
