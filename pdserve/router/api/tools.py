"""Tool calls, parsed with vLLM's own parsers (chosen by name like ``vllm serve --tool-call-parser``).

The router renders the tools into the chat template itself (``tools=`` of ``apply_chat_template``). What the
model writes is parsed by vLLM's ``ParserManager`` parser for ``--tool-call-parser`` (e.g. ``hermes``), per
choice, whole (:meth:`ToolCalls.message`) or delta by delta (:meth:`ToolCalls.delta`), exactly as vLLM's chat
server does. ``tool_choice`` ``required`` or a named function constrains the output to vLLM's JSON schema for
it (the parser's ``adjust_request``: vLLM's JSON schema, or the parser's structural tag such as hermes'
``<tool_call>`` frame), sent to the workers as ``structured_outputs``; such requests run with D regenerating
the first token, like every constrained request.

vLLM is imported here lazily, on the first tool request only: the router runs where no model does, and every
other request keeps its import-free path (see docs/architecture.md section 7).
"""

from __future__ import annotations

from typing import Any

from ..errors import bad_request
from .protocol import GenerationRequest


class ToolSupport:
    """The router's tool parsing: ``parser`` is vLLM's tool parser name ("" = none configured)."""

    def __init__(self, parser: str, tokenizer: Any, model_name: str) -> None:
        self.parser = parser
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._parser_cls: Any = None

    def parser_cls(self) -> Any:
        if self._parser_cls is None:
            from vllm.parser.parser_manager import ParserManager

            try:
                self._parser_cls = ParserManager.get_parser(tool_parser_name=self.parser, enable_auto_tools=True,
                                                            model_name=self.model_name, tokenizer=self.tokenizer)
            except Exception as e:  # an unknown name or a tokenizer the parser cannot use
                raise bad_request(f"tool parser {self.parser!r} is unusable: {e}", "tools") from None
        return self._parser_cls

    def prepare(self, req: GenerationRequest, messages: Any) -> ToolRequest | None:
        """Check the request can be served, build vLLM's view of it and constrain the sampling where the
        tool choice needs it. None when the output is not parsed (``tool_choice`` none)."""
        if not req.tools or req.tool_choice == "none":
            return None
        if not self.parser:
            raise bad_request(f"tool_choice {req.tool_choice!r} needs a tool parser: start the router with "
                              "--tool-call-parser NAME (e.g. hermes), as `vllm serve --tool-call-parser`",
                              "tool_choice", "unsupported_parameter")
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        body = {"model": self.model_name, "messages": messages, "tools": req.tools,
                "tool_choice": req.tool_choice, "parallel_tool_calls": req.parallel_tool_calls,
                "skip_special_tokens": req.sampling.get("skip_special_tokens", True)}
        try:
            vreq = ChatCompletionRequest.model_validate(body)
        except Exception as e:
            raise bad_request(f"tools: {e}", "tools") from None
        cls = self.parser_cls()
        try:
            vreq = cls(self.tokenizer, vreq.tools).adjust_request(vreq)
        except Exception as e:  # e.g. a schema vLLM cannot turn into a constraint
            raise bad_request(f"tools: {e}", "tools") from None
        if vreq.skip_special_tokens is False:
            req.sampling["skip_special_tokens"] = False  # the parser reads tool-call markup that is special tokens
        so = vreq.structured_outputs
        if so is not None and True:
            fields = {k: v for k, v in vars(so).items() if not k.startswith("_") and v not in (None, False)}
            if fields:
                req.sampling.pop("response_format", None)
                req.sampling["structured_outputs"] = fields  # a JSON schema or the parser's structural tag
                req.constrained = True
        return ToolRequest(cls, self.tokenizer, vreq, req)


class ToolRequest:
    """One request's tool parsing; :meth:`calls` gives each choice its own parser state."""

    def __init__(self, cls: Any, tokenizer: Any, vreq: Any, req: GenerationRequest) -> None:
        self.cls = cls
        self.tokenizer = tokenizer
        self.vreq = vreq
        self.named = isinstance(req.tool_choice, dict)
        self.required = req.tool_choice == "required"
        self.parallel = req.parallel_tool_calls

    def calls(self) -> ToolCalls:
        return ToolCalls(self, self.cls(self.tokenizer, self.vreq.tools))


class ToolCalls:
    """One choice's tool calls."""

    def __init__(self, owner: ToolRequest, parser: Any) -> None:
        self.owner = owner
        self.parser = parser
        self.streamed_calls = 0

    def message(self, text: str, token_ids: list[int], finish_reason: str | None
                ) -> tuple[dict[str, Any], str | None]:
        """The whole answer's message and finish reason, as vLLM's chat server builds them."""
        from vllm.entrypoints.generate.base.protocol import ToolCall
        from vllm.renderers.chat_utils import make_tool_call_id

        o = self.owner
        _, content, calls = self.parser.parse(text, o.vreq, enable_auto_tools=True, model_output_token_ids=token_ids)
        tool_calls = [ToolCall(id=tc.id or make_tool_call_id(), function=tc).model_dump(exclude_none=True)
                      for tc in (calls or [])]
        if not o.parallel:
            tool_calls = tool_calls[:1]
        msg: dict[str, Any] = {"role": "assistant", "content": (content or "") if (o.named or o.required) else content}
        if tool_calls or o.named or o.required:
            msg["tool_calls"] = tool_calls
        if (tool_calls and not o.named and not o.required) or (o.required and finish_reason == "stop"):
            finish_reason = "tool_calls"  # as vLLM: auto that called, or required that ended; named keeps "stop"
        return msg, finish_reason

    def delta(self, text: str, token_ids: list[int], prompt_ids: list[int], finished: bool
              ) -> dict[str, Any] | None:
        """A streamed delta (``{"content"}`` and/or ``{"tool_calls": [...]}``), None when nothing is new."""
        dm = self.parser.parse_delta(text, list(token_ids), self.owner.vreq, prompt_ids, finished=finished)
        if dm is None:
            return None
        out: dict[str, Any] = dm.model_dump(exclude_none=True)
        calls = out.get("tool_calls")
        if calls:
            self.streamed_calls += sum(1 for c in calls if c.get("id"))
            if not self.owner.parallel:
                out["tool_calls"] = [c for c in calls if c.get("index", 0) == 0]
        elif "tool_calls" in out:
            del out["tool_calls"]
        return out or None

    def finish_reason(self, finish_reason: str | None) -> str | None:
        o = self.owner
        if finish_reason is None:
            return None
        if self.streamed_calls and not o.named and finish_reason == "stop":  # vLLM's streamed rule
            return "tool_calls"
        return finish_reason
