"""`moeserve eval-quant`: a quantized model against its high-precision original on the same inputs
(logit cosine similarity, top-1 and greedy agreement, perplexity on held-out text; see quant_eval.py)."""
from __future__ import annotations

import json
import os
import sys
import sysconfig

from moeserve.help_format import HelpFormatter
from moeserve.engine_args import EngineArgs

DEFAULT_TEXT = os.path.join(sysconfig.get_paths()["stdlib"], "calendar.py")  # held out by the bundled model


def register(sub) -> None:
    p = sub.add_parser("eval-quant", help="accuracy of a quantized model vs its BF16 original",
                       formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint to quantize (default: the bundled model)")
    p.add_argument("--reference", default=None,
                   help="high-precision checkpoint to compare with (default: --model, without quantization)")
    p.add_argument("--quantization", default="a8w8", help="method of the quantized side")
    p.add_argument("--text-file", default=DEFAULT_TEXT, help="held-out text for perplexity and logits")
    p.add_argument("--max-text-tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=256, help="tokens per scored window")
    p.add_argument("--num-prompts", type=int, default=4, help="greedy prompts taken from the text")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--num-tokens", type=int, default=256, help="greedy tokens per prompt")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    EngineArgs.add_cli_args(p, skip=("model", "quantization"))
    p.set_defaults(func=run, dtype="bfloat16")


def run(args) -> int:
    from moeserve.llm import LLM
    from moeserve.quant_eval import evaluate

    for flag in ("max_text_tokens", "window", "num_prompts", "prompt_len", "num_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    if not os.path.isfile(args.text_file):
        raise FileNotFoundError(f"--text-file {args.text_file!r} does not exist")
    _check_lengths_fit(args)
    engine = {k: v for k, v in vars(EngineArgs.from_cli(args, None)).items() if k not in ("model", "quantization")}
    ref = LLM(args.reference or args.model, **engine)
    if ref.config.quant.method is not None:
        raise ValueError(f"the reference {ref.config.model.model} is itself quantized; pass a float --reference")
    quant = LLM(args.model, quantization=args.quantization, **engine)
    with open(args.text_file, encoding="utf-8", errors="replace") as f:
        ids = ref.tokenizer.encode(f.read())[: args.max_text_tokens]
    step = max(len(ids) // args.num_prompts, 1)
    prompts = [p for p in (ids[i * step: i * step + args.prompt_len] for i in range(args.num_prompts)) if p]
    result = evaluate(ref, quant, ids, prompts, args.num_tokens, args.window).as_dict()
    result.update(model=quant.config.model.model, reference=ref.config.model.model,
                  quantization=args.quantization, dtype=args.dtype, text_file=args.text_file)
    for k, v in result.items():
        print(f"{k:22s} {v:.4f}" if isinstance(v, float) else f"{k:22s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(f"quantized {quant.config.model.model} vs {ref.config.model.model}", file=sys.stderr)
    return 0


def _check_lengths_fit(args) -> None:
    """Scored windows and greedy prompt + continuation are single sequences: each must be shorter than the
    context (the engine's limit), or the engine rejects a "prompt" the user never wrote."""
    from moeserve.arch import DeepseekArch
    from moeserve.models.registry import resolve_model_path

    if args.max_model_len is not None:
        limit, what = args.max_model_len, f"--max-model-len {args.max_model_len}"
    else:
        paths = {resolve_model_path(p) for p in (args.model, args.reference or args.model)}
        limit = min(DeepseekArch.from_pretrained(p).max_position_embeddings for p in paths)
        what = f"the model's context length {limit} (max_position_embeddings)"
    if args.window >= limit:
        raise ValueError(f"--window {args.window} does not fit {what}: a scored window must be shorter than "
                         "the context; lower --window or raise --max-model-len")
    if args.prompt_len + args.num_tokens >= limit:
        raise ValueError(f"--prompt-len {args.prompt_len} + --num-tokens {args.num_tokens} does not fit {what}: "
                         "each greedy prompt and its continuation are scored as one sequence, which must be "
                         "shorter than the context; lower --num-tokens/--prompt-len or raise --max-model-len")
