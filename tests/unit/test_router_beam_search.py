"""Which bodies take the beam search path (run/beam_search.py): ``use_beam_search`` as vLLM's model reads it."""

import pytest

from pdserve.router.run.beam_search import wants_beam_search


@pytest.mark.parametrize("value,beam", [(True, True), ("true", True), (1, True), ("yes", True), ("maybe", True),
                                        (False, False), (None, False), (0, False), ("false", False), ("No", False)])
def test_use_beam_search_values(value, beam):
    assert wants_beam_search({"prompt": "a", "use_beam_search": value}) is beam


def test_absent_or_not_an_object():
    assert not wants_beam_search({"prompt": "a"})
    assert not wants_beam_search(["use_beam_search"])
