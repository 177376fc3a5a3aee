"""Thinking: the request fields that switch a thinking model's reasoning on or off, and the count of the
reasoning tokens a reply spent.

A model has a thinking switch when the server runs a reasoning parser (``--reasoning-parser``) and the
model's chat template reads a ``thinking`` (Kimi K2.x) or ``enable_thinking`` (Qwen3 style) variable.
``reasoning_effort`` (chat completions; Responses ``reasoning.effort`` maps to it) is applied through that
switch: ``none`` and ``minimal`` turn thinking off, ``low``, ``medium``, ``high`` and ``xhigh`` turn it on
(the model has one thinking mode: a level does not bound the reasoning's length). Without a switch it is a
400 naming the field, and so is an effort that contradicts the request's own ``chat_template_kwargs``.

``reasoning_tokens`` (``usage.completion_tokens_details``, and Responses'
``usage.output_tokens_details``) counts the tokens of the reasoning section of each choice: its text
(``reasoning_content``) encoded without special tokens, summed over the choices (a count of the text: it can
differ from the tokens generated where the model wrote a non-canonical tokenization). It is counted here
once, by the chat handler; the agent APIs read it from the chat usage.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Any, get_args

from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.protocol import ChatCompletionRequest, ReasoningEffort

EFFORT_LEVELS: tuple[str, ...] = get_args(ReasoningEffort)
EFFORT_OFF = ("none", "minimal")  # thinking off; the other levels turn it on
SWITCH_VARIABLES = ("thinking", "enable_thinking")  # chat-template variables of a thinking switch


def template_switches(chat_template: str | dict[str, str] | None) -> tuple[str, ...]:
    """The thinking-switch variables that ``chat_template`` (Jinja text, or a tokenizer's named templates: its
    ``default`` one) reads, in ``SWITCH_VARIABLES`` order."""
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("default")
    return _switches_of(chat_template) if chat_template else ()


@lru_cache(maxsize=8)
def _switches_of(chat_template: str) -> tuple[str, ...]:
    """``template_switches`` of one template text, parsed once (a server has one template, asked per request)."""
    import jinja2
    import jinja2.meta

    try:
        names = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(chat_template))
    except jinja2.TemplateSyntaxError:
        return ()
    return tuple(v for v in SWITCH_VARIABLES if v in names)


def apply_reasoning_effort(req: ChatCompletionRequest, reasoning_parser: str | None,
                           chat_template: str | dict[str, str] | None) -> ChatCompletionRequest:
    """``req`` with its ``reasoning_effort`` applied to ``chat_template_kwargs`` (unchanged without one);
    APIError 400 naming ``reasoning_effort`` where the model has no thinking switch or the request's
    ``chat_template_kwargs`` set the switch the other way."""
    effort = req.reasoning_effort
    if effort is None:
        return req
    switches = template_switches(chat_template) if reasoning_parser is not None else ()
    if not switches:
        why = ("this server runs without a reasoning parser (--reasoning-parser)" if reasoning_parser is None
               else "the model's chat template has no thinking switch (a 'thinking' or 'enable_thinking' variable)")
        raise APIError(400, f"reasoning_effort is not supported: {why}, so thinking cannot be switched on or off",
                       param="reasoning_effort", code="unsupported_parameter")
    on = effort not in EFFORT_OFF
    kwargs = dict(req.chat_template_kwargs or {})
    for name in SWITCH_VARIABLES:
        if name in kwargs and bool(kwargs[name]) != on:
            raise APIError(400, f"reasoning_effort {effort!r} turns thinking {'on' if on else 'off'}, but "
                                f"chat_template_kwargs.{name} is {kwargs[name]!r}", param="reasoning_effort",
                           code="conflicting_parameters")
    kwargs.update({name: on for name in switches})
    return req.model_copy(update={"chat_template_kwargs": kwargs})


def apply_thinking_field(req: ChatCompletionRequest) -> ChatCompletionRequest:
    """``req`` with Moonshot's ``thinking: {"type": "enabled" | "disabled"}`` applied to ``chat_template_kwargs``
    (``thinking`` and ``enable_thinking``, the switch ``chat_template_kwargs`` sets; templates without one
    ignore it); APIError 400 naming ``thinking`` where the request's own ``chat_template_kwargs`` or
    ``reasoning_effort`` set the switch the other way."""
    if req.thinking is None:
        return req
    on = req.thinking.type == "enabled"
    kwargs = dict(req.chat_template_kwargs or {})
    for name in SWITCH_VARIABLES:
        if name in kwargs and bool(kwargs[name]) != on:
            raise APIError(400, f"thinking {req.thinking.type!r} contradicts chat_template_kwargs.{name} "
                                f"{kwargs[name]!r}", param="thinking", code="conflicting_parameters")
    if req.reasoning_effort is not None and (req.reasoning_effort not in EFFORT_OFF) != on:
        raise APIError(400, f"thinking {req.thinking.type!r} contradicts reasoning_effort {req.reasoning_effort!r}",
                       param="thinking", code="conflicting_parameters")
    kwargs.update({name: on for name in SWITCH_VARIABLES})
    return req.model_copy(update={"chat_template_kwargs": kwargs})


def reasoning_tokens(tokenizer: Any, reasoning_texts: Iterable[str]) -> int:
    """Tokens of the reasoning sections (one text per choice), each encoded without special tokens."""
    return sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in reasoning_texts if t)
