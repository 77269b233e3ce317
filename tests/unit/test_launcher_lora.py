"""`pdserve serve --lora-modules NAME=PATH,...`: every worker gets vLLM's LoRA flags and runtime updates, the router
the adapter list (its own parser and config accept it), and bad values are refused with what to do."""

from __future__ import annotations

import pytest

from pdserve import cli
from pdserve.launch import plan_workers, router_command, worker_command
from pdserve.launch.config import ConfigError, LauncherConfig
from pdserve.settings.lora import parse_lora_modules


def _cfg(argv):
    return cli.config_from_args(cli.build_parser().parse_args(["serve", "--gpus", "none", *argv]))


def test_every_worker_loads_the_adapters_and_the_router_lists_them(model_dir):
    from pdserve.router.__main__ import build_parser as router_parser

    cfg = _cfg(["--model", str(model_dir), "--lora-modules", "sql=/a/sql,chat=/a/chat", "--max-lora-rank", "32",
                "--max-loras", "2"])
    assert cfg.enable_lora is True
    ws = plan_workers(cfg, model_dir, ports=[9001, 9002], cores=(0, 1))
    for w in ws:
        argv, env = worker_command(w, "s" * 32)
        assert "--enable-lora" in argv
        assert argv[argv.index("--max-lora-rank") + 1] == "32" and argv[argv.index("--max-loras") + 1] == "2"
        i = argv.index("--lora-modules")
        assert argv[i + 1:i + 3] == ["sql=/a/sql", "chat=/a/chat"]
        assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    a = router_parser().parse_args(router_command(cfg, ws, model_dir, 9000)[3:])
    assert parse_lora_modules(a.lora_modules) == {"sql": "/a/sql", "chat": "/a/chat"} and a.enable_lora is True


def test_lora_off_by_default_and_on_without_adapters(model_dir):
    for argv, on in (([], False), (["--enable-lora"], True)):
        cfg = _cfg(["--model", str(model_dir), *argv])
        w = plan_workers(cfg, model_dir, ports=[9001, 9002], cores=(0, 1))[0]
        wargv, env = worker_command(w, "s" * 32)
        assert ("--enable-lora" in wargv) is on and "--lora-modules" not in wargv
        assert ("VLLM_ALLOW_RUNTIME_LORA_UPDATING" in env) is on
        assert ("--enable-lora" in router_command(cfg, [w], model_dir, 9000)) is on


@pytest.mark.parametrize("kw, msg", [
    ({"lora_modules": "sql"}, "is not NAME=PATH"),
    ({"lora_modules": "a=/x,a=/y"}, "given twice"),
    ({"lora_modules": "m=/x", "served_model_name": "m"}, "served model's name"),
    ({"max_lora_rank": 12}, "one of vLLM's ranks"),
    ({"max_loras": 0}, "max_loras"),
])
def test_bad_lora_settings_say_how_to_fix(model_dir, kw, msg):
    with pytest.raises(ConfigError, match=msg):
        LauncherConfig(model=str(model_dir), **kw)
