"""A Jinja sandbox with a budget: chat templates come with downloaded models, so a render is bounded in time and size.

Jinja's ``ImmutableSandboxedEnvironment`` (what ``transformers`` renders chat templates in) stops a template from
touching Python objects, but not from running forever or asking for a terabyte: two nested ``range(100000)``
loops hang, ``{{ 'a' * 10**12 }}`` raises MemoryError. :class:`BoundedSandbox` subclasses it, the way Jinja's
sandbox documentation suggests (``intercepted_binops``/``call_binop``, ``call``, ``code_generator_class``), and gives
every render a :class:`Budget` of :data:`RENDER_SECONDS` of wall time and :data:`RENDER_CHARS` characters:

- every loop's iterable is wrapped (the code generator's ``for``) so that each iteration checks the clock, and so
  does every call (macros and recursive loops included) and every chunk of output;
- ``*``, ``**`` and ``%`` are intercepted (which also keeps them out of compile-time constant folding): a repeat,
  power or format that would exceed the size budget is refused before it is computed; every call, filter and
  ``~`` concatenation refuses an integer argument or a result beyond it;
- ``{% include %}``, ``{% import %}`` and ``{% extends %}`` have no templates to load: a one-line refusal, not
  Jinja's "no loader" TypeError.

Going over a budget raises jinja2's ``SecurityError`` (a ``TemplateError``), which ``core.data.chat`` turns into one
``error:`` line.
"""
from __future__ import annotations

import functools
import math
import time

from jinja2 import BaseLoader, TemplateNotFound, nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_SECONDS = 5.0      # wall time of one render (real chat templates take milliseconds)
RENDER_CHARS = 2**24      # characters of one render's output, and of any string or list it builds
FORMATS = ("format", "format_map")   # str methods whose receiver is a format string
POWER_DIGITS = 4300       # digits of an integer power: Python's own limit for turning an int into text


class Budget:
    """The time and size left to one render."""

    def __init__(self, seconds: float | None = None, chars: int | None = None):
        self.seconds = RENDER_SECONDS if seconds is None else seconds
        self.chars = RENDER_CHARS if chars is None else chars
        self.deadline = time.monotonic() + self.seconds

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise SecurityError(f"the template ran longer than its {self.seconds:g} s budget (a loop too long?)")

    def size(self, n: int, what: str) -> None:
        if n > self.chars:
            raise SecurityError(f"{what} of {n:,} exceeds the template's budget of {self.chars:,} characters")

    def sized(self, value):
        if isinstance(value, (str, list, tuple, dict)):
            self.size(len(value), "a value")
        return value

    def format_string(self, text) -> None:
        """Refuse a format string (``%``, ``str.format``, the ``format`` filter) with a width beyond the budget."""
        if isinstance(text, str):
            for digits in _digit_runs(text):
                self.size(int(digits) if len(digits) < 12 else self.chars + 1, "a format width")

    def arguments(self, args, kwargs) -> None:
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.chars:
                self.size(abs(a), "an integer argument")


class _NoTemplates(BaseLoader):
    def get_source(self, environment, template):
        raise TemplateNotFound(template, f"a chat template cannot include, import or extend other templates "
                                         f"({template!r})")


class _BoundedCode(CodeGenerator):
    """Jinja's code generator, with every loop's iterable passed through ``environment.bounded_iter`` and every
    ``~`` concatenation's result through the budget's size check."""

    def visit_For(self, node, frame):
        node.iter = nodes.Call(nodes.EnvironmentAttribute("bounded_iter"), [node.iter], [], None, None)
        super().visit_For(node, frame)

    def visit_Concat(self, node, frame):
        self.write("environment.budget.sized(")
        super().visit_Concat(node, frame)
        self.write(")")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """``ImmutableSandboxedEnvironment`` whose renders run under :attr:`budget` (set a fresh :class:`Budget` before
    each render: :meth:`render`)."""
    code_generator_class = _BoundedCode
    intercepted_binops = frozenset({"*", "**", "%"})

    def __init__(self, **options):
        super().__init__(loader=_NoTemplates(), **options)
        self.budget = Budget()
        self.filters = {name: _bounded_filter(self, f, name == "format") for name, f in self.filters.items()}

    def bounded_iter(self, iterable):
        for item in iterable:
            self.budget.tick()
            yield item

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
        __self.budget.tick()
        __self.budget.arguments(args, kwargs)
        method = getattr(__obj, "__wrapped__", __obj)         # the sandbox wraps str.format
        if isinstance(getattr(method, "__self__", None), str) and getattr(method, "__name__", "") in FORMATS:
            __self.budget.format_string(method.__self__)
        return __self.budget.sized(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        self.budget.tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    self.budget.size(len(seq) * max(n, 0), f"a repeat ({len(seq):,} x {n:,})")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            digits = math.ceil(right * math.log10(abs(left)))
            if digits > POWER_DIGITS:
                raise SecurityError(f"a power of {digits:,} digits exceeds the template's {POWER_DIGITS:,}")
        elif operator == "%" and isinstance(left, str):
            self.budget.arguments(right if isinstance(right, tuple) else (right,), {})
            self.budget.format_string(left)
        return self.budget.sized(super().call_binop(context, operator, left, right))

    def render(self, template, budget: Budget | None = None, **variables) -> str:
        """``template`` (compiled here) rendered under ``budget`` (a fresh one by default), output counted."""
        self.budget = budget or Budget()
        out, size = [], 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            self.budget.size(size, "the output")
            self.budget.tick()
            out.append(chunk)
        return "".join(out)


def _digit_runs(text: str) -> list[str]:
    runs, run = [], ""
    for ch in text:
        if "0" <= ch <= "9":
            run += ch
        elif run:
            runs.append(run)
            run = ""
    return runs + ([run] if run else [])


def _bounded_filter(env: BoundedSandbox, f, formats: bool):
    """Filter ``f`` refusing an integer argument or a result beyond the render's budget (``jinja_pass_arg``, the
    marker of filters that take the context or environment first, is kept by ``functools.wraps``)."""
    @functools.wraps(f)
    def bounded(*args, **kwargs):
        env.budget.tick()
        env.budget.arguments(args, kwargs)
        if formats and args:
            env.budget.format_string(args[0])
        return env.budget.sized(f(*args, **kwargs))
    return bounded
