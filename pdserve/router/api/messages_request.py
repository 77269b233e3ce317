"""An Anthropic Messages API request (``POST /v1/messages``) as the chat-completion body vLLM 0.32 turns it into.

vLLM's ``AnthropicServingMessages`` converts the request to a ``ChatCompletionRequest`` and serves that; the
router does the same conversion here and runs the chat body on its P -> D path (:mod:`..endpoints.chat_bridge`):

- ``system`` (a string or text blocks, joined; blocks starting ``x-anthropic-billing-header`` dropped) becomes
  the first system message; a system message inside ``messages`` stays where it is, unless the chat template
  takes a leading system message only: then it joins the first (vLLM probes the template the same way);
- text blocks become text parts (one alone: a string), ``tool_use`` blocks an assistant's ``tool_calls``
  (``input`` as JSON arguments), a user's ``tool_result`` a ``tool`` message, an assistant's
  ``Tool result: ...`` text; ``redacted_thinking`` is skipped;
- ``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``cache_salt``, ``vllm_xargs``,
  ``chat_template_kwargs``, ``watermarking`` map to the chat fields of the same meaning; ``output_config``'s
  JSON schema to ``response_format``, its ``effort`` to ``reasoning_effort``; ``thinking`` (:func:`_thinking`);
- ``tools`` (``input_schema`` as ``parameters``) and ``tool_choice`` (auto, any -> required, none, tool -> a named
  function; ``disable_parallel_tool_use`` -> ``parallel_tool_calls``).

Refused by name (400): ``thinking`` / ``image`` / ``tool_reference`` / ``tool_addition`` / ``tool_removal``
blocks (the router's chat path renders text only and does not hand earlier reasoning to the template), and
``kv_transfer_params`` / ``ec_transfer_params`` (the router owns the hand-off). ``metadata`` is accepted and
ignored, as vLLM ignores it.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import RouterError, bad_request
from .agent_fields import MESSAGES_NOT_NULL
from .fields import refuse_nulls
from .lax_values import flag, integral

_ROLES = ("user", "assistant", "system")
_BLOCKS = ("text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking",
           "tool_addition", "tool_removal")
_REFUSED_BLOCKS = ("image", "thinking", "tool_reference", "tool_addition", "tool_removal")
_REFUSED_FIELDS = ("kv_transfer_params", "ec_transfer_params")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
_BILLING = "x-anthropic-billing-header"
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _unsupported(name: str, what: str) -> RouterError:
    return bad_request(f"{what} is not supported by the pdserve router", name, "unsupported_parameter")


def _number(body: dict[str, Any], name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_request(f"'{name}' must be a number, got {v!r}", name)
    return v


def _block_text(blocks: list[dict[str, Any]]) -> str:
    return "".join(b["text"] for b in blocks if b.get("type") == "text" and b.get("text")
                   and not b["text"].startswith(_BILLING))


def _blocks(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's ``content``: a string or a list of valid blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content blocks", "messages")
    for k, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") not in _BLOCKS:
            raise bad_request(f"{where}.content[{k}] must be a content block with 'type' one of "
                              + ", ".join(_BLOCKS), "messages")
        if b["type"] in _REFUSED_BLOCKS:
            raise _unsupported("messages", f"a '{b['type']}' content block ({where}.content[{k}])")
        if b["type"] == "text" and not isinstance(b.get("text", ""), (str, type(None))):
            raise bad_request(f"{where}.content[{k}].text must be a string", "messages")
        if b["type"] == "tool_use" and (not isinstance(b.get("input", {}), (dict, type(None)))
                                        or not isinstance(b.get("name", ""), (str, type(None)))):
            raise bad_request(f"{where}.content[{k}]: a tool_use block needs a 'name' and an 'input' object",
                              "messages")
    return content


def _tool_result_text(block: dict[str, Any]) -> str:
    content = block.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(i.get("text", "")) for i in content if isinstance(i, dict) and i.get("type") == "text")
    return ""


def _message(role: str, content: str | list[dict[str, Any]], out: list[dict[str, Any]]) -> None:
    """One Anthropic message as chat messages (a user's tool results become ``tool`` messages before it)."""
    if role == "system":
        text = content if isinstance(content, str) else _block_text(content)
        if text and not text.startswith(_BILLING):
            out.append({"role": "system", "content": text})
        return
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    parts: list[str] = []
    calls: list[dict[str, Any]] = []
    for b in content:
        kind = b["type"]
        if kind == "text" and b.get("text"):
            parts.append(b["text"])
        elif kind == "tool_use":
            calls.append({"id": b.get("id") or "call_0", "type": "function",
                          "function": {"name": b.get("name") or "", "arguments": json.dumps(b.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            out.append({"role": "tool", "tool_call_id": b.get("tool_use_id") or "", "content": _tool_result_text(b)})
        elif kind == "tool_result":
            parts.append(f"Tool result: {b.get('content') or ''}")
    msg: dict[str, Any] = {"role": role}
    if calls:
        msg["tool_calls"] = calls
    if len(parts) == 1:
        msg["content"] = parts[0]
    elif parts:
        msg["content"] = [{"type": "text", "text": p} for p in parts]
    if "content" in msg or calls or role != "user":
        out.append(msg)


def _system(system: Any) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return _block_text(_blocks_list(system))
    raise bad_request("'system' must be a string or a list of text blocks", "system")


def _blocks_list(v: list[Any]) -> list[dict[str, Any]]:
    out = _blocks(v, "system")
    assert isinstance(out, list)
    return out


def _tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
            raise bad_request("'tool_choice' must be {\"type\": auto | any | tool | none}", "tool_choice")
        if choice["type"] == "tool":
            if not isinstance(choice.get("name"), str) or not choice["name"]:
                raise bad_request("tool_choice.name is required when type is 'tool'", "tool_choice")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            chat["tool_choice"] = _TOOL_CHOICES[choice["type"]]
        chat["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use")
    if tools is None:
        return
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of {\"name\", \"input_schema\"} objects", "tools")
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) \
                or not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f"tools[{k}] needs a 'name' and an 'input_schema' object", "tools")
        schema = tool["input_schema"] if "type" in tool["input_schema"] else {**tool["input_schema"], "type": "object"}
        fn: dict[str, Any] = {"name": tool["name"], "description": tool.get("description"), "parameters": schema}
        for key in ("strict", "defer_loading"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    if out:
        chat["tools"] = out
        chat.setdefault("tool_choice", "auto")


def _output_config(body: dict[str, Any], chat: dict[str, Any]) -> None:
    oc = body.get("output_config")
    if oc is None:
        return
    if not isinstance(oc, dict):
        raise bad_request("'output_config' must be an object", "output_config")
    fmt = oc.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type", "json_schema") != "json_schema":
            raise bad_request("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                              "output_config")
        if fmt.get("schema"):
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "json_schema", "schema": fmt["schema"]}}
    if oc.get("effort") is not None:
        chat["reasoning_effort"] = oc["effort"]


def _inline_system(messages: list[Any]) -> str:
    """The text of the system messages inside ``messages``, for a template that takes a leading one only."""
    parts = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "system":
            content = _blocks(m.get("content"), f"messages[{i}]")
            text = content if isinstance(content, str) else _block_text(content)
            if text and not text.startswith(_BILLING):
                parts.append(text)
    return "".join(parts)


def _thinking(body: dict[str, Any], chat: dict[str, Any], disabled_effort: str) -> None:
    """``thinking``: enabled -> ``thinking_token_budget`` (its budget, at least 1024 and under max_tokens);
    disabled -> ``reasoning_effort`` (``disabled_effort``: "none", or "low" for a template that cannot turn
    thinking off); adaptive -> nothing (the model chooses). ``display`` is ignored, as vLLM ignores it."""
    thinking = body.get("thinking")
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad_request("'thinking' must be {\"type\": enabled | disabled | adaptive}", "thinking")
    if kind == "enabled":
        budget = integral(thinking.get("budget_tokens"))
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1024:
            raise bad_request("thinking.budget_tokens must be an integer >= 1024", "thinking")
        if budget >= chat["max_tokens"]:
            raise bad_request("thinking.budget_tokens must be less than max_tokens", "thinking")
        chat["thinking_token_budget"] = budget
    elif kind == "disabled":
        chat["reasoning_effort"] = disabled_effort


def to_chat(body: Any, merge_inline_system: bool = False, disabled_effort: str = "none") -> dict[str, Any]:
    """The chat-completion body of a Messages request (400 naming the field when it is not valid).
    ``merge_inline_system``: the chat template takes one leading system message only (vLLM probes the template
    for this), so system messages inside ``messages`` join the top-level system prompt, as vLLM merges them."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    refuse_nulls(body, MESSAGES_NOT_NULL)
    for name in _REFUSED_FIELDS:
        if body.get(name) is not None:
            raise _unsupported(name, f"'{name}'")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required: a non-empty string", "model")
    mt = integral(body.get("max_tokens"))
    if isinstance(mt, bool) or not isinstance(mt, int):
        raise bad_request("'max_tokens' is required: a positive integer", "max_tokens")
    if mt <= 0:
        raise bad_request("max_tokens must be positive", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request("'messages' is required: a list of {\"role\", \"content\"} objects", "messages")
    chat_messages: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(_ROLES)}", "messages")
    system = _system(body.get("system")) + (_inline_system(messages) if merge_inline_system else "")
    if system:
        chat_messages.append({"role": "system", "content": system})
    for i, m in enumerate(messages):
        if not (merge_inline_system and m["role"] == "system"):
            _message(m["role"], _blocks(m.get("content"), f"messages[{i}]"), chat_messages)
    chat: dict[str, Any] = {"model": model, "messages": chat_messages, "max_tokens": mt}
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("'stop_sequences' must be a list of strings", "stop_sequences")
        chat["stop"] = stop
    for name in ("temperature", "top_p"):
        v = _number(body, name)
        if v is not None:
            chat[name] = v
    for name in ("top_k", "cache_salt", "vllm_xargs", "chat_template_kwargs", "watermarking"):
        if body.get(name) is not None:
            chat[name] = body[name]
    chat["stream"] = flag(body, "stream")
    _output_config(body, chat)
    _thinking(body, chat, disabled_effort)
    _tools(body, chat)
    return chat
