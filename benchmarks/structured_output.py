"""Structured output: what guided decoding costs, same process.

1. Engine decode on the model (default: the bundled one): --requests prompts, each --max-tokens sampled
   tokens (ignore_eos, so every mode emits the same number), unconstrained and with a regex and with
   OpenAI's json_object mode. Prints ms per step and the ratio to unconstrained. The grammar's masks
   are computed the first time a state is reached and cached, so the run is repeated and the best kept.
2. Mask cost at DeepSeek-V3's vocabulary size (129280) on a synthetic byte-level vocabulary (the real
   tokenizer is not on this machine): building the byte table, a state's first mask, applying a cached one.

Figures, never pass/fail. Usage: python benchmarks/structured_output.py [--model PATH] [--requests 16]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def engine_part(a) -> None:
    from moeserve import LLM, SamplingParams, StructuredOutputsParams as SO

    llm = LLM(a.model, max_num_seqs=a.requests)
    prompts = [[(31 * i + 7 * j) % 900 + 50 for j in range(16)] for i in range(a.requests)]
    modes = [("unconstrained", None), ("regex [a-z ,.]+", SO(regex="[a-z ,.]+")),
             ("json_object", SO(json_object=True))]
    base = None
    print(f"engine: {a.requests} requests x {a.max_tokens} tokens, temperature 1, best of {a.repeats}")
    for label, spec in modes:
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=a.max_tokens, ignore_eos=True,
                                structured_outputs=spec)
        best = float("inf")
        for _ in range(a.repeats):
            t = time.perf_counter()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            best = min(best, time.perf_counter() - t)
        assert all(len(o.outputs[0].token_ids) == a.max_tokens for o in outs)
        per_step = best / a.max_tokens * 1e3
        base = base or per_step
        print(f"  {label:18s} {per_step:7.2f} ms/step  x{per_step / base:.2f}")


def mask_part(a) -> None:
    import torch
    from moeserve.structured.automaton import compile_dfa
    from moeserve.structured.grammar import GrammarMatcher, TokenGrammar, TokenTable
    from moeserve.structured.json_schema import json_object

    rng = random.Random(0)
    alphabet = b'abcdefghijklmnopqrstuvwxyz   ,.:"{}[]0123456789ABCDEF\n'
    pieces = [bytes([b]) for b in range(256)]
    while len(pieces) < a.vocab:  # BPE-like lengths: mostly short, a long tail
        n = min(64, int(rng.expovariate(1 / 5)) + 1)
        pieces.append(bytes(rng.choice(alphabet) for _ in range(n)))
    t = time.perf_counter()
    table = TokenTable(pieces)
    print(f"masks at vocab {a.vocab}: byte table built in {(time.perf_counter() - t) * 1e3:.0f} ms (once per engine)")
    t = time.perf_counter()
    dfa = compile_dfa(json_object())  # not compile_params: its cache holds the engine part's copy
    print(f"  json_object automaton: {dfa.num_states} states, compiled in {(time.perf_counter() - t) * 1e3:.0f} ms "
          "(cached per pattern)")
    grammar = TokenGrammar(dfa, table)
    states = list(range(1, min(dfa.num_states, 201)))
    t = time.perf_counter()
    for s in states:
        grammar.allowed(s)
    first = (time.perf_counter() - t) / len(states) * 1e3
    logits = torch.randn(1, a.vocab)
    matcher = GrammarMatcher(grammar)
    t = time.perf_counter()
    for _ in range(200):
        mask = matcher.row_masks([], [], [1])
        logits.masked_fill(~mask, float("-inf"))
    cached = (time.perf_counter() - t) / 200 * 1e3
    t = time.perf_counter()
    for _ in range(200):
        torch.multinomial(logits.softmax(-1), 1)
    sample = (time.perf_counter() - t) / 200 * 1e3
    print(f"  first mask of a state: {first:.2f} ms; a cached mask applied to one row: {cached:.3f} ms "
          f"(sampling that row: {sample:.3f} ms)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=129280)
    a = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    engine_part(a)
    mask_part(a)


if __name__ == "__main__":
    main()
