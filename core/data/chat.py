"""Chat records -> text: the tokenizer's own chat template, rendered as Hugging Face renders it.

A chat is ``[{"role": ..., "content": ...}, ...]``. :func:`render` runs a Jinja chat template the way
``transformers`` does (``utils/chat_template_utils.py:_compile_jinja_template``): an
``ImmutableSandboxedEnvironment`` (a template cannot touch Python objects or mutate its inputs; here
``core.data.sandbox.BoundedSandbox``, which also bounds each render's time and size, and refuses ``include``) with
``trim_blocks``/``lstrip_blocks``, the loop-controls extension (``break``/``continue``), ``raise_exception``,
a ``tojson`` filter and ``strftime_now``; the variables ``messages``, ``add_generation_prompt``, ``bos_token``
and ``eos_token``.

A :class:`ChatTemplate` compiles its template once, when it first renders, and keeps it (a JSONL file's records all
render through one); :func:`render` and :func:`segments` take one, or the template's source for a single use.

A tokenizer without a template of its own (``byte``, ``char``, a bare ``tokenizer.json``) gets
:data:`PLAIN_TEMPLATE`: every message as ``<|role|>\\n`` + content + ``\\n``; the generation prompt is
``<|assistant|>\\n``.

:func:`segments` cuts a rendered chat into pieces with an ``assistant`` flag, the way TRL's and torchtune's
assistant masks are defined: the text an assistant turn adds after the generation prompt (its content and
its end-of-turn marker). It renders every prefix of the chat and needs the template to be prefix-stable
(rendering ``messages[:i]`` is a prefix of rendering ``messages``), true of ChatML (SmolLM2, Qwen2), Llama 3
and the plain template; a template that is not is refused with the record's file:line.
"""
from __future__ import annotations

import json
import time

from purestep.core.data.tokenizers import DataError

PLAIN_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _environment():
    from jinja2.ext import loopcontrols

    from purestep.core.data.sandbox import BoundedSandbox

    def raise_exception(message):
        raise DataError(f"chat template: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env


def template_of(tok) -> str:
    """The tokenizer's own chat template, or :data:`PLAIN_TEMPLATE` when it has none."""
    return getattr(tok, "chat_template", None) or PLAIN_TEMPLATE


def _special(tok, i) -> str:
    return "" if i is None else tok.decode([i])


class ChatTemplate:
    """A Jinja chat template (its ``source``), compiled on its first render and kept for the next ones."""

    def __init__(self, source: str):
        self.source, self._compiled = source, None

    def compiled(self):
        from jinja2 import TemplateError
        if self._compiled is None:
            try:
                self._compiled = _environment().from_string(self.source)
            except (TemplateError, RecursionError, MemoryError) as e:   # a syntax error; nesting deeper than Python's
                raise DataError(f"chat template does not compile: {type(e).__name__}: {e}") from None
        return self._compiled


def _template(template: str | ChatTemplate) -> ChatTemplate:
    return template if isinstance(template, ChatTemplate) else ChatTemplate(template)


def render(template: str | ChatTemplate, messages: list, tok=None, add_generation_prompt: bool = False) -> str:
    """``messages`` rendered by the Jinja chat ``template`` (``bos_token``/``eos_token`` from ``tok``)."""
    from jinja2 import TemplateError
    compiled = _template(template).compiled()
    bos = _special(tok, tok.bos_id) if tok is not None else ""
    eos = _special(tok, tok.eos_id) if tok is not None else ""
    try:
        return compiled.environment.render(compiled, messages=messages, add_generation_prompt=add_generation_prompt,
                                           bos_token=bos, eos_token=eos)
    except (TemplateError, ArithmeticError, LookupError, TypeError, ValueError, RecursionError,
            MemoryError) as e:
        # the template's own Python operations ({{ 1 / 0 }}, {{ 'a' + 1 }}, a macro calling itself) fail here
        raise DataError(f"chat template: {type(e).__name__}: {e}") from None


def check_messages(messages, where: str) -> list:
    """``messages`` if it is a list of ``{"role": str, "content": str}``, else a DataError naming ``where``."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: message {i} needs string 'role' and 'content' fields, got {m!r:.80}")
    return messages


def _render_at(where: str, *args, **kwargs) -> str:
    """:func:`render`, its error naming ``where`` (a JSONL record's file:line)."""
    try:
        return render(*args, **kwargs)
    except DataError as e:
        raise DataError(f"{where}: {e}") from None


def segments(template: str | ChatTemplate, messages: list, tok=None, where: str = "chat") -> list[tuple[str, bool]]:
    """The rendered chat as ``[(text, is_assistant), ...]`` whose texts join to ``render(messages)`` (it renders
    every prefix: pass a :class:`ChatTemplate`, compiled once, when there are many chats)."""
    template = _template(template)
    full = _render_at(where, template, messages, tok)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render_at(where, template, messages[:i], tok, add_generation_prompt=True)
        upto = _render_at(where, template, messages[:i + 1], tok)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise DataError(f"{where}: the chat template is not prefix-stable at message {i} (rendering the "
                            f"first {i} messages is not a prefix of rendering all), so its assistant tokens "
                            f"cannot be found; use loss_on=all")
        spans.append((len(before), len(upto)))
    pieces, at = [], 0
    for lo, hi in spans:
        if lo > at:
            pieces.append((full[at:lo], False))
        if hi > lo:
            pieces.append((full[lo:hi], True))
        at = max(at, hi)
    if at < len(full):
        pieces.append((full[at:], False))
    return pieces
