"""llguidance and xgrammar side by side on this CPU: what a JSON-schema mask costs per token at the embedded
model's 49,152-token vocabulary, and what applying it costs (agl.policy.grammar.mask_bias).

For each library that imports: building its tokenizer view (once per process), compiling the schema,
and the time to fill the next-token bitmask before each token of a 64-token JSON reply (median, p90,
max, mean over the tokens, 5 passes). Then the engine's additive mask for 32 rows from their bitmasks.
xgrammar is not a dependency (it needs torch, transformers, triton and apache-tvm-ffi): measure it from
a throwaway venv that sees this one's packages, e.g.

    python -m venv --system-site-packages /tmp/xg && /tmp/xg/bin/pip install --no-deps xgrammar apache-tvm-ffi
    echo /work/main/.venv/lib/python3.11/site-packages > /tmp/xg/lib/python3.11/site-packages/main.pth
    PYTHONPATH=. /tmp/xg/bin/python bench/grammar_libraries.py

    PYTHONPATH=. /work/main/.venv/bin/python bench/grammar_libraries.py   # llguidance only
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import statistics
import time

import torch

from bench.common import model_config

SCHEMA = {
    "type": "object",
    "properties": {
        "reasoning": {"type": "string"},
        "answer": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
    },
    "required": ["reasoning", "answer", "tags"],
    "additionalProperties": False,
}
REPLY = {"reasoning": "Two plus two is four, since we add the two numbers together. " * 3, "answer": 4, "tags": ["a"]}


def stats(seconds: list[float]) -> str:
    ms = sorted(s * 1e3 for s in seconds)
    return (
        f"median {ms[len(ms) // 2]:.4f} ms, p90 {ms[int(0.9 * len(ms))]:.4f}, max {ms[-1]:.3f}, "
        f"mean {statistics.fmean(ms):.4f}"
    )


def llguidance_run(tokenizer, ids: list[int], vocab: int) -> dict:
    import llguidance

    from agl.policy.grammar import Grammar, GrammarState, grammar_tokenizer

    start = time.perf_counter()
    lltok = grammar_tokenizer(tokenizer, vocab, [tokenizer.eos_token_id])
    build = time.perf_counter() - start
    start = time.perf_counter()
    grammar = Grammar.json_schema(SCHEMA)
    GrammarState(grammar, lltok)
    compile_s = time.perf_counter() - start
    masks = []
    bitmask = torch.empty(((vocab + 31) // 32,), dtype=torch.int32)
    for _ in range(5):
        state = GrammarState(grammar, lltok)
        for token in ids:
            start = time.perf_counter()
            state.fill(bitmask)
            masks.append(time.perf_counter() - start)
            assert state.consume(token), state.error
    return {
        "library": f"llguidance {llguidance.__version__}",
        "tokenizer_s": build,
        "compile_s": compile_s,
        "mask": masks,
    }


def xgrammar_run(tokenizer, ids: list[int], vocab: int) -> dict:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info)
    build = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    compile_s = time.perf_counter() - start
    masks = []
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    for _ in range(5):
        matcher = xgrammar.GrammarMatcher(compiled)
        for token in ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            masks.append(time.perf_counter() - start)
            assert matcher.accept_token(token)
    return {
        "library": f"xgrammar {importlib.metadata.version('xgrammar')}",
        "tokenizer_s": build,
        "compile_s": compile_s,
        "mask": masks,
    }


def main() -> None:
    from transformers import AutoTokenizer

    from agl.policy.grammar import mask_bias
    from agl.policy.load import resolve_model_path

    cfg = model_config("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.path, cfg.cache_dir, cfg.tiny))
    vocab = len(tokenizer)
    ids = tokenizer.encode(json.dumps(REPLY), add_special_tokens=False)
    print(f"vocabulary {vocab}, reply {len(ids)} tokens, torch threads {torch.get_num_threads()}\n")
    print("| library | tokenizer view s | schema compile ms | mask per token |")
    print("| --- | ---: | ---: | --- |")
    for name, run in (("llguidance", llguidance_run), ("xgrammar", xgrammar_run)):
        if importlib.util.find_spec(name) is None:
            print(f"| {name} | not installed | | |")
            continue
        result = run(tokenizer, ids, vocab)
        timings = f"{result['tokenizer_s']:.2f} | {result['compile_s'] * 1e3:.1f} | {stats(result['mask'])}"
        print(f"| {result['library']} | {timings} |")
    bitmask = torch.randint(-(2**31), 2**31 - 1, (32, (vocab + 31) // 32), dtype=torch.int32)
    for threads in (1, torch.get_num_threads()):
        torch.set_num_threads(threads)
        mask_bias(bitmask, vocab)
        start = time.perf_counter()
        for _ in range(50):
            mask_bias(bitmask, vocab)
        print(f"\nmask_bias, 32 rows, {threads} thread(s): {(time.perf_counter() - start) / 50 * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
