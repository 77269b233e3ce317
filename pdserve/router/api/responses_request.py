"""An OpenAI Responses API request (``POST /v1/responses``) as the chat-completion body it renders as in vLLM 0.32.

vLLM renders a Responses request (not a gpt-oss "harmony" model) through the chat template: ``instructions``
first as a system message, then ``input`` (a string: one user message; items: messages by role, an assistant's
``function_call`` items as its ``tool_calls``, ``function_call_output`` items as ``tool`` messages), and samples
with the request's fields. The router builds that chat body here and runs it on its P -> D path
(:mod:`..endpoints.chat_bridge`):

- ``max_output_tokens`` -> ``max_tokens``; ``text.format`` (json_schema / json_object) -> ``structured_outputs``;
  ``reasoning.effort`` -> ``reasoning_effort``; function ``tools`` and ``tool_choice`` -> the chat forms;
- the sampling fields vLLM's ``ResponsesRequest`` shares with chat (temperature, top_p, top_k, min_p, penalties,
  seed, stop, stop_token_ids, ignore_eos, logit_bias, skip_special_tokens, include_stop_str_in_output,
  cache_salt, priority, vllm_xargs, chat_template_kwargs, watermarking, structured_outputs) go as they are;
- a last assistant message whose ``status`` is in_progress or incomplete is continued (continue_final_message);
- ``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` -> chat ``logprobs`` / ``top_logprobs``.

Stateless only. Refused by name (400): ``previous_response_id``, ``background``, ``previous_input_messages``,
``enable_response_messages`` (they need the server-side store vLLM keeps only with
``VLLM_ENABLE_RESPONSES_API_STORE``), ``prompt`` (vLLM refuses it too), ``truncation: auto``, non-function
tools, ``reasoning`` and image/file input items, ``kv_transfer_params`` / ``ec_transfer_params``. ``store`` is
accepted and nothing is stored, as vLLM does without its store (the answer says nothing about it either).
``metadata``, ``user``, ``service_tier``, ``max_tool_calls`` are echoed only.
"""

from __future__ import annotations

from typing import Any

from ..errors import RouterError, bad_request
from .agent_fields import RESPONSES_NOT_NULL
from .fields import refuse_nulls
from .lax_values import flag, integral

_STATEFUL = ("previous_response_id", "previous_input_messages", "background", "enable_response_messages")
_REFUSED = ("prompt", "kv_transfer_params", "ec_transfer_params")
_SAME = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
         "seed", "stop", "stop_token_ids", "ignore_eos", "logit_bias", "skip_special_tokens",
         "include_stop_str_in_output", "cache_salt", "priority", "vllm_xargs", "chat_template_kwargs",
         "watermarking", "structured_outputs")
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _unsupported(name: str, what: str) -> RouterError:
    return bad_request(f"{what} is not supported by the pdserve router", name, "unsupported_parameter")


def _content(content: Any, where: str, first_only: bool) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", "input")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise _unsupported("input", f"content part type {kind!r} ({where}.content[{k}]; text parts only)")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{k}].text must be a string", "input")
        texts.append(part["text"])
    if first_only:
        return texts[0] if texts else ""
    return "\n".join(texts)


def _assistant(prev: dict[str, Any] | None) -> dict[str, Any] | None:
    return prev if prev is not None and prev.get("role") == "assistant" else None


def _item(item: Any, i: int, out: list[dict[str, Any]]) -> None:
    """One input item onto the chat messages (a tool call or a reply joins the assistant message before it)."""
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object", "input")
    kind = item.get("type", "message")
    prev = _assistant(out[-1] if out else None)
    if kind == "function_call":
        if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str) \
                or not isinstance(item.get("call_id"), str):
            raise bad_request(f"{where}: a function_call needs 'call_id', 'name' and 'arguments' strings", "input")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if prev is not None:
            prev.setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
            raise bad_request(f"{where}: a function_call_output needs 'call_id' and 'output' strings", "input")
        out.append({"role": "tool", "content": item["output"], "tool_call_id": item["call_id"]})
    elif kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}", "input")
        content = item.get("content")
        if role == "assistant" and isinstance(content, list):  # an earlier answer: its first text, as vLLM
            text = _content(content, where, True)
            if prev is not None and prev.get("content") is None:
                prev["content"] = text
                return
            out.append({"role": "assistant", "content": text})
            return
        out.append({"role": role, "content": _content(content, where, False)})
    else:
        raise _unsupported("input", f"input item type {kind!r} ({where})")


def _continues(items: list[Any]) -> bool:
    last = items[-1] if items else None
    return isinstance(last, dict) and last.get("type", "message") == "message" and last.get("role") == "assistant" \
        and isinstance(last.get("content"), list) and last.get("status") in ("in_progress", "incomplete")


def _tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    tools = body.get("tools")
    tools = [] if tools is None else tools
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of function tools", "tools")
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _unsupported("tools", f"tools[{k}] of type {tool.get('type') if isinstance(tool, dict) else None!r}"
                               " (function tools only)")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{k}] needs a 'name'", "tools")
        fn = {"name": tool["name"], "description": tool.get("description"), "parameters": tool.get("parameters")}
        if tool.get("strict") is not None:
            fn["strict"] = tool["strict"]
        out.append({"type": "function", "function": fn})
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                              "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if not out:
        if choice not in ("auto", "none", None):
            raise bad_request(f"tool_choice {body.get('tool_choice')!r} needs 'tools'", "tool_choice")
        return
    chat["tools"] = out
    chat["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]


def _text_format(body: dict[str, Any], chat: dict[str, Any]) -> None:
    text = body.get("text")
    if text is None:
        return
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object like {\"format\": {\"type\": \"text\"}}", "text")
    fmt = text.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("text.format must be {\"type\": text | json_object | json_schema}", "text")
    if body.get("structured_outputs") is not None:  # as vLLM: any text.format with structured_outputs
        raise bad_request("Cannot specify both structured_outputs and text.format", "structured_outputs")
    if fmt["type"] == "json_object":
        chat["structured_outputs"] = {"json_object": True}
    elif fmt["type"] == "json_schema" and fmt.get("schema") is not None:
        if not isinstance(fmt["schema"], dict):
            raise bad_request("text.format.schema must be a JSON schema object", "text")
        chat["structured_outputs"] = {"json": fmt["schema"]}


def _refusals(body: dict[str, Any]) -> None:
    for name in _STATEFUL:
        if body.get(name) not in (None, False, []):
            raise _unsupported(name, f"'{name}' (stateful Responses API; send the whole conversation in 'input')")
    for name in _REFUSED:
        if body.get(name) is not None:
            raise _unsupported(name, f"'{name}'")
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(i, str) for i in include)):
        raise bad_request("'include' must be a list of strings", "include")
    if body.get("truncation") not in (None, "disabled"):
        raise _unsupported("truncation", "'truncation' other than \"disabled\"")
    for name in ("store", "parallel_tool_calls"):  # nothing is stored; echoed fields checked as vLLM's model does
        flag(body, name)
    for name, kind in (("metadata", dict), ("user", str), ("instructions", str)):
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise bad_request(f"'{name}' must be {'an object' if kind is dict else 'a string'}", name)
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise bad_request("'reasoning' must be an object like {\"effort\": \"low\"}", "reasoning")


def to_chat(body: Any) -> dict[str, Any]:
    """The chat-completion body of a Responses request (400 naming the field when it is not valid or is
    refused)."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    refuse_nulls(body, RESPONSES_NOT_NULL)
    _refusals(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {model!r}", "model")
    items = body.get("input")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string", "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for i, item in enumerate(items):
            _item(item, i, messages)
    else:
        raise bad_request("'input' is required: a string or a list of input items", "input")
    chat: dict[str, Any] = {"model": model, "messages": messages}
    mt = integral(body.get("max_output_tokens"))
    if mt is not None:
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise bad_request(f"'max_output_tokens' must be a positive integer, got {mt!r}", "max_output_tokens")
        chat["max_tokens"] = mt
    for name in _SAME:
        if body.get(name) is not None:
            chat[name] = body[name]
    top = integral(body.get("top_logprobs"))
    if top is not None and (not isinstance(top, int) or isinstance(top, bool)):
        raise bad_request(f"'top_logprobs' must be an integer, got {top!r}", "top_logprobs")
    if LOGPROBS_INCLUDE in (body.get("include") or []):  # output logprobs, top_logprobs alternatives each
        chat["logprobs"], chat["top_logprobs"] = True, top or 0
    if isinstance(items, list) and _continues(items):
        chat["continue_final_message"], chat["add_generation_prompt"] = True, False
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    chat["stream"] = flag(body, "stream")
    _text_format(body, chat)
    _tools(body, chat)
    return chat
