"""Structured output: what guided decoding costs, same process; llguidance (moeserve's engine) against xgrammar
(vLLM's other backend) in the same run. The hand-written engine these replaced was removed (issue 40); its
figures from the earlier run are in docs/structured-output.md.

1. Engine decode on the model (default: the bundled one): --requests prompts, each --max-tokens sampled
   tokens (ignore_eos, so every mode emits the same number), unconstrained and with a regex and with
   OpenAI's json_object mode. Prints ms per step and the ratio to unconstrained; best of --repeats.
2. llguidance vs xgrammar (when installed) at --vocab (default DeepSeek-V3's 129280) on a synthetic
   byte-level vocabulary (the real tokenizer is not on this machine): compile time of a large JSON schema
   (API side; the engine side's per-request matcher beside it) and mask time per token at batch 1 and 32
   along random valid outputs (the same draws for each engine). Median of --repeats, [min, max].

Figures, never pass/fail. Usage: python benchmarks/structured_output.py [--model PATH] [--requests 16]
       [--parts engine,compare]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def engine_part(a) -> None:
    from moeserve import LLM, SamplingParams, StructuredOutputsParams as SO

    llm = LLM(a.model, max_num_seqs=a.requests)
    prompts = [[(31 * i + 7 * j) % 900 + 50 for j in range(16)] for i in range(a.requests)]
    modes = [("unconstrained", None), ("regex [a-z ,.]+", SO(regex="[a-z ,.]+")), ("json_object", SO(json_object=True))]
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
        print(f"  {label:28s} {per_step:7.2f} ms/step  x{per_step / base:.2f}")


# --- llguidance vs xgrammar, same run -----------------------------------------------------------------------

def synthetic_vocab(n: int) -> list[bytes]:
    """256 single bytes, then BPE-like pieces (mostly short, a long tail) of JSON-ish text; the last id is
    the end token (no bytes)."""
    rng = random.Random(0)
    alphabet = b'abcdefghijklmnopqrstuvwxyz   ,.:"{}[]0123456789ABCDEF\n_-'
    pieces, seen = [bytes([b]) for b in range(256)], set()
    while len(pieces) < n - 1:
        k = min(32, int(rng.expovariate(1 / 4)) + 2)
        p = bytes(rng.choice(alphabet) for _ in range(k))
        if p not in seen:
            seen.add(p)
            pieces.append(p)
    return pieces + [None]


def big_schema(n_props: int = 60, n_enum: int = 500) -> dict:
    """A wide schema (no numeric bounds, as in the earlier run that measured the hand-written engine too):
    strings, integers, a big enum, booleans, $ref'd objects, arrays."""
    kinds = [{"type": "string", "maxLength": 16}, {"type": "integer"},
             {"enum": [f"value-{i}" for i in range(n_enum)]}, {"type": "boolean"}, {"$ref": "#/$defs/Item"},
             {"type": "array", "items": {"type": "number"}, "maxItems": 4}]
    props = {f"p{i}": kinds[i % len(kinds)] for i in range(n_props)}
    return {"type": "object", "properties": props, "required": list(props), "$defs": {"Item": {
        "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 8},
                                         "ok": {"type": "boolean"}}, "required": ["id", "name", "ok"]}}}


class _Guidance:
    name = "llguidance"

    def __init__(self, pieces):
        import llguidance
        from moeserve.structured.matcher import GuidanceVocab

        class Wrap:
            eos_token_id, bos_token_id, special_token_ids = len(pieces) - 1, None, [len(pieces) - 1]
            tokens = [p if p is not None else b"<eos>" for p in pieces]

            def __call__(self, s):  # only used for tail bytes after a marker: greedy per byte
                return list(s.encode() if isinstance(s, str) else s)
        self.vocab = GuidanceVocab(llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrap())), pieces,
                                   [len(pieces) - 1])
        self.eos = len(pieces) - 1

    def forget(self):  # the engine's per-grammar template matchers
        self.vocab.templates.clear()

    def compile(self, schema):
        from moeserve.structured.guidance import compile_grammar
        from moeserve.structured.params import StructuredOutputsParams
        return compile_grammar(StructuredOutputsParams(json=schema))

    def matcher(self, compiled):
        from moeserve.structured.matcher import GuidanceMatcher
        m = GuidanceMatcher(self.vocab, compiled)
        row = lambda out: m.row_masks(out, [], [self.eos])[0]  # noqa: E731
        row.gm = m
        return row

    def step(self, ms, outs):  # as apply_grammar_masks: the batch's first rows on llguidance's thread pool
        from moeserve.structured.matcher import prefetch_masks
        if len(ms) > 1:
            prefetch_masks([(m.gm, o) for m, o in zip(ms, outs)])
        return [m(o) for m, o in zip(ms, outs)]


class _XGrammar:
    name = "xgrammar"

    def __init__(self, pieces):
        import xgrammar as xgr
        self.xgr = xgr
        self.eos = len(pieces) - 1
        self.info = xgr.TokenizerInfo([p if p is not None else b"" for p in pieces], stop_token_ids=[self.eos])
        self.n = len(pieces)

    def compile(self, schema):  # needs the tokenizer: API side only if it has the engine's vocabulary
        c = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return c.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        import numpy as np
        import torch
        xgr, n = self.xgr, self.n
        m = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, n)
        state = {"k": 0}

        def row(out):
            for t in out[state["k"]:]:
                m.accept_token(t)
            state["k"] = len(out)
            m.fill_next_token_bitmask(bitmask, 0)  # int32 words; unpacked to the engine's bool row
            bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:n]
            return torch.from_numpy(bits.astype(np.bool_))
        return row


def _median_spread(xs):
    xs = sorted(xs)
    return statistics.median(xs), xs[0], xs[-1]


def compile_times(a, engines, schema, label):
    from moeserve.structured.errors import PatternError
    print(f"compile a {len(json.dumps(schema))}-byte schema ({label}), median of {a.repeats} [min, max]:")
    compiled = {}
    for e in engines:
        api, eng, again = [], [], []
        try:
            for _ in range(a.repeats):
                t = time.perf_counter()
                c = e.compile(schema)
                api.append(time.perf_counter() - t)
                getattr(e, "forget", lambda: None)()
                t = time.perf_counter()
                e.matcher(c)  # the engine's first request of this grammar
                eng.append(time.perf_counter() - t)
                t = time.perf_counter()
                e.matcher(c)  # a later one
                again.append(time.perf_counter() - t)
                compiled[e.name] = c
        except PatternError as err:
            print(f"  {e.name:10s} refused: {err}")
            continue
        m, lo, hi = _median_spread(api)
        me, loe, hie = _median_spread(eng)
        ma, loa, hia = _median_spread(again)
        print(f"  {e.name:10s} compile {m * 1e3:8.1f} ms [{lo * 1e3:.1f}, {hi * 1e3:.1f}]   engine-side matcher: "
              f"first {me * 1e3:6.2f} ms [{loe * 1e3:.2f}, {hie * 1e3:.2f}], "
              f"later {ma * 1e3:6.3f} ms [{loa * 1e3:.3f}, {hia * 1e3:.3f}]")
    return compiled


def compare_part(a) -> None:
    pieces = synthetic_vocab(a.vocab)
    engines = []
    for cls in (_Guidance, _XGrammar):
        t = time.perf_counter()
        try:
            e = cls(pieces)
        except ImportError as err:
            print(f"  {cls.name}: not installed ({err})")
            continue
        engines.append(e)
        print(f"  {e.name}: vocabulary prepared in {(time.perf_counter() - t) * 1e3:.0f} ms (once per engine)")
    for label, schema in (("60 properties, a 500-value enum, $defs", big_schema()),
                          ("18 properties, a 200-value enum, $defs", big_schema(18, 200))):
        compiled = compile_times(a, engines, schema, label)
    for batch in (1, 32):
        print(f"mask per token, batch {batch}: {a.steps} steps of {batch} requests (random allowed tokens, "
              f"seeded alike), ms per request-token, median of {a.repeats} [min, max]:")
        base = None
        for e in engines:
            runs = []
            for rep in range(a.repeats + 1):  # the first is a warm-up
                rng = random.Random(rep)
                ms = [e.matcher(compiled[e.name]) for _ in range(batch)]
                outs = [[] for _ in range(batch)]
                spent = 0.0
                for _ in range(a.steps):
                    t = time.perf_counter()
                    rows = e.step(ms, outs) if hasattr(e, "step") else [m(o) for m, o in zip(ms, outs)]
                    spent += time.perf_counter() - t
                    for i, r in enumerate(rows):
                        ok = r.nonzero().flatten().tolist()
                        ok = [x for x in ok if x != e.eos]
                        if not ok:  # complete: a new request
                            ms[i], outs[i] = e.matcher(compiled[e.name]), []
                        else:
                            outs[i].append(rng.choice(ok))
                if rep:
                    runs.append(spent / (a.steps * batch))
            m, lo, hi = _median_spread(runs)
            base = base or m
            print(f"  {e.name:10s} {m * 1e3:7.3f} ms [{lo * 1e3:.3f}, {hi * 1e3:.3f}]  x{m / base:.2f} of llguidance")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--steps", type=int, default=48, help="decode steps of part 3")
    ap.add_argument("--parts", default="engine,compare")
    a = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    parts = a.parts.split(",")
    if "engine" in parts:
        engine_part(a)
    if "compare" in parts:
        compare_part(a)


if __name__ == "__main__":
    main()
