"""The tools of a Responses request as Codex sends them, mapped to chat tools and back.

- ``function`` tools are chat function tools.
- ``namespace`` tools (``{"type": "namespace", "name": NS, "tools": [function tools]}``: Codex groups MCP
  servers' and its own collaboration tools so) are flattened: each function becomes the chat tool
  ``NS__NAME`` (``flat_name``); a call of it comes back as a ``function_call`` item with ``name`` NAME and
  ``namespace`` NS, and a history item with a ``namespace`` is flattened the same way.
- every other type (built-in tools the server cannot run: ``web_search``, ``file_search``, ``code_interpreter``,
  ``image_generation``, ``computer_use_preview``, ``local_shell``, ``mcp``; and freeform ``custom`` tools, whose
  calls no parser here reads) is not offered to the model; the handler logs each type once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddtree_serve.server.http.errors import APIError

NS_SEP = "__"
MAX_NAME = 64  # chat tool names: ^[A-Za-z0-9_-]{1,64}$


def flat_name(namespace: str, name: str) -> str:
    """The chat tool name of function ``name`` of namespace ``namespace``."""
    return f"{namespace}{NS_SEP}{name}"


@dataclass(frozen=True)
class ToolMap:
    """``chat_tools``: the chat request's tools; ``namespaces``: flat name -> (namespace, name);
    ``not_offered``: the tool types left out, in order, once each."""

    chat_tools: list[dict[str, Any]] = field(default_factory=list)
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)
    not_offered: tuple[str, ...] = ()

    def call_names(self, name: str) -> dict[str, str]:
        """A reply's call of chat tool ``name``, as the Responses item's ``name`` (and ``namespace``)."""
        if name in self.namespaces:
            ns, sub = self.namespaces[name]
            return {"name": sub, "namespace": ns}
        return {"name": name}


def _function(tool: Any, name: str) -> dict[str, Any]:
    fn = tool.model_dump(exclude={"type"}, exclude_none=True)
    return {"type": "function", "function": {**fn, "name": name}}


def map_tools(tools: list[Any] | None) -> ToolMap:
    """The ``ToolMap`` of a Responses request's ``tools`` (APIError 400 naming ``tools`` for a flattened name
    longer than 64 characters or one that two tools share)."""
    chat: list[dict[str, Any]] = []
    namespaces: dict[str, tuple[str, str]] = {}
    skipped: list[str] = []
    for tool in tools or []:
        if tool.type == "function":
            chat.append(_function(tool, tool.name))
        elif tool.type == "namespace":
            for sub in tool.tools:
                flat = flat_name(tool.name, sub.name)
                if len(flat) > MAX_NAME:
                    raise APIError(400, f"tools: namespace {tool.name!r} tool {sub.name!r} flattens to {flat!r}, "
                                        f"longer than {MAX_NAME} characters", param="tools", code="invalid_value")
                namespaces[flat] = (tool.name, sub.name)
                chat.append(_function(sub, flat))
        elif tool.type not in skipped:
            skipped.append(tool.type)
    names = [t["function"]["name"] for t in chat]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise APIError(400, f"tools: two tools are named {dup!r} (a namespace tool NS's function NAME is served as "
                            f"NS{NS_SEP}NAME)", param="tools", code="invalid_value")
    return ToolMap(chat, namespaces, tuple(skipped))
