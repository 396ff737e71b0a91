"""Multi-rank BF16 engines whose routed experts run through zentorch's fused MoE (layers/moe/zen.py): the
all-to-all dispatch's k=1-per-row rows (FusedExperts.fused_rows, rows of other ranks -1) give the single-rank
engine's results, and online EPLB's in-place expert moves never leave zentorch computing with the weights a
slot held before (its reordered-weight cache is keyed by address; the flush after each move is what keeps it
right; A8W8 experts, zentorch's INT8 mode, too). The other multi-rank tests run float32, which never reaches
zentorch.

How they compare. On this tiny random model BF16 greedy tokens are not a stable oracle: many top-2 margins
are below 0.05 nats, and summing a token's experts as k=1 rows from two ranks (combine) rounds differently
from one top-k call per token, so a later token can flip (seen: one prompt of four diverges after 8 tokens).
What is compared instead is teacher-forced: the log-probability the model gives every prompt token (prompt
logprobs) and its first greedy token's, which do not depend on earlier choices. They agree to within
LOGPROB_TOL (BF16 rounding of different kernels and summation orders: seen <= 0.02 nats), while experts
computed with the weights their slots held before an EPLB move move them by ~1.5 nats (A8W8: ~1.7);
test_stale_zen_cache_is_caught checks that this comparison does catch a missing flush. First greedy tokens
are compared too, where the single-rank top-2 margin is wide enough for rounding not to flip them.

zentorch really runs in the rank processes: a sitecustomize on the ranks' PYTHONPATH (they inherit the test's
environment) wraps zen.fused_moe / fused_moe_int8 and leaves a mark file per process and k it was called with.

These run where zentorch's fused MoE is available (an AMD CPU with zentorch installed); elsewhere skipped.
"""
import os
import textwrap

import pytest

from moeserve import LLM, SamplingParams
from moeserve.layers.moe import zen

pytestmark = pytest.mark.skipif(not zen.available(), reason="zentorch's fused MoE is not available here")

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12, 44, 9], list(range(20, 61)), [7, 8, 9, 10, 11]]
# Other prompts, for the decode that makes EPLB move experts (none of it in the prefix cache of PROMPTS)
WARMUP = [[400, 401, 402, 403, 404], [90, 91], list(range(100, 130)), [250, 251, 252]]
LOGPROB_TOL = 0.15  # nats; BF16 rounding differences seen here: <= 0.01; stale weights: ~1.5
MARGIN = 0.3  # first greedy tokens compared where the single-rank top-2 margin is at least this
SCORE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=1, logprobs=2)

_HOOK = textwrap.dedent('''
    import os
    from moeserve.layers.moe import zen as _zen

    _mark, _fused = os.environ["MOESERVE_TEST_ZEN_MARK"], _zen.fused_moe
    _seen = set()

    def fused_moe(x, w13, w2, expert_ids, weights):
        k = int(expert_ids.shape[1])
        if x.shape[0] and k not in _seen:
            _seen.add(k)
            open(os.path.join(_mark, f"{os.getpid()}-k{k}"), "w").close()
        return _fused(x, w13, w2, expert_ids, weights)

    _fused_int8 = _zen.fused_moe_int8

    def fused_moe_int8(x, w13, w2, w13_scale, w2_scale, expert_ids, weights):
        if x.shape[0]:
            open(os.path.join(_mark, f"{os.getpid()}-k{int(expert_ids.shape[1])}-int8"), "w").close()
        return _fused_int8(x, w13, w2, w13_scale, w2_scale, expert_ids, weights)

    _zen.fused_moe, _zen.fused_moe_int8 = fused_moe, fused_moe_int8
    if os.environ.get("MOESERVE_TEST_ZEN_NOFLUSH") == "1":  # the bug the EPLB tests must catch
        _zen.flush_cache = lambda: None
''')


@pytest.fixture
def marks(tmp_path, monkeypatch):
    """Folder the rank processes leave their zentorch marks in (sitecustomize on their PYTHONPATH)."""
    hook, mark = tmp_path / "hook", tmp_path / "marks"
    hook.mkdir()
    mark.mkdir()
    (hook / "sitecustomize.py").write_text(_HOOK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook)] + [p for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p]))
    monkeypatch.setenv("MOESERVE_TEST_ZEN_MARK", str(mark))
    return mark


@pytest.fixture(scope="module")
def path(ckpt_dir):
    return ckpt_dir("v3")


def score(llm, prompts=PROMPTS):
    """Per prompt: (the log-probabilities of prompt tokens 2.., first greedy token, its logprob, its top-2
    margin)."""
    out = []
    for o in llm.generate(prompt_token_ids=prompts, sampling_params=SCORE):
        plp = [float(d[t]) for t, d in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]
        c = o.outputs[0]
        tok, first = c.token_ids[0], c.logprobs[0]
        second = max(float(v) for t, v in first.items() if t != tok)
        out.append((plp, tok, float(first[tok]), float(first[tok]) - second))
    return out


def worst_gap(got, want) -> float:
    gaps = [abs(a - b) for (gp, _, gf, _), (wp, _, wf, _) in zip(got, want) for a, b in zip(gp + [gf], wp + [wf])]
    assert len(gaps) == sum(len(p) for p in PROMPTS)
    return max(gaps)


def assert_same(got, want) -> None:
    gap = worst_gap(got, want)
    assert gap <= LOGPROB_TOL, f"prompt logprobs differ by up to {gap:.3f} nats"
    wide = [i for i, w in enumerate(want) if w[3] >= MARGIN]
    assert wide, "no first token with a wide margin to compare"
    assert [got[i][1] for i in wide] == [want[i][1] for i in wide]


def ranks_marked(mark, k=1, int8=False) -> set[str]:
    """The rank processes that called zentorch's fused MoE (its INT8 mode: int8) with k experts per row."""
    return {f.split("-")[0] for f in os.listdir(mark) if f.endswith(f"-k{k}" + ("-int8" if int8 else ""))}


@pytest.fixture(scope="module")
def single(path):
    return score(LLM(path, dtype="bfloat16"))


@pytest.fixture(scope="module", params=[None, "a8w8"], ids=["bf16", "a8w8"])
def quant(request):
    """BF16 experts (zentorch's fused MoE), or A8W8 ones (its INT8 mode, layers/quant.py Int8FusedExperts)."""
    return request.param


def test_dp2_ep_bf16_zentorch_matches_single_rank(path, single, marks):
    """DP=2 with expert parallelism (all-to-all dispatch), BF16: both ranks run their experts through
    zentorch, k=1 per row, and score the prompts as the single-rank engine does."""
    llm = LLM(path, dtype="bfloat16", data_parallel_size=2, enable_expert_parallel=True, distributed_timeout=30)
    try:
        got = score(llm)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    assert stats.comm_bytes["alltoall"] > 0
    assert len(ranks_marked(marks)) == 2, sorted(os.listdir(marks))
    assert_same(got, single)


def _eplb_scores(path, quant, eplb: bool):
    base = dict(dtype="bfloat16", data_parallel_size=2, enable_expert_parallel=True, num_redundant_experts=2,
                distributed_timeout=30, quantization=quant)
    llm = LLM(path, enable_eplb=True, eplb_step_interval=2, **base) if eplb else LLM(path, **base)
    try:
        if eplb:  # decode on other prompts first, so that experts move before PROMPTS are scored
            llm.generate(prompt_token_ids=WARMUP,
                         sampling_params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
            moved = llm.engine.stats()
            assert moved.eplb_rebalances >= 4 and moved.eplb_experts_moved > 0
        return score(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def fixed(path, quant):
    """The same DP=2 BF16 layout, never rebalancing."""
    return _eplb_scores(path, quant, eplb=False)


def test_online_eplb_zentorch_scores_like_no_eplb(path, quant, fixed, single, marks):
    """--enable-eplb, BF16 model on zentorch (BF16 experts, or A8W8 ones in its INT8 mode): after experts
    have moved (copied in place into slots that held other experts, INT8 scales too), the prompts score as in
    the engine that never moves them (and, BF16, as in the single-rank one)."""
    got = _eplb_scores(path, quant, eplb=True)
    assert len(ranks_marked(marks, int8=quant == "a8w8")) == 2, sorted(os.listdir(marks))
    if quant is None:
        assert_same(fixed, single)
    assert_same(got, fixed)


def test_stale_zen_cache_is_caught(path, quant, fixed, marks, monkeypatch):
    """The comparison above can fail: with zen.flush_cache a no-op in the ranks (zentorch
    keeps the weights it reordered before each move), the scores after EPLB moves are far off the fixed
    engine's."""
    monkeypatch.setenv("MOESERVE_TEST_ZEN_NOFLUSH", "1")
    got = _eplb_scores(path, quant, eplb=True)
    assert len(ranks_marked(marks, int8=quant == "a8w8")) == 2
    assert worst_gap(got, fixed) > 2 * LOGPROB_TOL
