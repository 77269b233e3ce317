"""Run by test_cpu_rewind_vllm.py in a process of its own: seeded requests whose 600-token prompts are prefilled
under ``max_num_batched_tokens`` = argv[2] on one in-process vLLM CPU engine of the model at argv[1]; prints one
line ``RESULT {seed: token ids or "FAIL ..."}`` (a failure ends the run: vLLM's engine does not survive it)."""

from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    model, budget = sys.argv[1], int(sys.argv[2])
    llm = LLM(model=model, dtype="float32", max_model_len=2048, max_num_batched_tokens=budget,
              enable_chunked_prefill=True, enforce_eager=True, max_num_seqs=4, kv_cache_memory_bytes=64 << 20)
    out: dict[int, object] = {}
    for seed in (3, 4, 5):
        prompt = {"prompt_token_ids": [1500 + (i * seed) % 400 for i in range(600)]}
        sp = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
        try:
            out[seed] = list(llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids)
        except Exception as e:  # vLLM's own failure, reported
            out[seed] = f"FAIL {type(e).__name__}: {str(e)[:200]}"
            break
    print("RESULT", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
