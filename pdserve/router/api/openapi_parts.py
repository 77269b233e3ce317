"""JSON Schema pieces the router's request schemas share (:mod:`.openapi`): references into its components, null
read as "not sent", booleans as vLLM's pydantic reads them, token ids, and the checks vLLM makes on a few
strings."""

from __future__ import annotations

from typing import Any

from .lax_values import FALSE_WORDS, TRUE_WORDS
from .protocol import CACHE_SALT_MAX

REF = "#/components/schemas/"


def ref(name: str) -> dict[str, str]:
    return {"$ref": REF + name}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def takes_null(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "null" or None in schema.get("enum", ()) or any(
        takes_null(s) for s in schema.get("anyOf", ()))


def with_nulls(props: dict[str, dict[str, Any]], not_null: frozenset[str], required: tuple[str, ...] = ()
               ) -> dict[str, dict[str, Any]]:
    """``props`` with null allowed wherever the router reads it as "not sent" (every field but those vLLM's model
    refuses null for and those the router requires)."""
    return {name: schema if name in not_null or name in required or takes_null(schema) else
            {**nullable({k: v for k, v in schema.items() if k != "description"}), "description":
             schema.get("description", "")} for name, schema in props.items()}


def nulls_in(schema: dict[str, Any], not_null: frozenset[str]) -> dict[str, Any]:
    """An object schema with :func:`with_nulls` applied to its properties."""
    return {**schema, "properties": with_nulls(schema["properties"], not_null, tuple(schema["required"]))}


def words(choices: frozenset[str]) -> str:
    """A pattern matching ``choices`` in any case (ECMA-262 regexes have no case-insensitive flag in a schema)."""
    return "^(" + "|".join("".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in w)
                           for w in sorted(choices)) + ")$"


STR = {"type": "string"}
# booleans as vLLM's pydantic models read them (api/lax_values.py): true/false, 0/1 and their words in any case
BOOL = {"anyOf": [{"type": "boolean"}, {"enum": [0, 1]},
                  {"type": "string", "pattern": words(TRUE_WORDS | FALSE_WORDS)}]}
TRUE = {"anyOf": [{"const": True}, {"const": 1}, {"type": "string", "pattern": words(TRUE_WORDS)}]}
# the value of a field the router refuses by name: only what reads as "not sent" passes (null where it takes null)
OFF = {"enum": [False, 0, [], {}], "description": "not supported"}
# a token id of the served model's vocabulary (components.schemas.TokenId: its maximum is the vocabulary's last id;
# the router refuses any other id by name, as vLLM does)
TOKEN_IDS = {"type": "array", "items": ref("TokenId")}
STOP = {"type": "string", "minLength": 1}  # vLLM 0.32 refuses an empty stop string
NAME = {"type": "string", "minLength": 1}  # a tool's name
# as vLLM checks a cache_salt: non-empty, at most 128 characters, none of @ / \ NUL
SALT = {"type": "string", "minLength": 1, "maxLength": CACHE_SALT_MAX, "pattern": "^[^@/\\\\\u0000]*$"}
INT64 = 2 ** 63
# the request's extra variables for the chat template: none that the template call takes itself (vLLM refuses
# chat_template and tokenize; messages and conversation fail the template call, a 400 on both)
TEMPLATE_KWARGS = {"type": "object", "propertyNames": {"not": {"enum": ["messages", "conversation", "chat_template",
                                                                        "tokenize"]}}}


def needs_tools(choice: dict[str, Any]) -> dict[str, Any]:
    """A tool_choice matching ``choice`` needs a non-empty ``tools`` list."""
    return {"if": {"required": ["tool_choice"], "properties": {"tool_choice": choice}},
            "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}


def tool_rules(schema: dict[str, Any], tool_parser: bool, choosing: dict[str, Any], listed: dict[str, Any],
               none: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its tool rules. With --tool-call-parser: a tool_choice ``choosing`` a tool needs a non-empty
    ``tools`` list. Without one, any tool_choice but ``none`` is refused (400 naming tool_choice: the parser is
    needed), so tool_choice is ``none`` or null, and ``tools`` (matching ``listed``) only with it said."""
    if tool_parser:
        return {**schema, "allOf": [*schema.get("allOf", []), needs_tools(choosing)]}
    rule = {"if": {"required": ["tools"], "properties": {"tools": listed}},
            "then": {"required": ["tool_choice"], "properties": {"tool_choice": none}}}
    choice = nullable(none) if takes_null(schema["properties"]["tool_choice"]) else none
    props = {**schema["properties"], "tool_choice": {**choice, "description": "none (no --tool-call-parser)"}}
    return {**schema, "properties": props, "allOf": [*schema.get("allOf", []), rule]}
