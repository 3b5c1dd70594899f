"""Hostile chat templates (engine/template_sandbox.py, chat_template.py): the CVE-2024-34359 payload, the known
Jinja SSTI escapes and resource bombs all end in a clear UnsafeTemplateError (a 400 at request time; at load,
ChatTemplate.vet fails the load), quickly, with nothing run and no memory blown; real templates still render."""
from __future__ import annotations

import os
import resource
import time

import pytest

from appliance.engine import template_sandbox as ts
from appliance.engine.chat_template import ChatTemplate, ChatTemplateError, UnsafeTemplateError

MSGS = [{"role": "user", "content": "Hi"}]
MARK = "/tmp/kestrel-ssti-pwned"

# CVE-2024-34359 (llama-cpp-python): a GGUF's tokenizer.chat_template reaching os.popen through __subclasses__
CVE_2024_34359 = ("{% for x in ().__class__.__base__.__subclasses__() %}{% if \"warning\" in x.__name__ %}"
                  "{{x()._module.__builtins__['__import__']('os').popen(\"touch " + MARK + "\")}}{%endif%}"
                  "{% endfor %}")

ESCAPES = {
    "cve-2024-34359": CVE_2024_34359,
    "mro": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "class-base": "{{ messages.__class__.__base__ }}",
    "self-globals": "{{ self.__init__.__globals__.__builtins__ }}",
    "template-reference": "{{ self._TemplateReference__context }}",
    "cycler": "{{ cycler.__init__.__globals__.os.popen('touch " + MARK + "').read() }}",
    "joiner": "{{ joiner.__init__.__globals__.__builtins__.__import__('os') }}",
    "namespace-globals": "{{ namespace.__init__.__globals__ }}",
    "namespace-underscore": "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "lipsum": "{{ lipsum.__globals__['os'].popen('touch " + MARK + "').read() }}",
    "raise-exception-globals": "{{ raise_exception.__globals__ }}",
    "attr-filter": "{{ (messages | attr('__class__')).__mro__ }}",
    "format-attribute": "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "dict-class": "{{ dict.__class__.__init__.__globals__ }}",
    "mutate": "{{ messages.append(1) }}{{ messages[0].update({'role': 'x'}) }}",
    "strftime-globals": "{{ strftime_now.__globals__ }}",
    "tojson-globals": "{{ (messages|tojson).__class__ }}",
}

BOMBS = {
    "string-product": "{{ 'A' * 100000000000 }}",
    "string-product-split": "{% set n = 10000 %}{{ 'A' * n * n * n }}",
    "list-product": "{{ [1, 2] * 1000000000 }}",
    "power": "{{ 99 ** 999999 }}",
    "power-split": "{% set n = 2 ** 64 %}{{ n ** 100000 }}",
    "range-too-big": "{% for i in range(10**10) %}{% endfor %}",
    "range-nested": ("{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}"
                     "{% endfor %}{% endfor %}{% endfor %}"),
    "range-nested-output": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "block-set-bomb": "{% set s %}{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}"
                      "{% endfor %}{% endset %}{{ s|length }}",
    "recursion": "{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}",
    "exponential-recursion": ("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                              "{{ f(60) }}"),
    "namespace-doubling": ("{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                           "{% endfor %}{{ ns.s|length }}"),
    "top-level-doubling": "{% set s = 'x' * 1000000 %}" + "{% set s = s ~ s %}" * 40 + "{{ s|length }}",
    "concat-plus": "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                   "{% endfor %}",
    "replace-bomb": "{{ ('x' * 100000)|replace('x', 'y' * 100000) }}",
    "replace-method-bomb": "{{ ('x' * 100000).replace('', 'y' * 100000) }}",
    "replace-chain": "{{ 'aaaa'" + "|replace('a', 'aaaa')" * 20 + " }}",
    "center": "{{ 'x'|center(1000000000) }}",
    "ljust": "{{ 'x'.ljust(1000000000) }}",
    "format-width": "{{ '%01000000000d' % 1 }}",
    "format-star": "{{ '%*d' % (1000000000, 1) }}",
    "format-method-width": "{{ '{:>1000000000}'.format(1) }}",
    "format-filter": "{{ '%01000000000d'|format(1) }}",
    "batch-fill": "{{ [1]|batch(1000000000, 0)|list|length }}",
    "tojson-indent": "{{ messages|tojson(indent=1000000000) }}",
    "join-bomb": "{% for i in range(100000) %}{{ ('x' * 1000000)|join('y') }}{% endfor %}",
    "deep-nesting": "{{ " + "(" * 20000 + "1" + ")" * 20000 + " }}",
    "huge-source": "x" * (ts.MAX_SOURCE + 1),
}


@pytest.fixture(autouse=True)
def no_mark():
    if os.path.exists(MARK):
        os.remove(MARK)
    yield
    assert not os.path.exists(MARK), "a template ran a command"


def refused(source: str, messages=MSGS, kind: type = UnsafeTemplateError) -> str:
    t0 = time.thread_time()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(kind) as e:
        ChatTemplate(source).render(messages, add_generation_prompt=True)
    spent = time.thread_time() - t0
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert spent < ts.TIME_BUDGET_S + 2.0, spent
    assert grown_mb < 1200, grown_mb
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(("chat template refused", "chat template 'default'",
                                                "chat template error")), msg
    return msg


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_ssti_escapes_are_refused(name):
    # lipsum is not there at all: an undefined name, an ordinary template error
    msg = refused(ESCAPES[name], kind=ChatTemplateError if name == "lipsum" else UnsafeTemplateError)
    assert "unsafe" in msg or "not safely callable" in msg or "underscore" in msg or "undefined" in msg, msg


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_resource_bombs_are_refused_within_the_budget(name):
    msg = refused(BOMBS[name])
    assert any(w in msg for w in ("limit", "steps", "longer than", "recursed", "Range too big", "nested",
                                  "characters", "asked for", "integer", "format width")), msg


def test_the_time_budget_is_cpu_time(monkeypatch):
    monkeypatch.setattr(ts, "TIME_BUDGET_S", 0.2)
    monkeypatch.setattr(ts, "MAX_STEPS", 10**12)
    t0 = time.perf_counter()
    msg = refused("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    assert "longer than 0.2 s" in msg and time.perf_counter() - t0 < 10


def test_vet_refuses_hostile_templates_at_load_and_passes_ordinary_errors():
    with pytest.raises(UnsafeTemplateError):
        ChatTemplate(CVE_2024_34359).vet()
    # hostile only when tools are given: the load-time tool probe finds it
    with pytest.raises(UnsafeTemplateError):
        ChatTemplate("{% if tools %}{{ 'x' * 10**12 }}{% endif %}ok").vet()
    # an ordinary refusal of some conversations is not hostile
    t = ChatTemplate("{% if messages[0].role == 'system' %}{{ raise_exception('no system') }}{% endif %}"
                     "{{ messages[-1].content }}")
    t.vet()
    with pytest.raises(ChatTemplateError) as e:
        t.render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert not isinstance(e.value, UnsafeTemplateError)


def test_real_templates_and_big_prompts_render(qwen3_chat_template):
    t = ChatTemplate(qwen3_chat_template)
    t.vet()
    big = "word " * 800_000    # a 4 MB prompt: well inside the budget
    t0 = time.thread_time()
    out = t.render([{"role": "system", "content": "s"}, {"role": "user", "content": big}] * 3)
    assert big in out and time.thread_time() - t0 < ts.TIME_BUDGET_S / 2
    # loops, namespaces, filters and formatting that real templates use still work
    t = ChatTemplate("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                     "{{ loop.index }}:{{ m.role|upper }}{{ '%-6s|' % m.role }}{{ '{:>3}'.format(ns.n) }}"
                     "{% endfor %}{{ (messages|tojson(indent=2))|length > 0 }}{{ range(3)|join(',') }}")
    assert t.render(MSGS * 2) == "1:USERuser  |  12:USERuser  |  2True0,1,2"
