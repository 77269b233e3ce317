"""api/fields.py classifies every field of the installed vLLM's request models, and the parser acts on it."""

from __future__ import annotations

import pytest

from pdserve.router.api.fields import FIELDS, counts, names
from pdserve.router.api.protocol import parse_chat, parse_completion
from pdserve.router.errors import RouterError


def _vllm_fields(endpoint: str) -> set[str]:
    pytest.importorskip("vllm")
    if endpoint == "completions":
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as Model
    else:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as Model
    return set(Model.model_fields)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_vllm_field_is_classified(endpoint):
    """A vLLM upgrade that adds (or drops) a request field fails here until api/fields.py says what to do."""
    theirs = _vllm_fields(endpoint)
    ours = set(FIELDS[endpoint])
    assert sorted(theirs - ours) == [], "classify these in pdserve/router/api/fields.py"
    assert sorted(ours - theirs) == [], "vLLM no longer has these: drop them from pdserve/router/api/fields.py"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_counts_add_up(endpoint):
    assert sum(counts(endpoint).values()) == len(FIELDS[endpoint])


def _parse(endpoint: str, extra: dict):
    if endpoint == "completions":
        return parse_completion({"prompt": "hi", **extra})
    return parse_chat({"messages": [{"role": "user", "content": "hi"}], **extra})


_VALUES = {"presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"5": 1.0}, "allowed_token_ids": [1, 2],
           "cache_salt": "s", "priority": 3, "return_tokens_as_token_ids": True, "logprob_token_ids": [4],
           "vllm_xargs": {"k": 1}, "bad_words": ["x"], "repetition_detection": {"max_pattern_size": 4},
           "thinking_token_budget": 10, "watermarking": True, "stream_interval": 4,
           "min_tokens": 3}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_forwarded_fields_reach_the_workers(endpoint):
    for name in names(endpoint, "forwarded") + names(endpoint, "regenerated"):
        if name not in _VALUES:
            continue  # read by the parser on their own (temperature, seed, ...: tests/unit/test_router_units.py)
        needs = {"logprobs": 1 if endpoint == "completions" else True} if name == "logprob_token_ids" else {}
        req = _parse(endpoint, {name: _VALUES[name], **needs})  # logprob_token_ids needs logprobs, as in vLLM
        assert req.sampling[name] == _VALUES[name], name
        assert req.constrained == (FIELDS[endpoint][name][0] == "regenerated"), name


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_refused_fields_name_themselves(endpoint):
    for name in names(endpoint, "refused"):
        with pytest.raises(RouterError) as e:
            _parse(endpoint, {name: "x"})
        assert e.value.status == 400 and e.value.param == name, name


def test_forwarded_field_of_the_wrong_type_is_400():
    for name, bad in (("logit_bias", [1]), ("cache_salt", ""), ("priority", True), ("bad_words", "x")):
        with pytest.raises(RouterError) as e:
            parse_completion({"prompt": "hi", name: bad})
        assert e.value.status == 400 and e.value.param == name


def test_request_id_names_the_answer():
    assert parse_completion({"prompt": "hi", "request_id": "abc"}).response_id == "cmpl-abc"
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "request_id": "abc"}).response_id == \
        "chatcmpl-abc"


def test_documents_and_reasoning_effort_reach_the_chat_template_as_vllm():
    msgs = [{"role": "user", "content": "x"}]
    req = parse_chat({"messages": msgs, "documents": [{"title": "t", "text": "d"}], "reasoning_effort": "low",
                      "chat_template_kwargs": {"reasoning_effort": "high", "k": 1}})
    assert req.chat_template_kwargs == {"k": 1, "documents": [{"title": "t", "text": "d"}],
                                        "reasoning_effort": "low", "enable_thinking": True}
    req = parse_chat({"messages": msgs, "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}})
    assert req.chat_template_kwargs == {"enable_thinking": True, "reasoning_effort": "none"}
    for bad in ({"documents": "d"}, {"documents": [{"a": 1}]}, {"reasoning_effort": "very"}):
        with pytest.raises(RouterError) as e:
            parse_chat({"messages": msgs, **bad})
        assert e.value.param == "body." + next(iter(bad))  # vLLM's request model refuses these (pydantic)


def _refuses_null(model, base: dict, name: str) -> bool:
    try:
        model.model_validate({**base, name: None})
    except Exception:  # pydantic's ValidationError, or vLLM's validators' own errors
        return True
    return False


def _vllm_models() -> dict:
    pytest.importorskip("vllm")
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    msgs = [{"role": "user", "content": "x"}]
    return {"completions": (CompletionRequest, {"model": "m", "prompt": "x"}),
            "chat": (ChatCompletionRequest, {"model": "m", "messages": msgs}),
            "messages": (AnthropicMessagesRequest, {"model": "m", "messages": msgs, "max_tokens": 4}),
            "responses": (ResponsesRequest, {"input": "x"})}


def test_not_null_sets_are_vllms():
    """Each set of fields the router refuses null for is the set vLLM's model refuses null for."""
    from pdserve.router.api.agent_fields import MESSAGES_NOT_NULL, RESPONSES_NOT_NULL
    from pdserve.router.api.fields import NOT_NULL

    ours = {**NOT_NULL, "messages": MESSAGES_NOT_NULL, "responses": RESPONSES_NOT_NULL}
    for endpoint, (model, base) in _vllm_models().items():
        theirs = {name for name in model.model_fields if _refuses_null(model, base, name)}
        assert ours[endpoint] == theirs, endpoint


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_null_is_refused_by_name_where_vllm_refuses_it(endpoint):
    from pdserve.router.api.fields import NOT_NULL

    for name in NOT_NULL[endpoint] - {"prompt", "messages"}:
        with pytest.raises(RouterError) as e:
            _parse(endpoint, {name: None})
        assert e.value.status == 400 and e.value.param == name, name
    req = _parse(endpoint, {"temperature": None, "seed": None, "stop": None})  # null: not sent
    assert "temperature" not in req.sampling and "seed" not in req.sampling and req.stop == []


def test_tokenize_chat_fields_are_vllms():
    pytest.importorskip("vllm")
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest

    from pdserve.router.api.fields import TOKENIZE_CHAT_FIELDS

    assert sorted(TOKENIZE_CHAT_FIELDS) == sorted(TokenizeChatRequest.model_fields)


def test_chat_echo_and_the_answers_role_as_vllm():
    """vLLM 0.32's get_chat_request_role and chat echo: "assistant" with a generation prompt (as asked), else the
    last message's role; echo repeats the last message's content only when its role is the answer's."""
    from pdserve.router.api.chat_request import chat_role_and_echo

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Red, green"}]
    assert chat_role_and_echo(msgs, True, True) == ("assistant", "Red, green")
    assert chat_role_and_echo(msgs, False, True) == ("assistant", "Red, green")
    assert chat_role_and_echo(msgs, True, False) == ("assistant", "")
    assert chat_role_and_echo(msgs[:1], True, True) == ("assistant", "")  # the last is the user's: nothing echoed
    assert chat_role_and_echo(msgs[:1], False, True) == ("user", "hi")
    req = parse_chat({"messages": msgs, "echo": True, "continue_final_message": True})
    assert (req.response_role, req.chat_echo, req.add_generation_prompt) == ("assistant", "Red, green", False)
