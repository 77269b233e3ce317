"""The rules between request fields that JSON Schema cannot state, as /openapi.json lists them (:data:`RULES_KEY`
on a request schema), and their constructors.

Each rule applies where every pointer of its "when" ({R: value, ...}) holds that value; a body that breaks one gets
a 400 (P, Q, R: JSON pointers into the body; a "*" part stands for each item of a list):

- ``{"rule": "less", "field": P, "than": Q}``: where P and Q both hold numbers, P's is less than Q's;
- ``{"rule": "in", "field": P, "among": Q}``: where P holds a value, it is one of the values at Q;
- ``{"rule": "json", "items": P, "when": {K: value}, "field": K2}``: for each item of the list at P whose key K
  holds that value, the string at its key K2 is empty or a JSON text;
- ``{"rule": "exclusive", "fields": [P, Q], "unless": {R: value}}``: P and Q do not both hold a value other than
  null, unless every pointer of "unless" holds its value;
- ``{"rule": "greedy_n", "n": P, "temperature": Q, "eps": E}``: where P holds a number over 1 and Q a number, Q's
  is at least E (vLLM 0.32: greedy sampling takes one choice; 400 naming no parameter);
- ``{"rule": "keys_below", "field": P, "limit": N}``: each key of the object at P, a token id, is below N (the
  vocabulary's size);
- ``{"rule": "context", "form": F, "max_model_len": L, "output": [P, ...], "default_output": D}``: the prompt fits
  the context. Its n tokens are the prompt as the router sends it to the workers (api/prompt.py: the chat
  template rendered, with the request's tools and template variables, truncate_prompt_tokens applied), for F
  "completion" each prompt of "prompt", for F "chat" the request, for F "messages" / "responses" its chat form
  (the router's translation; one without messages counts 0). 1 <= n < L; the output budget (the first of the
  output pointers that holds a number, else D; none: no bound) is at least 1 and at most L (vLLM 0.32 clamps it
  to the room the prompt leaves, L - n, as the router does). (Chat's max_tokens counts only without
  max_completion_tokens, which JSON Schema could state; it is here because schemathesis' generator gives up on a
  schema past about four conditions.)

A client (and tests/unit/test_router_schemathesis.py, through its hooks) reads them from the document.
"""

from __future__ import annotations

from typing import Any

RULES_KEY = "x-pdserve-rules"


def with_rules(schema: dict[str, Any], *rules: dict[str, Any]) -> dict[str, Any]:
    return {**schema, RULES_KEY: [*schema.get(RULES_KEY, []), *rules]}


def named_tool(choice: str, among: str) -> dict[str, Any]:
    """A named tool_choice (its name at the pointer ``choice``) names one of the request's tools."""
    return {"rule": "in", "field": choice, "among": among,
            "description": "a named tool_choice names one of the request's tools (400 naming tool_choice)"}


def context(form: str, max_model_len: int, output: tuple[str, ...], default: int | None = None) -> dict[str, Any]:
    description = (f"the prompt's tokens fit the context ({max_model_len} tokens; 400 context_length_exceeded); an "
                   f"output budget over {max_model_len} is a 400 naming it, one over the room the prompt leaves is "
                   "clamped to it")
    return {"rule": "context", "form": form, "max_model_len": max_model_len, "output": list(output),
            "default_output": default, "description": description}


def bias_keys(vocab_size: int) -> dict[str, Any]:
    return {"rule": "keys_below", "field": "/logit_bias", "limit": vocab_size,
            "description": "logit_bias keys are token ids of the vocabulary (400 naming logit_bias)"}


def greedy_n(eps: float) -> dict[str, Any]:
    return {"rule": "greedy_n", "n": "/n", "temperature": "/temperature", "eps": eps,
            "description": f"n > 1 needs temperature >= {eps} (vLLM refuses greedy sampling with several choices)"}


def less(field: str, than: str, when: dict[str, Any], description: str) -> dict[str, Any]:
    return {"rule": "less", "field": field, "than": than, "when": when, "description": description}


def json_text(items: str, when: dict[str, Any], field: str, description: str) -> dict[str, Any]:
    return {"rule": "json", "items": items, "when": when, "field": field, "description": description}


def exclusive(fields: tuple[str, str], unless: dict[str, Any]) -> dict[str, Any]:
    return {"rule": "exclusive", "fields": list(fields), "unless": unless,
            "description": f"{fields[0][1:]} or {fields[1][1:]}, not both (400 naming {fields[1][1:]})"}
