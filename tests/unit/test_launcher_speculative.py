"""`pdserve serve --speculative-config JSON`: vLLM's speculative decoding reaches the workers that decode (decode,
colocated, elastic), and the prefill workers too when the drafter has layers of its own (P computes the drafter's
KV for the hand-off); bad values are refused with an example."""

from __future__ import annotations

import json

import pytest

from pdserve import cli
from pdserve.launch import plan_workers, worker_command
from pdserve.launch.config import ConfigError, LauncherConfig
from pdserve.settings.speculative import parse_speculative_config, speculative_roles

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
EAGLE = json.dumps({"method": "eagle", "model": "/m/eagle", "num_speculative_tokens": 2})


def _cfg(argv):
    return cli.config_from_args(cli.build_parser().parse_args(["serve", "--gpus", "none", *argv]))


def _spec_of(argv: list[str]) -> str | None:
    return argv[argv.index("--speculative-config") + 1] if "--speculative-config" in argv else None


@pytest.mark.parametrize("spec, prefill_gets_it", [(NGRAM, False), (EAGLE, True)])
def test_decode_workers_get_the_config_and_prefill_only_for_a_drafter_with_layers(model_dir, spec, prefill_gets_it):
    cfg = _cfg(["--model", str(model_dir), "--prefill", "1", "--decode", "2", "--speculative-config", spec])
    workers = plan_workers(cfg, model_dir, ports=[9001, 9002, 9003], cores=(0, 1))
    got = {w.name: _spec_of(worker_command(w, "s" * 32)[0]) for w in workers}
    assert got == {"prefill0": spec if prefill_gets_it else None, "decode0": spec, "decode1": spec}


def test_colocated_workers_get_it_and_nobody_without_it(model_dir):
    cfg = _cfg(["--model", str(model_dir), "--colocated", "2", "--speculative-config", NGRAM])
    assert all(_spec_of(worker_command(w, "s" * 32)[0]) == NGRAM
               for w in plan_workers(cfg, model_dir, ports=[9001, 9002], cores=(0, 1)))
    cfg = _cfg(["--model", str(model_dir)])
    assert all(_spec_of(worker_command(w, "s" * 32)[0]) is None
               for w in plan_workers(cfg, model_dir, ports=[9001, 9002], cores=(0, 1)))


@pytest.mark.parametrize("bad", ["ngram", "[1, 2]", '{"num_speculative_tokens": 3}', '{"method": ""}'])
def test_bad_values_are_refused_with_an_example(bad):
    with pytest.raises(ConfigError, match="speculative_config=.*e.g. '\\{\"method\": \"ngram\""):
        LauncherConfig(speculative_config=bad)


def test_roles():
    assert speculative_roles("") == frozenset() and parse_speculative_config(" ") == {}
    assert speculative_roles(NGRAM) == {"decode", "colocated", "elastic"}
    assert speculative_roles(EAGLE) == {"prefill", "decode", "colocated", "elastic"}
