"""The chat page in a real browser (Debian's chromium driven by playwright) against the real server on tiny real
checkpoints: streaming event by event, Stop cancelling on the server, 429 / queue display, the API key prompt,
thinking apart, images on Qwen3-VL, safe Markdown, keyboard use, and screenshots at 800x480 and 1920x1080.

Requests go through the page as a user makes them; where a test needs a bounded or greedy answer, a playwright
route adds max_tokens / temperature / ignore_eos to the page's own request body on its way to the real server.
Only the renderer tests answer with a canned SSE stream (a model cannot be made to say `<script>`).
"""
from __future__ import annotations

import base64
import io
import json
import time

import pytest

from tests.support import tiny_models
from tests.support.browser import launch, save_screenshot
from tests.support.live_server import LiveServer, RawClient, chat_body, request_bytes

KEY = "sk-webui-test"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# ---- fixtures ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = launch(p)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(tiny_qwen3_tied):
    with LiveServer(tiny_qwen3_tied, queue=2, queue_keepalive_s=0.05) as s:
        yield s


class Page:
    """A browser page on the chat, with the console watched (a CSP violation or a script error fails the test)
    and the page's own chat requests recorded (and optionally amended)."""

    def __init__(self, browser, url: str, width=1280, height=800, scheme="light", amend=None, canned=None,
                 touch=False):
        self.context = browser.new_context(viewport={"width": width, "height": height}, color_scheme=scheme,
                                           has_touch=touch)
        self.page = self.context.new_page()
        self.problems: list[str] = []
        self.bodies: list[dict] = []
        self.sessions: list[str | None] = []   # each chat request's X-Session-Id
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("console", self._console)
        self.amend = amend or {}
        self.canned = list(canned or [])
        self.page.route("**/v1/chat/completions", self._route)
        self.page.goto(url)

    def _console(self, msg):
        # the browser logs every non-2xx response it fetched; 401/429 are part of these tests
        if msg.type == "error" and "status of 4" not in msg.text:
            self.problems.append(f"console: {msg.text}")

    def _route(self, route):
        body = json.loads(route.request.post_data)
        self.bodies.append(body)
        self.sessions.append(route.request.headers.get("x-session-id"))
        if self.canned:
            return route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=self.canned.pop(0))
        route.continue_(post_data=json.dumps({**body, **self.amend}))

    def __getattr__(self, name):
        return getattr(self.page, name)

    def wait_ready(self):
        self.page.wait_for_selector("#dot.ready", timeout=30000)

    def say(self, text: str):
        """Type a message and send it with the keyboard, as a user does."""
        self.page.focus("#input")
        self.page.keyboard.type(text)
        self.page.keyboard.press("Enter")

    def last_answer(self, timeout=60000):
        self.page.wait_for_selector("#log .msg.bot:last-child:not(.live)", timeout=timeout)
        return self.page.locator("#log .msg.bot").last

    def close(self):
        self.context.close()
        assert not self.problems, self.problems


def sse(*events) -> str:
    out = []
    for e in events:
        out.append(e if isinstance(e, str) and e.startswith(":") else "data: " + (e if isinstance(e, str) else json.dumps(e)))
    return "\n\n".join(out) + "\n\n"


def chunk(content=None, reasoning=None, finish=None, timings=None, role=None):
    delta = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning_content"] = reasoning
    c = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "tiny",
         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if timings:
        c["timings"] = timings
    return c


def canned_answer(reasoning: list[str], content: list[str], timings=None) -> str:
    t = timings or {"prompt_n": 42, "predicted_n": len(content), "ttft_ms": 231.5, "predicted_per_second": 17.25}
    return sse(chunk(role="assistant", content=""), *[chunk(reasoning=r) for r in reasoning],
               *[chunk(content=c) for c in content], chunk(finish="stop", timings=t), "[DONE]")


GROWTH_PROBE = """() => {
  window.__growth = [];
  new MutationObserver(() => {
    const bot = document.querySelector('#log .msg.bot:last-child');
    if (!bot) return;
    const n = bot.querySelector('.md').textContent.length;
    const g = window.__growth;
    if (!g.length || g[g.length - 1][0] !== n) g.push([n, bot.classList.contains('live'), +(bot.dataset.events || 0)]);
  }).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});
}"""


# ---- streaming, stop, keyboard --------------------------------------------------------------------------------

def paced(generate, seconds: float):
    """The engine's generate at a board's pace (the tiny model is far faster than a real one on an RK3588), so that
    events arrive apart, as they do on the board, and the page can be seen taking each one."""
    def run(*args, **kwargs):
        for ev in generate(*args, **kwargs):
            yield ev
            time.sleep(seconds)
    return run


def test_an_answer_streams_event_by_event(browser, server, monkeypatch):
    engine = server.worker.loaded.engine
    monkeypatch.setattr(engine, "generate", paced(engine.generate, 0.03))
    p = Page(browser, server.url + "/", amend={"max_tokens": 40, "ignore_eos": True, "temperature": 0})
    p.wait_ready()
    assert p.inner_text("#model") == server.api_cfg.model_name
    p.evaluate(GROWTH_PROBE)
    p.say("Count from 1 to 20, please.")
    answer = p.last_answer()
    sent = p.bodies[-1]
    assert sent["stream"] is True and sent["messages"] == [{"role": "user", "content": "Count from 1 to 20, please."}]
    assert sent["chat_template_kwargs"] == {"enable_thinking": True}

    # the same request on a raw socket: the text and the number of content events the server sends
    c = RawClient(server.port)
    c.send(request_bytes("POST", "/v1/chat/completions", {**sent, **p.amend}))
    r = c.read_events(c.read_head())
    c.close()
    deltas = [e["choices"][0]["delta"].get("content") for e in r.json_events() if e.get("choices")]
    deltas = [d for d in deltas if d]
    expected = "".join(deltas)
    assert len(deltas) >= 20

    assert int(answer.get_attribute("data-events")) == len(deltas)   # every event reached the page
    assert answer.locator(".md").inner_html() == p.evaluate("s => Markdown.render(s)", expected)
    growth = p.evaluate("window.__growth")
    live = [n for n, is_live, _ in growth if is_live]
    assert len(live) >= len(deltas) // 2, growth                    # it grew while the stream was open ...
    assert live == sorted(live) and len(set(live)) == len(live)     # ... monotonically
    assert live[0] < len(p.evaluate("s => { const d = document.createElement('div'); "
                                    "d.innerHTML = Markdown.render(s); return d.textContent; }", expected))
    status = answer.locator(".status").inner_text()
    assert "TTFT" in status and "tok/s" in status and "40 tokens" in status and "prompt" in status, status
    assert "length limit" in status
    # the second turn carries the first answer as history
    p.say("And again.")
    p.last_answer()
    assert p.bodies[-1]["messages"][1] == {"role": "assistant", "content": expected}
    assert len(p.bodies[-1]["messages"]) == 3
    # both turns carry the conversation's X-Session-Id (a proxy keeps them on one board by it)
    first = p.sessions[0]
    assert first and len(first) == 32 and int(first, 16) >= 0 and p.sessions == [first, first]
    # New chat by keyboard empties the conversation, and the next one has a session of its own
    p.focus("#new")
    p.keyboard.press("Enter")
    assert p.locator("#log .msg").count() == 0 and p.is_visible("#empty")
    assert p.evaluate("document.activeElement.id") == "input"
    p.say("Hello.")
    p.last_answer()
    assert p.sessions[-1] and len(p.sessions[-1]) == 32 and p.sessions[-1] != first
    p.close()


def test_stop_ends_the_generation_on_the_server_within_one_step(browser, server, monkeypatch):
    engine = server.worker.loaded.engine
    monkeypatch.setattr(engine, "generate", paced(engine.generate, 0.02))
    p = Page(browser, server.url + "/chat/", amend={"max_tokens": 3500, "ignore_eos": True})
    p.wait_ready()
    n_before = len(server.traces())
    p.say("Tell me a very long story.")
    p.wait_for_selector("#stop:visible")
    p.wait_for_function("() => +(document.querySelector('#log .msg.bot:last-child').dataset.events || 0) >= 8")
    p.keyboard.press("Escape")                                      # Esc is Stop
    server.wait_for(lambda: len(server.traces()) > n_before, what="the engine to end the job")
    t = server.traces()[n_before]
    assert t.finish_reason == "cancelled" and t.cancel_requested
    assert 8 <= t.tokens < 3500
    assert t.tokens_after_cancel <= 1 and t.polls_after_cancel == 1  # ended within one decode step
    answer = p.last_answer()
    assert answer.locator(".status").inner_text().startswith("Stopped")
    partial = p.evaluate("() => document.querySelector('#log .msg.bot:last-child').dataset.events")
    assert int(partial) >= 8
    assert p.is_visible("#send") and not p.is_visible("#stop")
    # the stopped answer stays in the conversation and the next message is served
    p.amend = {"max_tokens": 5, "ignore_eos": True}
    p.say("Shorter, please.")
    p.last_answer()
    msgs = p.bodies[-1]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"] and msgs[1]["content"]
    p.close()


def test_busy_429_and_waiting_in_line_are_shown(browser, tiny_qwen3_tied, monkeypatch):
    with LiveServer(tiny_qwen3_tied, queue=1, queue_keepalive_s=0.05) as server:
        # At a board's pace, so A still holds the engine when the page retries (on an idle machine the tiny model
        # finished A's 3,500 tokens before the page's Retry-After countdown ended, and the page never waited).
        engine = server.worker.loaded.engine
        monkeypatch.setattr(engine, "generate", paced(engine.generate, 0.02))
        p = Page(browser, server.url + "/", amend={"max_tokens": 6, "ignore_eos": True})
        p.wait_ready()
        a = RawClient(server.port)   # A holds the engine, B holds the one place in line
        a.send(request_bytes("POST", "/v1/chat/completions", chat_body(stream=True, max_tokens=3500, ignore_eos=True)))
        ra = a.read_head()
        a.read_events(ra, stop_after=2)
        b = RawClient(server.port)
        b.send(request_bytes("POST", "/v1/chat/completions", chat_body(stream=True, max_tokens=3)))
        server.wait_for(lambda: server.worker.waiting == 1, what="B to queue")

        p.say("Anyone?")
        p.wait_for_selector("#log .msg.bot.busy")
        p.keyboard.press("Escape")                  # Stop while waiting: the message was not answered, it comes back
        p.wait_for_selector("#log .msg.user.unsent")
        assert p.input_value("#input") == "Anyone?" and p.is_visible("#send")
        p.focus("#new")
        p.keyboard.press("Enter")

        p.say("Are you there?")
        p.wait_for_selector("#log .msg.bot.busy")
        status = p.locator("#log .msg.bot .status")
        assert "busy" in status.inner_text() and "trying again" in status.inner_text()
        assert server.api.requests[("/v1/chat/completions", 429)] >= 1
        p.wait_for_selector("#dot.busy", timeout=10000)                 # the header shows it too (from /health)
        assert "busy" in p.inner_text("#state")
        save_screenshot(p.page, "busy-1280x800")

        b.close()                                                       # a place in line frees up: the page retries
        server.wait_for(lambda: server.worker.waiting == 0, what="B to leave")
        p.wait_for_function("() => document.querySelector('#log .msg.bot .status').textContent.includes('Waiting in line')",
                            timeout=30000)                              # `: queued` comments while A runs
        assert not p.locator("#log .msg.bot").first.get_attribute("data-events")
        a.close()                                                       # A leaves: the page's request runs
        answer = p.last_answer()
        assert "6 tokens" in answer.locator(".status").inner_text()
        assert answer.get_attribute("class") == "msg bot"
        assert [m["content"] for m in p.bodies[-1]["messages"]] == ["Are you there?"]
        p.close()


# ---- thinking ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def thinking_server(tiny_qwen3_tied, tmp_path_factory):
    """The tiny checkpoint with a template that opens <think> in the generation prompt (as thinking-only
    Qwen3 templates do), so what the model writes with thinking on is reasoning_content."""
    d = tiny_models.thinking_copy(tiny_qwen3_tied, str(tmp_path_factory.mktemp("tiny-thinking-web")))
    with LiveServer(d) as s:
        yield s


def test_thinking_is_shown_apart_and_the_switch_turns_it_off(browser, thinking_server):
    p = Page(browser, thinking_server.url + "/", amend={"max_tokens": 12, "ignore_eos": True, "temperature": 0})
    p.wait_ready()
    assert p.is_visible("#think-wrap") and p.is_checked("#think")
    p.say("Think first.")
    answer = p.last_answer()
    think = answer.locator("details.think")
    assert think.is_visible() and think.locator(".think-body").inner_text().strip()
    assert answer.locator(".md").inner_text() == ""                 # all of it was reasoning, none of it answer
    assert think.locator("summary").inner_text().startswith("Thought for")
    # collapsible by keyboard
    was_open = think.evaluate("d => d.open")
    think.locator("summary").focus()
    p.keyboard.press("Enter")
    assert think.evaluate("d => d.open") != was_open
    assert p.bodies[-1]["chat_template_kwargs"] == {"enable_thinking": True}

    p.focus("#think")
    p.keyboard.press("Space")                                       # the switch, by keyboard
    assert not p.is_checked("#think")
    p.say("Now answer directly.")
    answer = p.last_answer()
    assert p.bodies[-1]["chat_template_kwargs"] == {"enable_thinking": False}
    assert answer.locator("details.think").is_hidden()
    assert answer.locator(".md").inner_text().strip()
    # the choice is remembered
    p.reload()
    p.wait_ready()
    assert not p.is_checked("#think")
    p.close()


# ---- the API key ---------------------------------------------------------------------------------------------

def test_the_page_asks_for_the_api_key_once(browser, tiny_qwen3_tied):
    with LiveServer(tiny_qwen3_tied, api_keys=(KEY,)) as server:
        p = Page(browser, server.url + "/", width=800, height=480, amend={"max_tokens": 4, "ignore_eos": True})
        p.wait_for_selector("#keydlg[open]")
        assert "needs an API key" in p.inner_text("#keymsg")
        save_screenshot(p.page, "api-key-800x480")
        p.fill("#key", "sk-wrong")
        p.keyboard.press("Enter")
        p.wait_for_function("() => document.querySelector('#keymsg').textContent.includes('not accepted')")
        assert p.is_visible("#keydlg")
        p.fill("#key", KEY)
        p.keyboard.press("Enter")
        p.wait_for_selector("#keydlg", state="hidden")
        assert p.evaluate("localStorage.getItem('kestrel.apiKey')") == KEY
        p.wait_ready()
        p.say("Hello")
        answer = p.last_answer()
        assert "4 tokens" in answer.locator(".status").inner_text()
        # a reload keeps the key: no question, the chat works at once
        p.reload()
        p.wait_ready()
        p.say("Hello again")
        p.last_answer()
        assert p.locator("#keydlg[open]").count() == 0
        assert server.api.requests[("/v1/chat/completions", 200)] == 2
        p.close()


# ---- images --------------------------------------------------------------------------------------------------

def png(width, height) -> bytes:
    from tests.support.tiny_vl import image_bytes
    return image_bytes(width, height, "PNG")


def test_an_image_is_attached_resized_and_answered_on_qwen3_vl(browser, tmp_path_factory):
    from PIL import Image

    from tests.support.tiny_vl import cached_qwen3_vl
    with LiveServer(cached_qwen3_vl(tmp_path_factory), ctx=1024, prefill_chunk=64) as server:
        limit = server.worker.loaded.model.image_processor.max_pixels
        p = Page(browser, server.url + "/", amend={"max_tokens": 5, "ignore_eos": True})
        p.wait_ready()
        p.wait_for_selector("#attach:visible")
        # the attach button opens the file chooser; two files, then one of them removed again (by keyboard)
        with p.expect_file_chooser() as chooser:
            p.click("#attach")
        chooser.value.set_files([{"name": "wide.png", "mimeType": "image/png", "buffer": png(800, 600)},
                                 {"name": "extra.png", "mimeType": "image/png", "buffer": png(64, 64)}])
        p.wait_for_function("() => document.querySelectorAll('.att').length === 2")
        p.focus(".att:nth-child(2) button")
        p.keyboard.press("Enter")
        p.wait_for_function("() => document.querySelectorAll('.att').length === 1")
        assert p.get_attribute(".att img", "alt") == "wide.png"
        # a second one, dropped on the page
        dropped = base64.b64encode(png(300, 500)).decode()
        dt = p.evaluate_handle("""b64 => {
            const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
            const dt = new DataTransfer();
            dt.items.add(new File([bytes], 'tall.png', {type: 'image/png'}));
            return dt; }""", dropped)
        p.dispatch_event("body", "dragenter", {"dataTransfer": dt})
        assert p.is_visible("#drop")
        p.dispatch_event("body", "drop", {"dataTransfer": dt})
        p.wait_for_function("() => document.querySelectorAll('.att').length === 2")
        assert p.is_hidden("#drop")
        save_screenshot(p.page, "attachments-1280x800")
        p.say("What is in these pictures?")
        answer = p.last_answer()
        assert answer.locator(".error").count() == 0
        assert "image)" in answer.locator(".status").inner_text()
        assert p.locator("#log .msg.user img").count() == 2
        p.wait_for_selector("#dot.ready", timeout=5000)                # the header is back to ready at once
        save_screenshot(p.page, "image-answer-1280x800")

        parts = p.bodies[-1]["messages"][0]["content"]
        assert [x["type"] for x in parts] == ["image_url", "image_url", "text"]
        for part, (w0, h0) in zip(parts, [(800, 600), (300, 500)]):
            url = part["image_url"]["url"]
            assert url.startswith("data:image/jpeg;base64,")
            img = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
            assert img.width * img.height <= limit < w0 * h0                 # resized in the browser ...
            assert abs(img.width / img.height - w0 / h0) < 0.02               # ... keeping its shape
        trace = server.traces()[-1]
        assert trace.finish_reason == "length"
        p.close()


def test_a_text_model_refuses_a_dropped_image(browser, server):
    p = Page(browser, server.url + "/")
    p.wait_ready()
    assert p.is_hidden("#attach")
    dt = p.evaluate_handle("""() => { const dt = new DataTransfer();
        dt.items.add(new File([new Uint8Array([137, 80, 78, 71])], 'x.png', {type: 'image/png'})); return dt; }""")
    p.dispatch_event("body", "drop", {"dataTransfer": dt})
    p.wait_for_selector("#notice")
    assert "does not read images" in p.inner_text("#notice") and p.locator(".att").count() == 0
    p.evaluate("() => document.getElementById('notice').remove()")
    p.evaluate("""() => { const dt = new DataTransfer();
        dt.items.add(new File([new Uint8Array([137, 80, 78, 71])], 'x.png', {type: 'image/png'}));
        document.getElementById('input').dispatchEvent(new ClipboardEvent('paste', {clipboardData: dt})); }""")
    p.wait_for_selector("#notice")                                   # pasted: the same answer
    assert "does not read images" in p.inner_text("#notice") and p.locator(".att").count() == 0
    p.close()


# ---- safe rendering --------------------------------------------------------------------------------------------

HOSTILE = ["Here: <scr", "ipt>window.__pwned=1</script> and <img src=x onerror=\"window.__pwned=2\">", "\n\n",
           "[click](javascript:window.__pwned=3) <a href=\"javascript:alert(1)\">x</a> ",
           "<iframe src=\"http://example.invalid/\"></iframe> <svg onload=\"window.__pwned=4\"></svg>\n\n",
           "**bold <b>not bold tag</b>** and `<i>code</i>`\n\n",
           "```html\n</code></pre><script>window.__pwned=5</script>\n```\n"]

ALLOWED = {"P": set(), "BR": set(), "H3": set(), "H4": set(), "H5": set(), "H6": set(), "STRONG": set(), "EM": set(),
           "DEL": set(), "CODE": {"class"}, "PRE": set(), "UL": set(), "OL": {"start"}, "LI": set(), "BLOCKQUOTE": set(),
           "HR": set(), "DIV": {"class"}, "TABLE": set(), "THEAD": set(), "TBODY": set(), "TR": set(),
           "TH": {"class"}, "TD": {"class"}, "A": {"href", "target", "rel"}}

TAGS_PROBE = """root => [...root.querySelectorAll('*')].map(e => [e.tagName, e.getAttributeNames(),
                                                                 e.getAttribute('href')])"""


def assert_only_safe_markup(tags):
    for tag, attrs, href in tags:
        assert tag in ALLOWED and set(attrs) <= ALLOWED[tag], (tag, attrs)
        if tag == "A":
            assert href.startswith(("http://", "https://")), href


def test_model_output_is_text_not_markup(browser, server):
    p = Page(browser, server.url + "/", canned=[canned_answer(["Let me see", " what <b>they</b> want."], HOSTILE)])
    p.wait_ready()
    p.say("<script>window.__pwned=6</script><img src=x onerror=window.__pwned=7>")
    answer = p.last_answer()
    p.wait_for_timeout(300)
    assert p.evaluate("window.__pwned") is None
    log = p.locator("#log")
    assert log.locator("script, img, iframe, svg, [onerror], [onload]").count() == 0
    assert_only_safe_markup(log.locator(".md").evaluate(TAGS_PROBE))
    text = answer.locator(".md").inner_text()
    assert '<script>window.__pwned=1</script> and <img src=x onerror="window.__pwned=2">' in text
    assert "[click](javascript:window.__pwned=3)" in text and '<a href="javascript:alert(1)">x</a>' in text
    assert "</code></pre><script>window.__pwned=5</script>" in answer.locator("pre code.lang-html").inner_text()
    assert answer.locator("strong").inner_text() == "bold <b>not bold tag</b>"
    assert answer.locator("p code").inner_text() == "<i>code</i>"
    assert p.inner_text("#log .msg.user") == "<script>window.__pwned=6</script><img src=x onerror=window.__pwned=7>"
    assert answer.locator(".think-body").text_content() == "Let me see what <b>they</b> want."
    p.close()


def test_the_renderer_on_markdown_and_on_random_hostile_input(browser, server):
    p = Page(browser, server.url + "/")
    render = lambda s: p.evaluate("s => Markdown.render(s)", s)
    assert render("Hello **world** and *you*, `x<y`") == \
        "<p>Hello <strong>world</strong> and <em>you</em>, <code>x&lt;y</code></p>"
    assert render("# Title\n\n- a\n- b\n  1. c\n\n3. three\n4. four") == (
        "<h3>Title</h3><ul><li>a</li><li>b<ol><li>c</li></ol></li></ul><ol start=\"3\"><li>three</li><li>four</li></ol>")
    assert render("```py\nif a < b:\n    pass\n```") == '<pre><code class="lang-py">if a &lt; b:\n    pass</code></pre>'
    assert render("```\nunclosed <b>") == "<pre><code>unclosed &lt;b&gt;</code></pre>"   # mid-stream
    assert render("| a | b |\n|:--|--:|\n| 1 | **2** |") == (
        '<div class="table"><table><thead><tr><th class="al-left">a</th><th class="al-right">b</th></tr></thead>'
        '<tbody><tr><td class="al-left">1</td><td class="al-right"><strong>2</strong></td></tr></tbody></table></div>'
        .replace(' class="al-left"', ""))
    assert render("> quoted\n> more") == "<blockquote><p>quoted<br>more</p></blockquote>"
    assert render("[site](https://example.org/a_b?x=1&y=2)") == (
        '<p><a href="https://example.org/a_b?x=1&amp;y=2" target="_blank" rel="noopener noreferrer">site</a></p>')
    assert render('[x](https://a/"onmouseover="alert)') == (
        '<p><a href="https://a/&quot;onmouseover=&quot;alert" target="_blank" rel="noopener noreferrer">x</a></p>')
    assert render("snake_case_name and 2*3*4") == "<p>snake_case_name and 2*3*4</p>"
    assert render("a\u0001 0\u0002b") == "<p>a 0b</p>"                # placeholder marks cannot be forged
    # a few thousand random documents made of Markdown and HTML pieces: only the renderer's own markup comes out
    tags = p.evaluate("""() => {
        const bits = ['<script>', '</script>', '<img src=x onerror=alert(1)>', '"', "'", '`', '```', '**', '*', '_',
                      '~~', '[a](', 'https://x/', 'javascript:', ')', '|', '|--|', '\\n', '\\n\\n', '- ', '1. ', '> ',
                      '# ', '<', '>', '&', '&lt;', '\\u0001', '\\u0002', '0', 'text ', '    ', 'on', '=', '<a href=x>'];
        let seed = 12345;
        const rnd = n => (seed = (seed * 1103515245 + 12345) % 2147483648) % n;
        const out = [], root = document.createElement('div');
        for (let k = 0; k < 3000; k++) {
            let s = '';
            for (let j = rnd(40); j >= 0; j--) s += bits[rnd(bits.length)];
            root.innerHTML = Markdown.render(s);
            for (const e of root.querySelectorAll('*')) out.push([e.tagName, e.getAttributeNames(), e.getAttribute('href')]);
        }
        return out; }""")
    assert len(tags) > 1000
    assert_only_safe_markup(tags)
    assert p.evaluate("window.__pwned") is None
    p.close()


# ---- looks: kiosk sizes, light and dark -------------------------------------------------------------------------

RICH = ["Sure. Here is how to **check the board's temperature**:\n\n",
        "1. Open a terminal.\n2. Read the thermal zones:\n\n",
        "```sh\ncat /sys/class/thermal/thermal_zone*/temp\n```\n\n",
        "| zone | meaning |\n|---|---|\n| 0 | SoC |\n| 1 | big cores |\n\n",
        "Values are in *millidegrees*; `45000` means 45 °C."]


@pytest.mark.parametrize("width,height,scheme", [(800, 480, "light"), (800, 480, "dark"), (1920, 1080, "light"),
                                                 (1920, 1080, "dark"), (3840, 2160, "light")])
def test_kiosk_sizes_and_screenshots(browser, server, width, height, scheme):
    timings = {"prompt_n": 64, "predicted_n": 71, "ttft_ms": 412.0, "predicted_per_second": 18.4, "cache_n": 48}
    p = Page(browser, server.url + "/", width=width, height=height, scheme=scheme,
             canned=[canned_answer(["The user wants the SoC temperature. ", "Thermal zones are in sysfs."], RICH, timings)],
             touch=width <= 800)
    p.wait_ready()
    save_screenshot(p.page, f"empty-{width}x{height}-{scheme}")
    if width <= 800:   # a touch panel: tap the field, type, tap Send
        p.tap("#input")
        p.keyboard.type("How hot is the board?")
        p.tap("#send")
        answer = p.last_answer()
    else:
        p.say("How hot is the board?")
        answer = p.last_answer()
    assert "TTFT 412 ms · 18.4 tok/s · 71 tokens · prompt 64 · 48 reused" == answer.locator(".status").inner_text()
    # the view followed the answer to its end (the first screenshot shows its top)
    p.wait_for_function("() => { const l = document.getElementById('log'); "
                        "return l.scrollHeight - l.scrollTop - l.clientHeight < 2; }", timeout=5000)
    if width <= 800:   # the thinking block opens and shuts by touch
        p.tap("details.think summary")
        assert answer.locator("details.think").evaluate("d => d.open")
        p.tap("details.think summary")
        assert not answer.locator("details.think").evaluate("d => d.open")
    p.evaluate("document.getElementById('log').scrollTop = 0")
    save_screenshot(p.page, f"chat-{width}x{height}-{scheme}")
    # fits: no sideways scrolling, the composer and the header are on screen
    assert p.evaluate("document.documentElement.scrollWidth") <= width
    for sel in ("#composer", ".bar"):
        box = p.locator(sel).bounding_box()
        assert box["y"] >= 0 and box["y"] + box["height"] <= height + 0.5 and box["width"] <= width
    # touch: every control is at least 44 CSS pixels tall, none is hover-only
    for sel in ("#send", "#new", "#think-wrap", "details.think summary"):
        assert p.locator(sel).first.bounding_box()["height"] >= 44, sel
    font = p.evaluate("parseFloat(getComputedStyle(document.body).fontSize)")
    assert font >= 17 and (width < 3000 or font >= 28)
    # keyboard: Tab walks the controls in order
    p.focus("#think")
    order = []
    for _ in range(4):
        p.keyboard.press("Tab")
        order.append(p.evaluate("document.activeElement.id || document.activeElement.tagName"))
    assert order == ["new", "SUMMARY", "input", "send"], order
    p.close()


def test_real_model_output_renders_only_safe_markup(browser, server):
    p = Page(browser, server.url + "/", width=1920, height=1080, amend={"max_tokens": 120, "ignore_eos": True})
    p.wait_ready()
    p.say("Write anything.")
    answer = p.last_answer()
    assert answer.locator(".md").inner_text().strip()
    assert_only_safe_markup(answer.locator(".md").evaluate(TAGS_PROBE))
    save_screenshot(p.page, "tiny-model-1920x1080")
    p.close()


def test_a_scripted_model_thinks_then_answers(browser, scripted_qwen3):
    """A real checkpoint whose greedy output is scripted (tests/support/scripted_model.py): with thinking on it
    thinks "Let me check" and then writes a tool call as text (no tools were offered), which must show as text;
    with thinking off it answers " Sunny in Paris today."."""
    from tests.support.scripted_model import ANSWER, CALL_TEXT, THINKING
    with LiveServer(scripted_qwen3) as server:
        p = Page(browser, server.url + "/", amend={"temperature": 0})
        p.wait_ready()
        p.say("What is the weather in Paris?")
        answer = p.last_answer()
        assert answer.locator(".think-body").text_content() == THINKING
        assert answer.locator(".md").inner_text() == f"<tool_call>{CALL_TEXT}</tool_call>"
        assert answer.locator(".md *").count() == 1 and answer.locator(".md p").count() == 1
        p.focus("#think")
        p.keyboard.press("Space")
        p.say("And without thinking?")
        answer = p.last_answer()
        assert answer.locator(".md").inner_text() == ANSWER.strip() and answer.locator("details.think").is_hidden()
        save_screenshot(p.page, "scripted-model-1280x800")
        p.close()


# ---- Qwen3.5 -----------------------------------------------------------------------------------------------------

def test_qwen3_5_answers_stream_and_the_second_turn_reuses_the_first(browser, tiny_qwen3_5):
    """The page served by the hybrid Qwen3.5 (Gated DeltaNet): the answer arrives event by event as the server
    sends it, and the follow-up turn resumes from the recurrent-state snapshot (the status says how much of its
    prompt was reused)."""
    with LiveServer(tiny_qwen3_5, prefill_chunk=16) as server:
        p = Page(browser, server.url + "/", amend={"max_tokens": 24, "ignore_eos": True, "temperature": 0})
        p.wait_ready()
        assert p.inner_text("#model") == server.api_cfg.model_name
        p.say("Name a river in France.")
        answer = p.last_answer()
        sent = p.bodies[-1]
        c = RawClient(server.port)                   # the same request on a raw socket: the events the server sends
        c.send(request_bytes("POST", "/v1/chat/completions", {**sent, **p.amend}))
        r = c.read_events(c.read_head())
        c.close()
        deltas = [e["choices"][0]["delta"].get("content") for e in r.json_events() if e.get("choices")]
        deltas = [d for d in deltas if d]
        expected = "".join(deltas)
        assert len(deltas) >= 12
        assert int(answer.get_attribute("data-events")) == len(deltas)
        assert answer.locator(".md").inner_html() == p.evaluate("s => Markdown.render(s)", expected)
        assert "24 tokens" in answer.locator(".status").inner_text()

        p.say("And a mountain?")
        second = p.last_answer()
        assert p.bodies[-1]["messages"][1] == {"role": "assistant", "content": expected}
        status = second.locator(".status").inner_text()
        prompt_n, reused = (int(s.split()[1 if s.startswith("prompt") else 0]) for s in status.split(" · ")
                            if s.startswith("prompt") or s.endswith("reused"))
        assert 0 < reused < prompt_n, status
        p.close()
