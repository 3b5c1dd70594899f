"""Speculative decoding through the CLI and the openai client: drafts from the prompt are on by default, the
streamed text is --spec none's token for token (one SSE event per token), and the figures are reported in the
final chunk's `timings` (llama-server's draft_n / draft_n_accepted) and in /metrics. With --draft-model (the
model drafting for itself: nearly all accepted; another random model of its tokenizer: few) the stream is the
same again; a draft model of another tokenizer is a one-line error, exit status 2."""
import urllib.request

import openai

from tests.support.live_server import drain_stderr

MESSAGES = [{"role": "user", "content": "Say: Sunny in Paris today. Sunny in Paris today."}]


def stream(port: int, **extra):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    with client:
        chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True, max_tokens=20,
                                                      extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                                  **extra}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    timings = [getattr(c, "timings", None) or (c.model_extra or {}).get("timings") for c in chunks]
    return pieces, [t for t in timings if t]


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("kestrel_draft")}


def test_drafts_from_the_prompt_stream_the_same_tokens(cli_server, scripted_qwen3):
    proc, port = cli_server(scripted_qwen3)
    drain_stderr(proc)
    plain_proc, plain_port = cli_server(scripted_qwen3, "--spec", "none")
    drain_stderr(plain_proc)
    pieces, timings = stream(port)
    plain_pieces, plain_timings = stream(plain_port)
    assert "".join(pieces) == " Sunny in Paris today." and pieces == plain_pieces   # one event per token
    assert len(pieces) == 5
    t = timings[-1]
    assert t["draft_n_accepted"] >= 3 and t["draft_n"] >= t["draft_n_accepted"]
    assert "draft_n" not in plain_timings[-1]
    m = metrics(port)
    assert m["kestrel_draft_tokens_accepted_total"] == t["draft_n_accepted"]
    assert m["kestrel_draft_tokens_total"] == t["draft_n"]
    assert metrics(plain_port)["kestrel_draft_tokens_total"] == 0
    # a stop string inside the accepted run ends the text exactly where plain decoding does
    cut, _ = stream(port, stop=[" Paris"])
    assert "".join(cut) == " Sunny in" == "".join(stream(plain_port, stop=[" Paris"])[0])


def test_bad_draft_flags_are_one_line_errors(tmp_path):
    import subprocess
    import sys
    for args, needle in ((["--spec", "eagle"], "invalid choice"), (["--draft-max", "0"], "--draft-max"),
                         (["--draft-min", "5", "--draft-max", "2"], "--draft-min")):
        r = subprocess.run([sys.executable, "-m", "appliance", "--model", str(tmp_path), *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_a_draft_model_streams_the_same_tokens(cli_server, scripted_qwen3, tiny_qwen3_tied):
    greedy = {"temperature": 0, "max_tokens": 20}
    servers = {}
    for name, args in (("plain", ("--spec", "none")), ("itself", ("--draft-model", scripted_qwen3)),
                       ("other", ("-md", tiny_qwen3_tied, "--draft-max", "4"))):
        proc, port = cli_server(scripted_qwen3, *args)
        drain_stderr(proc)
        servers[name] = port
    plain, _ = stream(servers["plain"], **greedy)
    assert "".join(plain) == " Sunny in Paris today."
    for name in ("itself", "other"):
        pieces, timings = stream(servers[name], **greedy)
        assert pieces == plain, name                                    # one event per token, the same tokens
        t = timings[-1]
        if name == "itself":
            assert t["draft_n"] > 0 and t["draft_n_accepted"] >= len(plain) - 2   # the first step is plain
        else:
            assert t.get("draft_n", 0) > 0 and t.get("draft_n_accepted", 0) <= t["draft_n"] // 2
        assert metrics(servers[name])["kestrel_draft_tokens_total"] == t["draft_n"]
        cut, _ = stream(servers[name], stop=[" Paris"], **greedy)
        assert "".join(cut) == " Sunny in"


def test_a_draft_model_of_another_tokenizer_is_refused(scripted_qwen3, tmp_path):
    import subprocess
    import sys

    from tests.support.tiny_files import write_hf_dir
    other = write_hf_dir(str(tmp_path / "other-vocab"))
    for extra in ((), ("--prompt", "Hi")):
        r = subprocess.run([sys.executable, "-m", "appliance", "--model", scripted_qwen3, "--port", "0",
                            "--draft-model", other, *extra], capture_output=True, text=True, timeout=120)
        errors = [line for line in r.stderr.splitlines() if "error:" in line]
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(errors) == 1 and "--draft-model" in errors[0] and "tokenizer" in errors[0], r.stderr
    r = subprocess.run([sys.executable, "-m", "appliance", "--model", scripted_qwen3, "--spec", "none",
                        "--draft-model", scripted_qwen3], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--draft-model" in r.stderr and "Traceback" not in r.stderr


def test_a_draft_differing_in_one_special_flag_is_refused(tiny_qwen3_untied, tmp_path):
    """The same vocabulary, but one added token not spelled <|...|> (<tool_call>) special in the draft's
    tokenizer.json and not in the model's: refused at load, one line naming the token, exit status 2."""
    import json
    import shutil
    import subprocess
    import sys

    draft = str(tmp_path / "special-flag")
    shutil.copytree(tiny_qwen3_untied, draft)
    path = f"{draft}/tokenizer.json"
    with open(path) as f:
        tok = json.load(f)
    entry = next(t for t in tok["added_tokens"] if t["content"] == "<tool_call>")
    assert entry["special"] is False
    entry["special"] = True
    with open(path, "w") as f:
        json.dump(tok, f)
    r = subprocess.run([sys.executable, "-m", "appliance", "--model", tiny_qwen3_untied, "--port", "0",
                        "--draft-model", draft], capture_output=True, text=True, timeout=120)
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(errors) == 1 and "tokenizer" in errors[0] and f"token {entry['id']} is special there" in errors[0], \
        r.stderr


def test_mtp_drafts_report_their_timings(cli_server, tiny_qwen3_5_mtp, tmp_path):
    """--spec mtp on a Qwen3.5 checkpoint whose head is right by construction: the stream is --spec none's, and
    the final chunk's timings and /metrics count the head's drafts, nearly all accepted."""
    from tests.support.tiny_models import make_bigram_with_mtp
    path = make_bigram_with_mtp(tiny_qwen3_5_mtp, str(tmp_path / "bigram"))
    ports = {}
    for name in ("mtp", "none"):
        proc, ports[name] = cli_server(path, "--spec", name)
        drain_stderr(proc)
    greedy = {"temperature": 0, "max_tokens": 20, "ignore_eos": True}
    pieces, timings = stream(ports["mtp"], **greedy)
    plain, plain_timings = stream(ports["none"], **greedy)
    assert pieces == plain and len(pieces) > 5
    t = timings[-1]
    assert t["draft_n"] >= 10 and t["draft_n_accepted"] >= 0.9 * t["draft_n"], t
    assert "draft_n" not in plain_timings[-1]
    m = metrics(ports["mtp"])
    assert m["kestrel_draft_tokens_total"] == t["draft_n"]
    assert m["kestrel_draft_tokens_accepted_total"] == t["draft_n_accepted"]
