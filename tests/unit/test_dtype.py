"""The CPU dtype rule (pdserve/dtype.py) and where it is applied: serve's worker argv and dry run, the default
model folder's conversion, the planner's measurement and calibration. Fake /proc/cpuinfo text throughout."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import pdserve.dtype
from pdserve import cli
from pdserve.dtype import DtypeChoice, DtypeError, choose_dtype, cpu_flags, normalize
from pdserve.launch.config import LauncherConfig

AVX2 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7R13\n"
        "flags\t\t: fpu sse sse2 avx avx2 fma f16c bmi2\n\n"
        "processor\t: 1\nflags\t\t: fpu sse sse2 avx avx2 fma f16c bmi2\n")
AVX512_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16\n"
AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n"
AMX_TILE_ONLY = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_tile\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 bf16\n"


def test_flags_are_read_from_flags_lines_only():
    assert cpu_flags(AVX2) == {"fpu", "sse", "sse2", "avx", "avx2", "fma", "f16c", "bmi2"}
    assert cpu_flags(ARM) == frozenset()
    assert cpu_flags("") == frozenset()


def test_avx512_bf16_picks_bf16():
    c = choose_dtype(cpuinfo=AVX512_BF16)
    assert c == DtypeChoice("bfloat16", "the CPU has avx512_bf16 (native bf16 matmuls); "
                                        "pass --dtype float32 to override")


def test_amx_picks_bf16():
    assert choose_dtype(cpuinfo=AMX).dtype == "bfloat16"
    assert "amx_bf16, amx_tile" in choose_dtype(cpuinfo=AMX).reason
    assert choose_dtype(cpuinfo=AMX_TILE_ONLY).dtype == "bfloat16"


def test_avx2_only_picks_fp32_and_says_why():
    c = choose_dtype(cpuinfo=AVX2)
    assert c.dtype == "float32"
    assert c.reason == ("the CPU has none of avx512_bf16, amx_bf16, amx_tile, so bf16 would be emulated "
                        "(~3x slower than fp32 on an AVX2 CPU); pass --dtype bfloat16 to override")
    assert c.describe().startswith("dtype float32: the CPU has none of")


def test_no_flags_or_no_cpuinfo_picks_fp32(monkeypatch):
    assert choose_dtype(cpuinfo=ARM).dtype == "float32"
    monkeypatch.setattr(pdserve.dtype, "CPUINFO", Path("/nonexistent/cpuinfo"))
    c = choose_dtype()
    assert c.dtype == "float32" and "unreadable" in c.reason


def test_override_wins_over_the_cpu():
    assert choose_dtype("float32", cpuinfo=AMX) == DtypeChoice("float32", "--dtype float32 given")
    assert choose_dtype("bfloat16", cpuinfo=AVX2) == DtypeChoice("bfloat16", "--dtype bfloat16 given")
    assert choose_dtype("bf16", cpuinfo=AVX2).dtype == "bfloat16"
    assert choose_dtype("FP32", cpuinfo=AMX).dtype == "float32"
    assert choose_dtype("float", cpuinfo=AMX).dtype == "float32"
    assert choose_dtype("", cpuinfo=AVX2).dtype == "float32"  # an empty flag value is no override


@pytest.mark.parametrize("bad, words", [
    ("fp8", "unknown: pass --dtype bfloat16 (alias bf16) or --dtype float32"),
    ("int4", "unknown"),
    ("float16", "not supported on CPU workers (vLLM's CPU backend has no fast fp16): pass --dtype bfloat16 or "
                "--dtype float32"),
    ("half", "no fast fp16"),
    ("auto", "unknown"),
])
def test_unknown_or_unsupported_override_is_refused(bad, words):
    with pytest.raises(DtypeError, match=re.escape(words)):
        choose_dtype(bad, cpuinfo=AMX)
    with pytest.raises(ValueError):
        normalize(bad)


# ----------------------------------------------------------------- pdserve serve


@pytest.fixture
def cpu(monkeypatch):
    """Set what /proc/cpuinfo says for the code under test."""

    def use(text: str | None) -> None:
        monkeypatch.setattr(pdserve.dtype, "read_cpuinfo", lambda path=None: text)

    return use


def _dtype_args(workers) -> set[str]:
    from pdserve.launch import worker_argv

    out = set()
    for w in workers:
        argv = list(worker_argv(w))
        out.add(argv[argv.index("--dtype") + 1])
    return out


def test_serve_workers_get_the_rules_dtype_unless_configured(cpu, model_dir):
    from pdserve.launch import plan_workers

    cpu(AVX2)
    assert _dtype_args(plan_workers(LauncherConfig(model=str(model_dir)), model_dir, cores=(0, 1))) == {"float32"}
    cpu(AMX)
    assert _dtype_args(plan_workers(LauncherConfig(model=str(model_dir), colocated=2), model_dir,
                                    cores=(0, 1))) == {"bfloat16"}
    cfg = LauncherConfig(model=str(model_dir), dtype="float32")
    assert _dtype_args(plan_workers(cfg, model_dir, cores=(0, 1))) == {"float32"}
    cpu(AVX2)
    cfg = LauncherConfig(model=str(model_dir), dtype="auto")  # vLLM's own choice, when asked for by name
    assert _dtype_args(plan_workers(cfg, model_dir, cores=(0, 1))) == {"auto"}


def test_serve_dry_run_says_which_dtype_and_why(cpu, model_dir, capsys):
    cpu(AVX2)
    assert cli.main(["serve", "--model", str(model_dir), "--port", "0", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "dtype float32: the CPU has none of avx512_bf16, amx_bf16, amx_tile" in out
    assert out.count("--dtype float32") == 2  # prefill0 and decode0
    assert cli.main(["serve", "--model", str(model_dir), "--port", "0", "--dry-run", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "dtype bfloat16: --dtype bfloat16 given" in out and "--dtype float32" not in out


def test_bench_compare_configs_leave_the_dtype_to_the_rule(cpu, model_dir):
    from pdserve.bench.compare import CompareSettings, launcher_config
    from pdserve.launch import plan_workers

    cpu(AVX2)
    cfg = launcher_config("colocated1", CompareSettings(model=str(model_dir), cores=(0, 1)))
    assert cfg.dtype is None and _dtype_args(plan_workers(cfg, model_dir)) == {"float32"}
    cfg = launcher_config("1p1d", CompareSettings(model=str(model_dir), cores=(0, 1), dtype="bfloat16"))
    assert _dtype_args(plan_workers(cfg, model_dir)) == {"bfloat16"}


# ----------------------------------------------------------------- the default model folder


@pytest.fixture
def gguf(tmp_path, monkeypatch) -> Path:
    import pdserve.launch.models

    path = tmp_path / "gguf" / pdserve.launch.models.GGUF_NAME
    path.parent.mkdir()
    path.write_bytes(b"x" * 100)
    monkeypatch.setattr(pdserve.launch.models, "smollm2_gguf_path", lambda: path)
    return path


def _converted(out: Path, dtype: str, gguf_bytes: int = 100) -> Path:
    from pdserve.launch.models import GGUF_NAME, STAMP

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"")
    (out / STAMP).write_text(json.dumps({"kind": "smollm2", "gguf": GGUF_NAME, "gguf_bytes": gguf_bytes,
                                         "dtype": dtype}))
    return out


def test_stale_reason_names_the_dtype_mismatch(cpu, gguf, tmp_path):
    from pdserve.launch.models import smollm2_stale_reason

    out = _converted(tmp_path / "m", "bfloat16")
    cpu(AVX2)
    assert smollm2_stale_reason(out) == "it holds bfloat16 weights and float32 is wanted"
    assert smollm2_stale_reason(out, "bfloat16") == ""
    cpu(AMX)
    assert smollm2_stale_reason(out) == ""
    assert smollm2_stale_reason(out, "fp32") == "it holds bfloat16 weights and float32 is wanted"
    _converted(out, "bfloat16", gguf_bytes=7)
    assert "another" in smollm2_stale_reason(out)
    assert smollm2_stale_reason(tmp_path / "none") == ""  # not converted yet: nothing stale
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "config.json").write_text("{}")
    assert smollm2_stale_reason(tmp_path / "own") == ""  # not ours (no stamp): left alone


def test_serve_converts_the_default_model_again_in_the_rules_dtype(cpu, gguf, tmp_path, monkeypatch):
    import pdserve.launch.models
    from pdserve import launch as launcher

    monkeypatch.setenv("PDSERVE_MODELS_DIR", str(tmp_path / "models"))
    want = tmp_path / "models" / "smollm2-135m-instruct"
    calls: list[str] = []

    def fake_convert(out, dtype=None):
        calls.append(choose_dtype(dtype).dtype)
        return _converted(Path(out), choose_dtype(dtype).dtype)

    monkeypatch.setattr(pdserve.launch.models, "convert_smollm2", fake_convert)
    logs: list[str] = []
    cpu(AMX)
    assert launcher.resolve_model(LauncherConfig(), logs.append) == want.resolve()
    assert launcher.resolve_model(LauncherConfig(), logs.append) == want.resolve()
    assert calls == ["bfloat16"]
    cpu(AVX2)  # the same folder on a CPU without bf16: converted again, and the log says why
    assert launcher.resolve_model(LauncherConfig(), logs.append) == want.resolve()
    assert calls == ["bfloat16", "float32"]
    assert "again: it holds bfloat16 weights and float32 is wanted" in logs[-1]
    assert launcher.resolve_model(LauncherConfig(), logs.append) == want.resolve()
    assert calls == ["bfloat16", "float32"]


def test_models_cli_refuses_a_bad_dtype(capsys):
    from pdserve.launch.models import main

    with pytest.raises(SystemExit) as e:
        main(["smollm2", "/nonexistent/out", "--dtype", "fp8"])
    assert e.value.code == 2
    assert "dtype 'fp8' unknown" in capsys.readouterr().err


# ----------------------------------------------------------------- the planner


def test_measure_runs_the_matmul_in_the_rules_dtype(cpu, monkeypatch):
    from pdserve.plan import measure

    seen: list[str] = []
    monkeypatch.setattr(measure, "matmul_flops", lambda dtype="bfloat16": seen.append(dtype) or 1e9)
    monkeypatch.setattr(measure, "copy_bytes_s", lambda: 1e9)
    monkeypatch.setattr(measure, "transfer_bytes_s", lambda: 1e9)
    cpu(AVX2)
    m = measure.measure_machine()
    assert (m.dtype, seen) == ("float32", ["float32"]) and "none of avx512_bf16" in m.dtype_reason
    cpu(AMX)
    assert measure.measure_machine().dtype == "bfloat16"
    assert measure.measure_machine("fp32").dtype == "float32"
    assert seen == ["float32", "bfloat16", "float32"]


def test_calibration_records_the_rules_dtype(cpu, monkeypatch, tmp_path):
    from pdserve.plan import calibrate

    async def fake_measure(url, **kw):
        return [(64, 0.05), (256, 0.1), (512, 0.2), (1024, 0.5)], [(1, 300, 0.03), (4, 1200, 0.05)]

    monkeypatch.setattr(calibrate, "measure", fake_measure)
    cpu(AVX2)
    cal = calibrate.calibrate("http://127.0.0.1:1", 1000, 1e9)
    assert cal.dtype == "float32" and "none of" in cal.dtype_reason
    cal.save(tmp_path / "cal.json")
    assert calibrate.Calibration.load(tmp_path / "cal.json").dtype == "float32"
    assert calibrate.calibrate("http://127.0.0.1:1", 1000, 1e9, dtype="bf16").dtype == "bfloat16"


def test_bench_report_names_the_workers_dtype(tmp_path):
    from pdserve.bench.report import write_report

    wl = {"goodput_req_per_s": 1.0, "tpot_p99_ms": 50.0, "ttft_p50_ms": 100.0, "errors": 0}
    res = {"order": ["colocated1"], "workloads": ["w"], "slo": {"ttft_ms": 1, "tpot_ms": 1}, "cores": [0, 1],
           "dtype": {"dtype": "float32", "reason": "the CPU has none of avx512_bf16, amx_bf16, amx_tile"},
           "configs": {"colocated1": {"startup_s": 1.0, "workers": 1, "workloads": {"w": wl}}}}
    write_report(res, tmp_path, plots=False)
    assert ("Workers' dtype: float32 (the CPU has none of avx512_bf16, amx_bf16, amx_tile)."
            in (tmp_path / "report.md").read_text())
