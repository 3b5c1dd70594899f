"""The chat template's sandbox and budget: a model file's Jinja template is untrusted code.

Policies:
- Templates run in jinja2's ImmutableSandboxedEnvironment: no attribute starting with `_` (so no `__class__`,
  `__mro__`, `__subclasses__`, `__globals__`: the CVE-2024-34359 payload's road), no mutation of lists and dicts,
  only safe callables. The globals are the render variables plus transformers' helpers (chat_template.py);
  jinja's `lipsum` is removed, `cycler`/`joiner` stay (their internals are `_`/`__` names, out of reach).
- Every render has a budget, checked from inside the template's own execution (so a hostile template cannot
  hang a request or the loader, nor fill the memory):
  * time: at most TIME_BUDGET_S of the rendering thread's CPU time (machine load does not count against it);
  * steps: at most MAX_STEPS calls, operators, concatenations and loop iterations (`range` bombs, nested
    loops, exponential macro recursion); deep recursion ends in Python's RecursionError;
  * size: no value made by an operator, call, filter or `~` larger than MAX_VALUE characters/items, refused
    before it is made where the size is known in advance (`'x' * N`, `[..] * N`, `**`, str.replace, padding
    widths); no integer argument above MAX_INT_ARG (padding, indent, batch, tojson indent ...); all values made
    together at most MAX_MADE; the output at most MAX_OUTPUT characters; the source at most MAX_SOURCE.
- A violation raises TemplateRefused (a jinja SecurityError): the request gets a 400, a load-time check of the
  template (ChatTemplate.vet) fails the load with one line.
- Loops and concatenations are budgeted by rewriting the parsed template (For.iter and Concat nodes wrapped in
  a budget filter) before it is compiled; calls, operators and filters through the sandbox's hooks.
"""
from __future__ import annotations

import functools
import re
import threading
import time
from typing import Any, Iterator

import jinja2
import jinja2.nodes
import jinja2.visitor
from jinja2.sandbox import ImmutableSandboxedEnvironment

TIME_BUDGET_S = 3.0
MAX_STEPS = 5_000_000
MAX_VALUE = 32 * 1024 * 1024
MAX_MADE = 256 * 1024 * 1024
MAX_OUTPUT = 64 * 1024 * 1024
MAX_SOURCE = 1024 * 1024
MAX_INT_ARG = 1_000_000
MAX_INT_BITS = 100_000
_CHECK_EVERY = 256
_FORMAT_WIDTH = re.compile(r"[%:{][^%:{}]*?\d{7,}")
_BUDGET_FILTER = "kestrel_budget"


class TemplateRefused(jinja2.exceptions.SecurityError):
    """The template tried something the sandbox forbids or went over its budget."""


class Budget:
    def __init__(self) -> None:
        self.deadline = time.thread_time() + TIME_BUDGET_S
        self.steps = 0
        self.made = 0
        self.output = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps % _CHECK_EVERY == 0:
            if self.steps > MAX_STEPS:
                raise TemplateRefused(f"the chat template took more than {MAX_STEPS} steps")
            if time.thread_time() > self.deadline:
                raise TemplateRefused(f"the chat template ran longer than {TIME_BUDGET_S:g} s")

    def made_value(self, value: Any) -> Any:
        if isinstance(value, (str, bytes, list, tuple, dict)):
            n = len(value)
            if n > MAX_VALUE:
                raise TemplateRefused(f"the chat template made a value of {n} items (limit {MAX_VALUE})")
            self.made += n
            if self.made > MAX_MADE:
                raise TemplateRefused(f"the chat template made more than {MAX_MADE} characters in all")
        elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise TemplateRefused(f"the chat template made an integer of {value.bit_length()} bits")
        return value

    def wrote(self, chunk: str) -> str:
        self.output += len(chunk)
        if self.output > MAX_OUTPUT:
            raise TemplateRefused(f"the chat template's output passed {MAX_OUTPUT} characters")
        self.step()
        return chunk


_local = threading.local()


def current() -> Budget | None:
    return getattr(_local, "budget", None)


def run_budgeted(chunks: Iterator[str]) -> str:
    """Join a template's output chunks (Template.generate) under a fresh budget."""
    budget = Budget()
    outer, _local.budget = current(), budget
    try:
        return "".join(budget.wrote(c) for c in chunks)
    finally:
        _local.budget = outer


def _step() -> Budget | None:
    b = current()
    if b is not None:
        b.step()
    return b


def _made(b: Budget | None, value: Any) -> Any:
    return value if b is None else b.made_value(value)


def _check_args(args: tuple, kwargs: dict) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_INT_ARG:
            raise TemplateRefused(f"the chat template passed the integer {a} (limit {MAX_INT_ARG})")


def _check_format(fmt: Any) -> None:
    if isinstance(fmt, str) and _FORMAT_WIDTH.search(fmt):
        raise TemplateRefused("the chat template asked for a format width of millions of characters")


def _check_replace(s: Any, old: Any, new: Any) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        count = s.count(old) if old else len(s) + 1
        if len(s) + count * (len(new) - len(old)) > MAX_VALUE:
            raise TemplateRefused("the chat template asked for a replace() result over the size limit")


def _predicted_size(op: str, left: Any, right: Any) -> int:
    """The size of the result of `left op right` where it can be known before making it (else 0)."""
    if op == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
            return len(seq) * max(n, 0)
    if op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if left.bit_length() * right > MAX_INT_BITS:
            raise TemplateRefused(f"the chat template asked for {left} ** {right}")
    return 0


def _bounded(b: Budget | None, value: Any) -> Any:
    """The budget filter the rewritten template calls on every loop's iterable and every `~` result."""
    if b is None:
        return value
    if isinstance(value, str):
        return b.made_value(value)

    def each() -> Iterator[Any]:
        for item in value:
            b.step()
            yield item
    return value if isinstance(value, jinja2.Undefined) else each()


def _wrap_filter(f: Any) -> Any:
    @functools.wraps(f)
    def budgeted(*args: Any, **kwargs: Any) -> Any:
        b = _step()
        _check_args(args, kwargs)
        if f.__name__ == "do_format" and args:
            _check_format(args[0])
        if f.__name__ == "do_replace" and len(args) >= 4:   # (eval_ctx, s, old, new)
            _check_replace(args[1], args[2], args[3])
        return _made(b, f(*args, **kwargs))
    return budgeted


class _Budgeting(jinja2.visitor.NodeTransformer):
    """Wrap every for-loop's iterable and every `~` in the budget filter."""

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        self.generic_visit(node)
        node.iter = jinja2.nodes.Filter(node.iter, _BUDGET_FILTER, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        self.generic_visit(node)
        return jinja2.nodes.Filter(node, _BUDGET_FILTER, [], [], None, None, lineno=node.lineno)


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment whose operators, calls, filters, loops and `~` count against the render's
    Budget."""

    intercepted_binops = frozenset({"*", "**", "%", "+", "//"})

    def __init__(self, **options: Any):
        super().__init__(optimized=False, **options)   # no constant folding: it would run filters at compile time,
        #                                                 outside any render's budget
        self.globals.pop("lipsum", None)
        self.filters = {name: _wrap_filter(f) for name, f in self.filters.items()}
        self.filters[_BUDGET_FILTER] = lambda value: _bounded(current(), value)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        """An unsafe attribute (`__class__`, `_private`, a function's globals) fails at once, not when used."""
        raise TemplateRefused(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    def set_filter(self, name: str, f: Any) -> None:
        self.filters[name] = _wrap_filter(f)

    def compile_source(self, source: str) -> jinja2.Template:
        if len(source) > MAX_SOURCE:
            raise TemplateRefused(f"the chat template is {len(source)} characters long (limit {MAX_SOURCE})")
        tree = _Budgeting().visit(self.parse(source))
        return self.from_string(tree)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _step()
        if _predicted_size(operator, left, right) > MAX_VALUE:
            raise TemplateRefused(f"the chat template asked for a value of {_predicted_size(operator, left, right)} "
                                  f"items (limit {MAX_VALUE})")
        if operator == "%" and isinstance(left, str):
            _check_format(left)
            _check_args(right if isinstance(right, tuple) else (right,), {})
        return _made(b, super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        b = _step()
        _check_args(args, kwargs)
        target = getattr(__obj, "__wrapped__", __obj)      # str.format comes wrapped by the sandbox
        owner = getattr(target, "__self__", None)
        name = getattr(target, "__name__", "")
        if isinstance(owner, str):
            if name in ("format", "format_map"):
                _check_format(owner)
            elif name == "replace" and len(args) >= 2:
                _check_replace(owner, args[0], args[1])
        return _made(b, super().call(__context, __obj, *args, **kwargs))
