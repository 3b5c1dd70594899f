"""The command line as a user runs it: real subprocesses, real model directories, real signals."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from appliance.engine.generate import GenerationRequest
from appliance.engine.load import load_model
from appliance.engine.sampling import SamplingParams
from tests.support.live_server import RawClient, chat_body, request_bytes

CLI = [sys.executable, "-m", "appliance"]


def run(args, timeout=60, **kw):
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout, **kw)


def assert_one_line_error(p, *fragments):
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and " INFO " not in ln]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("kestrel-appliance: error: ")
    for f in fragments:
        assert f in lines[0], lines[0]


def test_version_both_entry_points():
    p = run(["--version"])
    assert p.returncode == 0 and re.fullmatch(r"kestrel-appliance \d+\.\d+\.\d+\S*\n", p.stdout)
    script = os.path.join(os.path.dirname(sys.executable), "kestrel-appliance")
    q = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert q.returncode == 0 and q.stdout == p.stdout


def test_missing_and_unsupported_model(tmp_path):
    assert_one_line_error(run(["--model", str(tmp_path / "nope")]), "does not exist", "nope")
    assert_one_line_error(run(["--model", str(tmp_path / "nope"), "--prompt", "hi"]), "does not exist")
    assert_one_line_error(run(["--model", str(tmp_path), "--port", "0"]), "config.json")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert_one_line_error(run(["--model", str(bert), "--port", "0"]), "unsupported model type", "bert")
    assert_one_line_error(run(["--model", str(bert), "--prompt", "hi"]), "unsupported model type")
    (bert / "config.json").write_text("{not json")
    assert_one_line_error(run(["--model", str(bert), "--port", "0"]), "config.json")


def test_gguf_with_an_unserved_tensor_type_is_refused_with_status_2(tiny_qwen3_tied, tmp_path):
    """One weight stored as MXFP4 (a type no kernel serves): both modes refuse the file at load with one line
    naming the tensor and its type, exit status 2; the same file with that tensor left F32 loads."""
    from appliance import convert
    from tests.support.gguf_files import retype_tensor
    f32 = str(tmp_path / "f32.gguf")
    assert convert.main([tiny_qwen3_tied, f32, "--type", "f32"]) == 0
    bad = retype_tensor(f32, str(tmp_path / "mxfp4.gguf"), "blk.1.ffn_down.weight", "MXFP4")
    for args in (["--prompt", "hi"], ["--port", "0"]):
        p = run(["--model", bad, *args], timeout=120)
        assert p.returncode == 2, p.stderr
        assert_one_line_error(p, "tensor blk.1.ffn_down.weight has type MXFP4", "not served")
    same = retype_tensor(f32, str(tmp_path / "copy.gguf"), "no such tensor", "MXFP4")
    p = run(["--model", same, "--prompt", "hi", "--max-tokens", "2", "--temperature", "0"], timeout=120)
    assert p.returncode == 0, p.stderr


def test_port_in_use_and_bad_key_file(tiny_qwen3_tied, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert_one_line_error(run(["--model", tiny_qwen3_tied, "--port", str(port)]), "address already in use",
                              str(port))
    assert_one_line_error(run(["--model", tiny_qwen3_tied, "--api-key-file", str(tmp_path / "missing")]),
                          "--api-key-file")
    empty = tmp_path / "empty"
    empty.write_text("\n\n")
    assert_one_line_error(run(["--model", tiny_qwen3_tied, "--api-key-file", str(empty)]), "no key")
    p = run(["--model", tiny_qwen3_tied, "--queue", "-1"])
    assert p.returncode == 2 and "Traceback" not in p.stderr and "--queue" in p.stderr


def test_one_shot_prompt_streams_the_engines_reply(tiny_qwen3_tied):
    loaded = load_model(tiny_qwen3_tied)
    prompt = loaded.chat_template.render([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Name three colours."}],
                                         add_generation_prompt=True, enable_thinking=False)
    req = GenerationRequest(prompt_ids=loaded.tokenizer.encode(prompt), sampling=SamplingParams(temperature=0.0),
                            max_tokens=40, ignore_eos=False)
    expected = "".join(ev.text for ev in loaded.engine.generate(req)) + "\n"

    proc = subprocess.Popen(CLI + ["--model", tiny_qwen3_tied, "--prompt", "Name three colours.", "--system",
                                   "Be brief.", "--no-think", "--temperature", "0", "--max-tokens", "40",
                                   "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reads = []
    while True:
        data = os.read(proc.stdout.fileno(), 65536)
        if not data:
            break
        reads.append((data, proc.poll() is None))
    proc.wait(60)
    err = proc.stderr.read().decode()
    assert proc.returncode == 0, err
    assert b"".join(d for d, _ in reads).decode("utf-8") == expected
    assert reads[0][1], "the first text arrived only after the process ended"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_on_idle_server_exits_0(tiny_qwen3_tied, sig, cli_server):
    proc, port = cli_server(tiny_qwen3_tied)
    proc.send_signal(sig)
    assert proc.wait(30) == 0
    assert "Traceback" not in proc.stderr.read()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_sigterm_lets_in_flight_stream_finish_then_exits_0(tiny_qwen3_tied, cli_server):
    proc, port = cli_server(tiny_qwen3_tied, "--grace", "30")
    c = RawClient(port)
    c.send(request_bytes("POST", "/v1/chat/completions",
                         chat_body("Hello", stream=True, max_tokens=40, ignore_eos=True)))
    r = c.read_head()
    c.read_events(r, stop_after=3)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with pytest.raises(OSError):  # no longer accepting
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    c.read_events(r)
    c.close()
    assert r.data_events()[-1] == b"data: [DONE]\n\n"
    assert r.json_events()[-1]["choices"][0]["finish_reason"] == "length"
    assert proc.wait(30) == 0


def test_sigterm_ends_what_outlives_the_grace_period_cleanly(tiny_qwen3_tied, cli_server):
    """Past --grace, a running stream gets an error event with code server_shutdown and a proper end of the
    chunked body; requests still queued get 503 (a queued stream: the same error event) at once; the process
    exits 0 within grace + 2 s."""
    proc, port = cli_server(tiny_qwen3_tied, "--grace", "1", "--queue", "2")
    c = RawClient(port)
    c.send(request_bytes("POST", "/v1/chat/completions",
                         chat_body("Hello", stream=True, max_tokens=3000, ignore_eos=True)))
    r = c.read_head()
    c.read_events(r, stop_after=3)
    queued_stream, queued_json = RawClient(port), RawClient(port)
    queued_stream.send(request_bytes("POST", "/v1/chat/completions", chat_body("Next", stream=True, max_tokens=4)))
    rq = queued_stream.read_head()
    queued_stream.read_events(rq, stop_after=1)
    queued_json.send(request_bytes("POST", "/v1/chat/completions", chat_body("Later", max_tokens=4)))
    time.sleep(0.3)  # both are in line
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rj = queued_json.read_head()
    err = json.loads(queued_json.read_body(rj))["error"]
    assert rj.status == 503 and err["code"] == "server_shutdown"
    queued_stream.read_events(rq)
    assert rq._finished and rq.json_events()[-1]["error"]["code"] == "server_shutdown"
    assert time.monotonic() - t0 < 0.9  # the queue is sent away at once, not after the grace period
    c.read_events(r)
    c.close()
    assert r._finished, "the chunked body did not end properly"
    assert r.raw_body.endswith(b"0\r\n\r\n")
    assert r.json_events()[-1]["error"]["code"] == "server_shutdown"
    assert b"data: [DONE]\n\n" not in r.data_events()
    assert proc.wait(10) == 0
    assert time.monotonic() - t0 < 1 + 2
    assert "Traceback" not in proc.stderr.read()


def test_threads_sizes_the_kernel_pool():
    from appliance.engine.load import set_native_threads
    from appliance.native import cpu_topology, kernels

    if not kernels.available():  # numpy path: nothing to size, and nothing breaks
        assert set_native_threads(1) is None
        return
    try:
        assert set_native_threads(1) == 1 and kernels.get_threads() == 1
        assert set_native_threads(3) == 3 and kernels.get_threads() == 3
    finally:
        kernels.set_threads(*cpu_topology.thread_plan())


def test_systemd_ready_watchdog_stopping(tiny_qwen3_tied, tmp_path):
    """Under systemd Type=notify: READY=1 only once the model is loaded (and /health says ok), WATCHDOG=1
    pings from the running loop, STOPPING=1 at SIGTERM; exit 0."""
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(60)
    env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"}  # ping every 0.1 s
    proc = subprocess.Popen(CLI + ["--model", tiny_qwen3_tied, "--port", "0"], stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        port = None
        while port is None:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", proc.stderr.readline())
            port = int(m.group(1)) if m else None
        messages = []
        while not any(m.startswith("READY=1") for m in messages):
            messages.append(sock.recv(4096).decode())
        ready = next(m for m in messages if m.startswith("READY=1")).split("\n")
        assert any(x.startswith("STATUS=serving") for x in ready)
        c = RawClient(port, timeout=10)
        c.send(request_bytes("GET", "/health"))
        r = c.read_head()
        assert r.status == 200 and json.loads(c.read_body(r))["status"] == "ok"
        c.close()
        pings = [sock.recv(4096) for _ in range(3)]
        assert pings.count(b"WATCHDOG=1") >= 2
        proc.send_signal(signal.SIGTERM)
        while (msg := sock.recv(4096)) == b"WATCHDOG=1":
            pass
        assert msg.startswith(b"STOPPING=1")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()


def test_extension_events_flag(tiny_qwen3_tied, cli_server):
    """--extension-events: every stream ends with the metrics and tokens events unless the request opts out."""
    proc, port = cli_server(tiny_qwen3_tied, "--extension-events")
    try:
        def stream(**extra):
            c = RawClient(port)
            c.send(request_bytes("POST", "/v1/chat/completions",
                                 chat_body("Hi", stream=True, max_tokens=3, ignore_eos=True, **extra)))
            r = c.read_head()
            c.read_events(r)
            c.close()
            return [e.get("object") for e in r.json_events()]

        objects = stream()
        assert objects[-2:] == ["chat.completion.metrics", "chat.completion.tokens"]
        assert "chat.completion.metrics" not in stream(stream_options={"include_metrics": False,
                                                                       "include_tokens": False})
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_a_crafted_model_file_is_one_line_and_status_2(tmp_path):
    """Files that fail validation (issue 30): GGUF tensors sharing bytes, a safetensors tensor whose offsets run past
    the file: both modes print one line naming the file, the tensor and the problem, exit status 2."""
    import shutil

    from tests.support.file_fuzz import gguf_layout, put, st_join, st_split
    from tests.support.tiny_files import write_gguf, write_hf_dir
    path = write_gguf(str(tmp_path / "ok.gguf"))
    data = open(path, "rb").read()
    fields = {p.label: p for p in gguf_layout(data)[0]}
    up = int.from_bytes(data[fields["blk.0.ffn_up.weight[offset]"].off:][:8], "little")
    bad = tmp_path / "overlap.gguf"
    bad.write_bytes(put(data, fields["blk.0.ffn_gate.weight[offset]"].off, 8, up))
    hf = write_hf_dir(str(tmp_path / "hf"))
    header, body = st_split(open(os.path.join(hf, "model.safetensors"), "rb").read())
    header["model.norm.weight"]["data_offsets"] = [len(body) - 64, len(body) + 64]
    shutil.copytree(hf, tmp_path / "hf-bad")
    (tmp_path / "hf-bad" / "model.safetensors").write_bytes(st_join(header, body))
    for model, fragments in ((str(bad), (str(bad), "blk.0.ffn_gate.weight", "overlap")),
                             (str(tmp_path / "hf-bad"), ("hf-bad/model.safetensors", "model.norm.weight",
                                                         "outside the"))):
        for args in (["--prompt", "hi"], ["--port", "0"]):
            p = run(["--model", model, *args], timeout=120)
            assert p.returncode == 2, p.stderr
            assert_one_line_error(p, *fragments)
