"""`moeserve generate`: run prompts through the offline engine and print the completions."""
from __future__ import annotations

import sys
import time

from moeserve.help_format import HelpFormatter
from moeserve.config_file import CONFIG_HELP
from moeserve.engine_args import EngineArgs


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline (default: the bundled model)",
                       description="Generate text offline. One run of a few prompts does not pay for compiling "
                                   "decode graphs, so this command runs eagerly unless -O 3 (or "
                                   "--compilation-config) asks for them.", formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    p.add_argument("--config", default=None, help=CONFIG_HELP)
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text; repeat for a batch (default: a short Python prompt)")
    p.add_argument("--max-tokens", type=int, default=64)
    gen = "(default: the model's generation_config.json, else %s)"
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy " + gen % "0")
    p.add_argument("--top-p", type=float, default=None, help=gen % "1")
    p.add_argument("--top-k", type=int, default=None, help="-1 = off " + gen % "-1")
    p.add_argument("--min-p", type=float, default=None, help=gen % "0")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2], over generated tokens")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2], per occurrence")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 0, over prompt and generated tokens (1 = off) " + gen % "1")
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def engine_args_for(args, num_prompts: int) -> EngineArgs:
    """The command's engine options. One run of a few prompts does not pay back compiling decode graphs
    (seconds per graph), so it runs eagerly unless --compilation-config / -O asks; a level alone (-O 3)
    compiles only the graphs these prompts can use."""
    engine_args = EngineArgs.from_cli(args, args.model)
    level = engine_args.compilation_config
    if level is None and engine_args.cudagraph_capture_sizes is None and engine_args.optimization_level is None \
            and engine_args.max_cudagraph_capture_size is None:
        engine_args.compilation_config = {"mode": 0}
    elif str(level).strip().isdigit():
        spec = engine_args.speculative()
        per_seq = 1 + (spec.num_speculative_tokens if spec else 0)
        engine_args.compilation_config = {"mode": int(level), "max_cudagraph_capture_size": num_prompts * per_seq}
    return engine_args


def run(args) -> int:
    from moeserve.llm import LLM
    from moeserve.sampling_params import SamplingParams

    prompts = args.prompt or ["def fibonacci(n):"]
    llm = LLM(**vars(engine_args_for(args, len(prompts))))
    # Flags given win; then the checkpoint's generation_config (--generation-config); then greedy.
    given = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
             if getattr(args, k) is not None}
    fields = {"temperature": 0.0, **{k: v for k, v in llm.default_sampling.items() if k != "max_tokens"}, **given}
    params = SamplingParams(max_tokens=args.max_tokens, seed=args.sampling_seed, stop=args.stop,
                            ignore_eos=args.ignore_eos, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, **fields)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    n_tokens = 0
    for out in outputs:
        comp = out.outputs[0]
        n_tokens += len(comp.token_ids)
        print(f"--- prompt: {out.prompt!r}")
        print(out.prompt + comp.text)
        print(f"--- {len(comp.token_ids)} tokens, finish_reason={comp.finish_reason}")
    print(f"model: {llm.config.model.model}", file=sys.stderr)
    print(f"{n_tokens} tokens in {elapsed:.2f} s ({n_tokens / elapsed:.1f} tokens/s)", file=sys.stderr)
    return 0
