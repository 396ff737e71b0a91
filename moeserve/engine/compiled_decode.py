"""The decode forward as compiled static-shape graphs, one per token-count bucket (off with --enforce-eager).

A step whose rows are all decode rows (one per sequence, or 1 + k with MTP drafts being verified) is padded
to the next bucket size; so are the MTP proposer's passes over decode rows (attach_mtp). Each decoder layer then runs through torch.compile(fullgraph=True, dynamic=False)
of one shared function (regional compilation: one graph per layer kind and bucket, reused by every layer of
that kind, whose weights are graph inputs): inductor fuses the norms, rotary, router, SwiGLU, INT8 activation
quantization and residual adds between the GEMMs, and the layers' Python runs once at trace time instead of
every step. Attention (cache write + MLA over the paged cache) and routed experts that cannot be traced
(INT8, multi-rank dispatch) are opaque ops inside the graph (layers/opaque.py), and so are tensor
parallelism's collectives (attention's all-reduce; the MoE block whole); the attention metadata and
the sampling inputs are prepared outside, as for the eager path. Padding rows have no metadata: attention
returns zeros for them and their outputs are dropped.

Eager instead: prefill and mixed steps, decode steps past the largest bucket,
FlashComm, --enable-dbo, and CUDA (where the
same buckets are meant as CUDA graphs: not built yet). Every bucket is compiled at start-up (warm_up);
--compilation-config cudagraph_capture_sizes picks the buckets. Inductor caches its compiled kernels on disk
(TORCHINDUCTOR_CACHE_DIR, default ~/.cache/moeserve/inductor), so a later start only re-traces.
MOESERVE_ENFORCE_EAGER=1 in the environment makes every engine of the process tree eager (the test suite
sets it: the compiled path has its own tests).
"""
from __future__ import annotations

import logging
import os
import time

import torch

from moeserve.config import decode_graph_sizes_up_to

logger = logging.getLogger(__name__)

# Keep eager's rounding to the model dtype between fused ops (BF16): the graph then gives the eager path's
# tokens instead of drifting from them wherever greedy is near a tie.
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}

# Default graphs for decode steps of up to 64 rows (64 sequences, or 32 with one MTP draft each): compiled at
# start-up in about a minute here (cold inductor cache). The gain shrinks as the GEMMs grow (1.07-1.35x at
# batch 32 against 1.28-1.34x at batch 1, benchmarks/decode_speed.py); larger steps run eagerly.
MAX_DEFAULT_BUCKET = 64


def buckets_for(max_tokens: int, sizes: tuple[int, ...] | None = None) -> list[int]:
    """Bucket sizes: by default powers of two covering 1..min(max_tokens, 64), the last one the cap itself;
    with `sizes` (--compilation-config cudagraph_capture_sizes) those of them a step can reach."""
    if sizes is not None:
        return sorted({n for n in sizes if n <= max_tokens}) or [min(sizes)]
    return list(decode_graph_sizes_up_to(min(max_tokens, MAX_DEFAULT_BUCKET)))


def why_eager(config, arch, device: torch.device) -> str | None:
    """Why this engine runs its decode eagerly, or None when the compiled graphs apply."""
    par = config.parallel
    if config.model.enforce_eager:
        return "--enforce-eager"
    if os.environ.get("MOESERVE_ENFORCE_EAGER") == "1":
        return "MOESERVE_ENFORCE_EAGER=1"
    if device.type != "cpu":
        return f"no {device.type} graphs yet"
    if par.token_sharding != "off":
        return "--flashcomm"
    if par.enable_dbo:
        return "--enable-dbo"
    return None


_LAYER_KINDS = 3


def decode_graph_tokens(config) -> tuple[int, int]:
    """(rows per sequence in a decode step: 1 + MTP drafts, the most rows a decode graph takes)."""
    sched = config.scheduler
    per_seq = 1 + (config.speculative.num_speculative_tokens if config.speculative else 0)
    return per_seq, min(sched.max_num_seqs * per_seq, sched.max_num_batched_tokens)


def warm_up_prefill_kernels(runner) -> None:
    """The prefill-sized kernels an engine that compiles uses: A8W8's activation quantizer, the routed experts'
    passes around their GEMMs."""
    if runner.config.quant.method == "a8w8":
        warm_up_quantizer(runner.arch.hidden_size, runner.dtype)
    if runner.arch.n_routed_experts:
        warm_up_expert_epilogue(runner.model, runner.dtype, runner.arch.num_experts_per_tok)


def warm_up_quantizer(width: int, dtype: torch.dtype) -> None:
    """Switch A8W8's per-token activation quantization of prefill-sized inputs to its compiled kernel
    (moeserve/int8.py) and compile it now, for the model dtype and float32 (the SwiGLU output the experts'
    down projection quantizes), instead of in the first request's prefill. Process-wide: an eager engine
    started later in the same process uses it too."""
    from moeserve import int8

    int8.compile_quantizer()
    start = time.perf_counter()
    with torch.inference_mode():  # the engine's mode: dynamo guards on it
        for dt in (dtype, torch.float32):
            int8.quantize_per_token(torch.ones(int8.COMPILED_MIN_ROWS, width, dtype=dt))
    logger.info("prefill INT8 quantizer compiled in %.1f s", time.perf_counter() - start)


def warm_up_expert_epilogue(model: torch.nn.Module, dtype: torch.dtype, top_k: int) -> None:
    """Switch the routed experts' passes around their GEMMs at prefill sizes to their kernels
    (layers/moe/expert_epilogue.py) and compile now the ones this model's experts take, for its shapes and
    dtypes, instead of in the first request's prefill. Process-wide, like warm_up_quantizer. Experts on a
    fused kernel (zentorch, amx) or without packed copies take none: nothing is compiled for them."""
    from moeserve.layers.moe import expert_epilogue
    from moeserve.layers.moe.experts import FusedExperts
    from moeserve.layers.quant import Int8FusedExperts, expert_out_dtype

    combine, swiglu = set(), set()  # (expert output dtype, hidden); SwiGLU widths
    out_dtype = expert_out_dtype(dtype)  # what INT8 experts' GEMMs write
    for m in model.modules():
        if type(m) is FusedExperts and m.packed is not None and not m.fused:
            combine.add((m.w13.dtype, m.w13.shape[-1]))
        elif isinstance(m, Int8FusedExperts) and not m.fused:
            combine.add((out_dtype, m.w13.shape[-1]))
            swiglu.add(m.intermediate)
    if not combine:
        return
    expert_epilogue.enable()
    start = time.perf_counter()
    tokens = -(-expert_epilogue.MIN_ROWS // top_k)
    rows = tokens * top_k
    with torch.inference_mode():
        for y_dtype, hidden in combine:
            expert_epilogue.combine(torch.zeros(rows, hidden, dtype=y_dtype), torch.ones(rows), torch.arange(rows),
                                    tokens, top_k, dtype)
        for width in swiglu:
            if expert_epilogue.swiglu_quant_for(rows, width):
                expert_epilogue.swiglu_quant(torch.ones(rows, 2 * width, dtype=out_dtype), torch.ones(rows, 1), width)
    logger.info("prefill expert epilogue compiled in %.1f s", time.perf_counter() - start)


def _configure_cache() -> None:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        os.environ.get("MOESERVE_CACHE", os.path.expanduser("~/.cache/moeserve")), "inductor"))


class DirectGraphs:
    """A torch.compile'd layer function whose graphs, once dynamo has picked one for a (module, row count),
    are called directly on later calls with the same key, without dynamo's frame evaluation.

    Dynamo picks a graph on every call by walking the function's cache entries and evaluating their guards,
    which check every weight the layer's graph reads: ~70-110 us a layer on this CPU, ~0.9 ms of a ~25 ms
    batch-1 step of the bench model's 8 layers (a 61-layer V3 pays it 61 times a step). The decode graphs'
    inputs are fixed per (layer, bucket), so the entry dynamo picked the first time is the one it would pick
    again, until the layer's modules change in place (forget(): online EPLB's expert moves) or the engine's
    graphs are rebuilt (a new CompiledDecode, as after an elastic re-formation). The key holds the grad /
    inference mode too, the global state the entries are guarded on. MOESERVE_CHECK_GRAPH_GUARDS=1 evaluates
    the chosen entry's guards on every direct call and raises where they fail (the compiled path's tests run
    with it). vLLM's compile wrapper dispatches to its compiled code past dynamo the same way."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.compiled = torch.compile(fn, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)
        self.direct: dict[tuple, tuple] = {}  # key -> (entry's code as a function, its guard manager)
        self.check_guards = os.environ.get("MOESERVE_CHECK_GRAPH_GUARDS") == "1"
        self.direct_calls = 0

    def __call__(self, module: torch.nn.Module, *args: torch.Tensor) -> torch.Tensor:
        key = (id(module), args[0].shape[0], torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        hit = self.direct.get(key)
        if hit is None:
            out = self.compiled(module, *args)  # dynamo's lookup (compiling on a miss)
            entry = self._entry(module, args)
            if entry is not None:
                self.direct[key] = entry
            return out
        call, guards = hit
        if self.check_guards and not guards.check(self._locals(module, args)):
            why = guards.check_verbose(self._locals(module, args)).verbose_code_parts
            raise RuntimeError(f"the decode graph chosen for {type(module).__name__} at {args[0].shape[0]} rows "
                               f"no longer passes its guards ({'; '.join(why)[:400]}): a layer changed in place "
                               "without forget()")
        self.direct_calls += 1
        return call(module, *args)

    def forget(self) -> None:
        """Back to dynamo's lookup for every key (once each): some layer's modules were changed in place."""
        self.direct.clear()

    def _locals(self, module, args) -> dict:
        return call_locals(self.fn, (module, *args))

    def _entry(self, module, args) -> tuple | None:
        return compiled_entry(self.fn, (module, *args))


def call_locals(fn, args: tuple) -> dict:
    """fn's parameters bound to positional args, as dynamo's guards read them."""
    code = fn.__code__
    return dict(zip(code.co_varnames[:code.co_argcount], args))


def compiled_entry(fn, args: tuple) -> tuple | None:
    """The compiled cache entry of torch.compile'd fn whose guards take these arguments, as (its transformed
    code as a plain function, its guard manager); None when no entry does or this torch has no such
    introspection."""
    import types

    try:
        import torch._dynamo.eval_frame as eval_frame
        local = call_locals(fn, args)
        for entry in eval_frame._debug_get_cache_entry_list(fn.__code__):
            if entry.guard_manager.check(local):
                return types.FunctionType(entry.code, fn.__globals__), entry.guard_manager
    except (AttributeError, ImportError, RuntimeError, TypeError):
        pass
    return None


def _run_layer(layer: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return layer(x, positions)


def _run_mtp_layer(layer: torch.nn.Module, embeds: torch.Tensor, prev_hidden: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    return layer(embeds, prev_hidden, positions)


class CompiledDecode:
    """Decode graphs of one model: run(input_ids, positions) inside the step's attention_context."""

    def __init__(self, model: torch.nn.Module, max_tokens: int, sizes: tuple[int, ...] | None = None) -> None:
        _configure_cache()
        import torch._dynamo

        self.model = model
        self.buckets = buckets_for(max_tokens, sizes)
        # Every graph of every engine in this process hangs off one code object (_run_layer), and engines of
        # the same shapes share graphs (guards check types and shapes, not module identity). Room for this
        # engine's graphs on top of what earlier engines left: one per layer kind (dense, MoE, MTP) and bucket.
        room = _LAYER_KINDS * len(self.buckets)
        torch._dynamo.config.recompile_limit += room
        torch._dynamo.config.accumulated_recompile_limit += room
        # Regional compilation: one graph per distinct layer kind (the dense first layers, the MoE layers) and
        # bucket, reused by every layer of that kind (their weights and op keys are graph inputs), instead of
        # the whole unrolled model per bucket: about #layers times less to trace and compile.
        torch._dynamo.config.allow_unspec_int_on_nn_module = True
        self._layer = DirectGraphs(_run_layer)
        # The MTP layer (speculative/mtp_model.py): its passes over decode rows take the same buckets.
        self._mtp = DirectGraphs(_run_mtp_layer)
        self.mtp_layer: torch.nn.Module | None = None
        self.compiled: set[int] = set()  # buckets traced so far
        self.compile_seconds = 0.0
        self.steps = 0  # decode steps run through a graph (warm-up excluded)
        self.mtp_steps = 0  # MTP passes run through a graph (warm-up excluded)

    def layer_inputs_changed(self) -> None:
        """Some layer's modules were changed in place (online EPLB's expert moves: new expert maps, INT8 packs):
        the next call of each (layer, bucket) goes through dynamo's guarded lookup again."""
        self._layer.forget()
        self._mtp.forget()

    def attach_mtp(self, mtp_layer: torch.nn.Module) -> None:
        """Run the MTP proposer's decode passes through graphs too (compiled by warm_up)."""
        self.mtp_layer = mtp_layer

    def bucket(self, num_tokens: int) -> int | None:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        return None

    def applies(self, meta, num_tokens: int) -> bool:
        """A decode-only step (no prefill rows) that fits a bucket."""
        return num_tokens > 0 and not meta.prefills and num_tokens <= self.buckets[-1]

    def warm_up(self, kv_caches: list[torch.Tensor]) -> None:
        """Compile every bucket now, at start-up, instead of stalling the first step of each size: a forward
        of padding rows only (no metadata rows, so nothing is written to the cache). Every rank of a DP/EP
        engine runs the same buckets in the same order, so their MoE collectives pair up."""
        from tqdm import tqdm

        start = time.perf_counter()
        # A progress bar on a terminal (vLLM shows one while it captures graphs); none in logs and pipes.
        bar = tqdm(self.buckets, desc="Compiling decode graphs", unit="bucket", disable=None, leave=False)
        for b in bar:
            bar.set_postfix(tokens=b)
            self.warm_bucket(b, kv_caches)
        logger.info("decode graphs for %s tokens ready in %.1f s", self.buckets, time.perf_counter() - start)

    def warm_bucket(self, b: int, kv_caches: list[torch.Tensor]) -> None:
        """Compile bucket b: a forward of padding rows through the layers' and the MTP layer's graphs (no
        metadata rows, nothing written to the cache; not counted as decode steps)."""
        from moeserve.layers.attention.metadata import AttentionMetadata, attention_context

        meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), [], None, kv_caches)
        steps, mtp_steps = self.steps, self.mtp_steps
        with torch.inference_mode(), attention_context(meta):
            ids = torch.zeros(b, dtype=torch.long)
            hidden = self.run(ids, ids)
            if self.mtp_layer is not None:
                self.run_mtp(torch.zeros_like(hidden), hidden, ids)
        self.steps, self.mtp_steps = steps, mtp_steps

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        b = self.bucket(n)
        if b > n:  # padding rows: token 0 at position 0; attention gives them zeros, the rows are dropped
            input_ids = torch.cat([input_ids, input_ids.new_zeros(b - n)])
            positions = torch.cat([positions, positions.new_zeros(b - n)])
        self.steps += 1
        start = time.perf_counter()
        hidden = self.model(input_ids, positions, run_layer=self._layer)
        if b not in self.compiled:
            self.compiled.add(b)
            took = time.perf_counter() - start
            self.compile_seconds += took
            logger.info("decode graph for %d tokens compiled in %.1f s", b, took)
        return hidden[:n]

    def run_mtp(self, embeds: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One MTP pass over decode rows (inside its attention_context), padded to a bucket like run()."""
        n = embeds.shape[0]
        b = self.bucket(n)
        if b > n:
            embeds = torch.cat([embeds, embeds.new_zeros(b - n, embeds.shape[1])])
            prev_hidden = torch.cat([prev_hidden, prev_hidden.new_zeros(b - n, prev_hidden.shape[1])])
            positions = torch.cat([positions, positions.new_zeros(b - n)])
        self.mtp_steps += 1
        return self._mtp(self.mtp_layer, embeds, prev_hidden, positions)[:n]
