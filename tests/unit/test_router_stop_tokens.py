"""A stop string that ends inside a multi-token worker event: only the tokens up to the one that completes it are
output and counted (vLLM stops generating there), whatever the event's size."""

from __future__ import annotations

from pdserve.router.run.delta import Delta, tokens_to
from pdserve.router.run.output import Output
from pdserve.router.run.stops import StopStrings
from pdserve.router.run.timings import Timings


def _output(stops: list[str]) -> Output:
    return Output(StopStrings(stops, include=False), Timings(arrive=0.0))


def test_tokens_to_counts_pieces_up_to_the_characters():
    assert tokens_to(["ab", "", "c", "de"], 3, 4) == 3  # "" (a partial character) still counts as a token
    assert tokens_to(["ab", "c"], 1, 2) == 1
    assert tokens_to(["ab", "c"], 9, 2) == 2
    assert tokens_to(None, 1, 5) == 5  # the worker's own text: no per-token split known


def test_stop_inside_a_multi_token_event_counts_only_tokens_up_to_it():
    g = _output(["XY"])
    first = g.accept(Delta("ab", [1], pieces=["ab"]))
    assert first.text == "a" and g.token_ids == [1]  # the last character is held back (len("XY") - 1)
    d = g.accept(Delta("cXYde", [2, 3, 4, 5], pieces=["c", "X", "Y", "de"],
                        logprobs={"tokens": ["c", "X", "Y", "de"], "token_logprobs": [0.0, -1.0, -2.0, -3.0]}))
    assert d.finish_reason == "stop" and d.stop_reason == "XY"
    assert first.text + d.text == "abc"
    assert d.token_ids == [2, 3, 4] and g.token_ids == [1, 2, 3, 4] and g.t.tokens == 4
    assert d.logprobs == {"tokens": ["c", "X", "Y"], "token_logprobs": [0.0, -1.0, -2.0]}


def test_stop_spanning_events_counts_the_completing_token():
    g = _output(["XY"])
    g.accept(Delta("aX", [1, 2], pieces=["a", "X"]))
    d = g.accept(Delta("Yzz", [3, 4], pieces=["Y", "zz"]))
    assert d.token_ids == [3] and g.token_ids == [1, 2, 3]
