"""The chat-only parts of a chat completion request, as vLLM 0.32 reads them: the messages the chat template gets,
the tools and tool choice, and the template's extras (``documents``, ``reasoning_effort``). Each returns what it
read (or raises a 400 naming the field); :func:`.protocol.parse_chat` puts it on the request."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import bad_request, model_param


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """A chat request's ``messages`` as the template gets them: role, text content, name, earlier tool calls (their
    arguments parsed) and tool call ids; a 400 naming ``messages`` for anything else."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required: a non-empty list of {\"role\", \"content\"} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        msg: dict[str, Any] = {"role": m["role"], "content": "" if content is None else _message_text(content, i)}
        if "name" in m:
            if not isinstance(m["name"], str):
                raise bad_request(f"messages[{i}].name must be a string", "messages")
            msg["name"] = m["name"]
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _message_tool_calls(m["tool_calls"], i)
        if isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise bad_request(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                  "are supported", "messages")
        return "\n".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _message_tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's earlier tool calls, arguments parsed from their JSON string (as vLLM hands them to
    chat templates)."""
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list", "messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"messages[{i}].tool_calls: each needs a 'function' with a 'name'", "messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args else {}
            except ValueError:
                raise bad_request(f"messages[{i}].tool_calls: 'arguments' of {fn['name']!r} is not JSON",
                                  "messages") from None
        out.append({**call, "function": {"name": fn["name"], "arguments": args}})
    return out


def _vllm_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as vLLM hands it to the chat template (its pydantic dump: these keys in this order, description and
    parameters even when null), so the rendered prompt is the one a vLLM worker renders."""
    fn = tool["function"]
    out = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
    for key in ("strict", "defer_loading"):
        if fn.get(key, tool.get(key) if key == "defer_loading" else None) is not None:
            out[key] = fn.get(key, tool.get(key))
    wrapped: dict[str, Any] = {"type": "function", "function": out}
    if tool.get("defer_loading") is not None:
        wrapped["defer_loading"] = tool["defer_loading"]
    return wrapped


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools as vLLM hands them to the template, its tool choice, and whether that choice
    constrains the output (required or named: D regenerates the first token)."""

    tools: list[dict[str, Any]]
    choice: Any
    constrained: bool


def parse_tools(body: dict, sampling: dict[str, Any]) -> ToolRequest | None:
    """``tools`` and ``tool_choice`` checked as vLLM checks them; None without tools. ``sampling``: the fields
    already forwarded (a constraining choice refuses structured outputs beside it)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise bad_request("'tools' must be a non-empty list of {\"type\": \"function\", \"function\": {...}}",
                          "tools")
    names = []
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{k}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                              "\"parameters\": {...}}}", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"tools[{k}].function.parameters must be a JSON schema object", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad_request(f"tools[{k}].function.description must be a string", "tools")
        names.append(fn["name"])
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("'tool_choice' must be none, auto, required or {\"type\": \"function\", "
                              "\"function\": {\"name\": ...}}", "tool_choice")
        if fn["name"] not in names:
            raise bad_request(f"tool_choice names {fn['name']!r}, which is not in 'tools' ({names})", "tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise bad_request("'tool_choice' must be none, auto, required or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", "tool_choice")
    constrained = choice == "required" or isinstance(choice, dict)
    if constrained and ("response_format" in sampling or "structured_outputs" in sampling):
        raise bad_request("a required or named tool_choice constrains the output itself: drop "
                          "'response_format' / 'structured_outputs'", "tool_choice")
    return ToolRequest([_vllm_tool(t) for t in tools], choice, constrained)


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def template_extras(body: dict, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``documents`` and ``reasoning_effort`` go to the chat template as vLLM hands them over: over the client's
    ``chat_template_kwargs`` (``kwargs``), with ``enable_thinking`` following the effort unless the client set it.
    Returns the kwargs to render with."""
    extra: dict[str, Any] = {}
    docs = body.get("documents")
    if docs is not None:
        if not isinstance(docs, list) or not all(isinstance(d, dict) and all(isinstance(v, str) for v in d.values())
                                                 for d in docs):
            raise bad_request("'documents' must be a list of objects with string values", model_param("documents"))
        extra["documents"] = docs
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                              model_param("reasoning_effort"))
        extra["reasoning_effort"] = effort
        if "enable_thinking" not in kwargs:
            extra["enable_thinking"] = effort != "none"
    return {**kwargs, **extra} if extra else kwargs


def chat_role_and_echo(messages: list[dict[str, Any]], add_generation_prompt: bool, echo: bool) -> tuple[str, str]:
    """The answer's role and the text chat ``echo`` puts before each choice's content, as vLLM 0.32 sets them
    (``get_chat_request_role``; the chat ``echo``): the role is "assistant" with a generation prompt (as asked, before
    ``continue_final_message`` turns it off), else the last message's; echo repeats the last message's content when
    its role is the answer's."""
    role = "assistant" if add_generation_prompt else messages[-1]["role"]
    last = messages[-1]
    return role, (last.get("content") or "") if echo and last["role"] == role else ""

