"""A model directory whose chat template is hostile, served by the real CLI: refused at load with one line and
exit status 2 when a plain conversation already trips the sandbox (the CVE-2024-34359 payload); when only some
request trips it (a bomb behind a trigger word), that request gets a 400 quickly and the server goes on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tests.protocol.test_template_sandbox import CVE_2024_34359, MARK
from tests.support.live_server import LiveServer, RawClient, chat_body, request_bytes


def with_template(src_dir: str, dst: str, template: str) -> str:
    os.makedirs(dst)
    for name in os.listdir(src_dir):
        os.symlink(os.path.join(src_dir, name), os.path.join(dst, name))
    os.remove(os.path.join(dst, "chat_template.jinja"))
    with open(os.path.join(dst, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template)
    return dst


def test_cve_2024_34359_template_is_refused_at_load(tiny_qwen3_tied, tmp_path):
    model = with_template(tiny_qwen3_tied, str(tmp_path / "cve"), CVE_2024_34359)
    for mode in ([], ["--prompt", "hi"]):
        p = subprocess.run([sys.executable, "-m", "appliance", "--model", model, "--port", "0", *mode],
                           capture_output=True, text=True, timeout=120)
        errors = [ln for ln in p.stderr.splitlines() if "error" in ln.lower()]
        assert p.returncode == 2, p.stderr
        assert len(errors) == 1 and "chat template" in errors[0] and "unsafe" in errors[0], p.stderr
        assert "Traceback" not in p.stderr and not os.path.exists(MARK)


def test_a_template_hostile_to_one_request_fails_that_request(tiny_qwen3_tied, tmp_path):
    with open(os.path.join(tiny_qwen3_tied, "chat_template.jinja"), encoding="utf-8") as f:
        real = f.read()
    hostile = ("{% if 'boom' in messages[-1].content %}{% for i in range(100000) %}{% for j in range(100000) %}"
               "{% endfor %}{% endfor %}{% endif %}" + real)
    model = with_template(tiny_qwen3_tied, str(tmp_path / "trigger"), hostile)
    with LiveServer(model) as s:
        def ask(text):
            c = RawClient(s.port, timeout=60)
            try:
                c.send(request_bytes("POST", "/v1/chat/completions", chat_body(text, max_tokens=2)))
                r = c.read_head()
                return r, json.loads(c.read_body(r))
            finally:
                c.close()
        t0 = time.monotonic()
        r, body = ask("boom")
        assert r.status == 400 and "chat template refused" in body["error"]["message"], body
        assert time.monotonic() - t0 < 30
        r, body = ask("hello")
        assert r.status == 200 and body["choices"][0]["message"]["content"] is not None
