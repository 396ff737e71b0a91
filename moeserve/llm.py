"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`, as in vLLM."""
from __future__ import annotations

import contextlib
import itertools

from tqdm import tqdm

from moeserve.engine_args import EngineArgs
from moeserve.hf_model import resolve_model
from moeserve.engine.output_processor import OutputProcessor
from moeserve.engine.request import RequestStatus
from moeserve.engine.resolve import resolve_engine_config
from moeserve.models.registry import resolve_model_path
from moeserve.arch import DeepseekArch
from moeserve.outputs import CompletionOutput, Metric, RequestOutput, logprob_dict
from moeserve.protocol import EngineCoreRequest
from moeserve.sampling_params import SamplingParams
from moeserve.structured.params import structured_grammar
from moeserve.generation_defaults import default_sampling, read_generation_config
from moeserve.tokenizer import eos_token_ids, load_tokenizer


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {', '.join(sorted(unknown))}")
        self.args = EngineArgs(model=model, **kwargs)
        # a local folder, else a Hugging Face id from the cache (or downloaded), as vLLM's LLM does
        path = resolve_model_path(resolve_model(model, self.args.revision, self.args.download_dir))
        self.args.model = path
        if self.args.tokenizer is not None:
            self.args.tokenizer = resolve_model(self.args.tokenizer, None, self.args.download_dir, "tokenizer")
        self.arch = DeepseekArch.from_pretrained(path)
        self.config = resolve_engine_config(self.args, self.arch.max_position_embeddings)
        # skip_tokenizer_init: token ids in and out, no text (vLLM's); chat() and text prompts need a tokenizer
        self.tokenizer = None if self.config.model.skip_tokenizer_init else \
            load_tokenizer(self.config.model.tokenizer or path)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.arch.eos_token_ids, read_generation_config(path))
        self.default_sampling = default_sampling(self.args.generation_config, path,
                                                self.args.override_generation_config)
        self.engine = self._make_engine()
        self._ids = itertools.count()
        self._tokens = {"prompt": 0, "generation": 0}  # for get_metrics

    def _make_engine(self):
        """EngineCore in this process, or the front end of D x T rank processes (same interface).
        On other nodes (or torchrun ranks > 0) LLM() serves its ranks until node 0 is done, then exits."""
        from moeserve.engine.launch import make_engine_core
        return make_engine_core(self.config, self.arch)

    def shutdown(self) -> None:
        """Stop the rank processes of a multi-rank engine (also done at exit)."""
        if hasattr(self.engine, "shutdown"):
            self.engine.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    # ---- vLLM's engine controls ---------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (the next requests compute their prompts from scratch)."""
        return self.engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges under vLLM's metric names (a snapshot)."""
        s = self.engine.stats()
        values = {"vllm:num_requests_running": s.num_running, "vllm:num_requests_waiting": s.num_waiting,
                  "vllm:kv_cache_usage_perc": s.kv_cache_usage, "vllm:num_preemptions": s.num_preemptions,
                  "vllm:prefix_cache_queries": s.prefix_cache_queries, "vllm:prefix_cache_hits": s.prefix_cache_hits,
                  "vllm:spec_decode_num_drafts": s.spec_num_drafts,
                  "vllm:spec_decode_num_draft_tokens": s.spec_num_draft_tokens,
                  "vllm:spec_decode_num_accepted_tokens": s.spec_num_accepted_tokens,
                  "vllm:prompt_tokens": self._tokens["prompt"], "vllm:generation_tokens": self._tokens["generation"]}
        return [Metric(name, float(v), {"engine": "0"}) for name, v in values.items()]

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode, level 1: the KV cache's memory is given back (prefix cache forgotten) until
        wake_up(); the weights stay (on CPU they are already in host memory, where level 1 would put them)."""
        if level != 1:
            raise ValueError("sleep(level=2) (discarding the weights) is not supported; use level 1")
        self._runner("sleep").sleep()
        self.engine.reset_prefix_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        if tags not in (None, ["kv_cache"], ["weights"], ["weights", "kv_cache"], ["kv_cache", "weights"]):
            raise ValueError(f"wake_up tags must be weights and/or kv_cache, got {tags!r}")
        self._runner("wake_up").wake_up()

    def is_sleeping(self) -> bool:
        runner = getattr(self.engine, "runner", None)
        return bool(runner is not None and getattr(runner, "sleeping", False))

    def _runner(self, what: str):
        runner = getattr(self.engine, "runner", None)
        if runner is None:
            raise ValueError(f"{what}() works with a single-rank engine (no --data-parallel-size/"
                             "--tensor-parallel-size > 1) for now")
        if self.engine.has_unfinished():
            raise ValueError(f"{what}() needs an idle engine: requests are still running")
        return runner

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the checkpoint's recommended fields (--generation-config); what
        generate() and chat() use when given no sampling_params."""
        return SamplingParams(**self.default_sampling)

    def generate(self, prompts=None, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        if self.is_sleeping():
            raise ValueError("the engine is asleep (LLM.sleep()): call wake_up() before generate()")
        texts, token_lists = self._normalise_prompts(prompts, prompt_token_ids)
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        params = [params] * len(token_lists) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(token_lists):
            raise ValueError(f"got {len(params)} sampling_params for {len(token_lists)} prompts")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError("sampling_params must be a SamplingParams or a list of them")
        processor = OutputProcessor(self.tokenizer)
        results: list[RequestOutput] = []
        children: dict[str, tuple[RequestOutput, int]] = {}
        pending: list[EngineCoreRequest] = []
        for text, ids, p in zip(texts, token_lists, params):
            rid = str(next(self._ids))
            ro = RequestOutput(rid, text, ids, [None] * p.n)
            results.append(ro)
            for i in range(p.n):
                child = p.for_sample(i).with_tokenizer(self.tokenizer)
                child.logprobs_mode = self.config.model.logprobs_mode  # the sampler reads it per request
                cid = f"{rid}-{i}" if p.n > 1 else rid
                children[cid] = (ro, i)
                processor.add(cid, child, len(ids))
                pending.append(EngineCoreRequest(cid, ids, child, self.eos_token_ids,
                                                 structured_grammar=structured_grammar(child)))
        try:
            for req in pending:
                self.engine.add_request(req)
            self._run(processor, children, use_tqdm)
        except BaseException:
            # Ctrl-C or an error: none of this call's requests may linger in the engine for the next call.
            with contextlib.suppress(Exception):
                self.engine.abort_requests(list(children))
            raise
        for ro in results:
            ro.finished = True
        self.engine.flush_stats()  # --expert-load-stats: the counts of this batch are on disk
        return results

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = False, tools: list[dict] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} messages) or a list of them,
        rendered with the checkpoint's chat template (or `chat_template`) exactly as the server's
        /v1/chat/completions does, then generated. RequestOutput.prompt is the rendered text. `tools`
        (OpenAI function definitions) go to the template; parsing calls is the server's job."""
        from moeserve.chat_template import render, resolve_template
        if self.tokenizer is None:
            raise ValueError("LLM(skip_tokenizer_init=True) has no tokenizer to render a chat template with")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not convs:
            raise ValueError("chat() needs at least one conversation (a list of messages)")
        template = resolve_template(self.tokenizer, chat_template)
        texts, ids = [], []
        for c, conv in enumerate(convs):
            text, toks = render(self.tokenizer, [_chat_message(m, c, i) for i, m in enumerate(conv)], template,
                                add_generation_prompt, tools)
            texts.append(text)
            ids.append(toks)
        outs = self.generate(prompt_token_ids=ids, sampling_params=sampling_params, use_tqdm=use_tqdm)
        for out, text in zip(outs, texts):
            out.prompt = text
        return outs

    def _run(self, processor: OutputProcessor, children: dict, use_tqdm: bool) -> None:
        bar = tqdm(total=len(children), desc="Generating", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.error:  # one bad prompt fails the call (generate() aborts the rest)
                    raise ValueError(out.error)
                if out.request_id not in processor.states:
                    continue
                delta, hit_stop = processor.process(out)
                if hit_stop:
                    self.engine.abort_requests([out.request_id], RequestStatus.FINISHED_STOPPED)
                self._tokens["generation"] += len(out.new_token_ids)
                if delta.finished:
                    ro, i = children[out.request_id]
                    self._tokens["prompt"] += len(ro.prompt_token_ids)
                    ro.outputs[i] = self._completion(i, delta)
                    ro.num_cached_tokens = max(ro.num_cached_tokens, delta.num_cached_tokens)
                    if delta.final.prompt_logprobs is not None and ro.prompt_logprobs is None:
                        ro.prompt_logprobs = [None] + [logprob_dict(m.token_id, m.logprob, m.top, self._decode_one)
                                                       for m in delta.final.prompt_logprobs]
                    bar.update(1)
        bar.close()

    def _decode_one(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def _completion(self, index: int, delta) -> CompletionOutput:
        st = delta.final
        logprobs = None
        cumulative = None
        if st.params.logprobs is not None:
            logprobs = [logprob_dict(m.token_id, m.logprob, m.top, self._decode_one) for m in st.logprobs]
            cumulative = sum(m.logprob for m in st.logprobs)
        return CompletionOutput(index, st.text, st.token_ids, cumulative, logprobs, delta.finish_reason,
                                delta.stop_reason)

    def _normalise_prompts(self, prompts, prompt_token_ids):
        if prompt_token_ids is not None:
            if prompts is not None:
                raise ValueError("pass prompts or prompt_token_ids, not both")
            if prompt_token_ids and isinstance(prompt_token_ids[0], int):
                prompt_token_ids = [prompt_token_ids]
            return [None] * len(prompt_token_ids), [list(p) for p in prompt_token_ids]
        if prompts is None:
            raise ValueError("generate() needs prompts or prompt_token_ids")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if self.tokenizer is None and any(not isinstance(p, dict) or "prompt_token_ids" not in p for p in prompts):
            raise ValueError("LLM(skip_tokenizer_init=True) has no tokenizer: pass prompt_token_ids")
        texts, ids = [], []
        for p in prompts:
            if isinstance(p, dict):
                texts.append(p.get("prompt"))
                ids.append(list(p["prompt_token_ids"]) if "prompt_token_ids" in p
                           else self.tokenizer.encode(p["prompt"]))
            elif isinstance(p, str):
                texts.append(p)
                ids.append(self.tokenizer.encode(p))
            else:
                raise TypeError(f"a prompt must be a string or a dict, got {type(p).__name__}")
        return texts, ids


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _chat_message(m, conv: int, i: int) -> dict:
    """A message as the template sees it: role, content text (OpenAI text parts joined), optional name,
    tool_calls and tool_call_id."""
    where = f"conversation {conv}, message {i}"
    if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
        raise ValueError(f"{where}: a message is a dict with 'role' one of {', '.join(CHAT_ROLES)}, got {m!r:.80}")
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ValueError(f"{where}: content parts must be {{'type': 'text', 'text': str}}")
        content = "".join(p["text"] for p in content)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise ValueError(f"{where}: 'content' must be a string or a list of text parts")
    extra = {k: m[k] for k in ("name", "tool_calls", "tool_call_id") if m.get(k)}  # tool turns, as HF templates read them
    return {"role": m["role"], "content": content, **extra}
