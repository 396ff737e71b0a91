"""A deployment instance (prefill or decode) as the planner sees it, validated on construction.

Cards: every card runs attention (DP groups of `tp` cards each). Of the cards, `shared_expert_ranks` hold
only the shared experts (CloudMatrix: 16 of 144); the others hold the routed experts (`ep` ranks), each with
(n_routed + redundant_experts) / ep expert slots.
"""
from __future__ import annotations

from dataclasses import dataclass

QUANT = {  # weight bytes, GEMM compute dtype, MoE dispatch bytes per element
    "a8w8": (1.0, "int8", 1.0),
    "fp8": (1.0, "fp8", 1.0),
    "bf16": (2.0, "bf16", 2.0),
    # FP4 (E2M1) weights and activations with block scales, run at the device's FP4 tensor rate. NVFP4: one
    # FP8 E4M3 scale per 16 elements (NVIDIA, "Introducing NVFP4", developer.nvidia.com/blog/introducing-
    # nvfp4-for-efficient-and-accurate-low-precision-inference); MXFP4: one E8M0 byte per 32 (OCP
    # Microscaling Formats v1.0). The per-tensor FP32 scale is negligible. Dispatch stays FP8 with 1x128
    # scales (DeepEP's FP8 dispatch, what the collective tables measured).
    "nvfp4": (0.5 + 1 / 16, "fp4", 1.0),
    "mxfp4": (0.5 + 1 / 32, "fp4", 1.0),
}
KV_BYTES = {"bf16": 2.0, "fp8": 1.0, "int8": 1.0}
MOE_COMM = ("alltoall", "allgather")
FLASHCOMM = ("off", "on", "int8")
ATTENTION_DTYPES = ("bf16", "fp8")
# Cards in an instance or a deployment (--cards, --prefill-cards; docs/planner.md). search's prefill:decode
# split counts instances up to --cards (~1 s at this limit); --cards 1e30 ran forever.
MAX_CARDS = 100_000
# Instances of one role a PD simulation runs (--prefill-instances, --decode-instances): each prefill
# instance is advanced at every arrival.
MAX_INSTANCES = 1024


class PlanError(ValueError):
    """A deployment that cannot run; the message says what to change."""


class DoesNotFit(PlanError):
    """A valid layout whose weights, activations and KV do not fit in memory (the CLI exits 1, not 2)."""


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise PlanError(msg)


def fewest_redundant_slots(n_routed: int, routed_ranks: int) -> int:
    """The default --redundant-experts: the fewest extra slots that make the routed experts divide evenly over
    the ranks that hold them (0 for a dense model)."""
    return -n_routed % routed_ranks if n_routed else 0


@dataclass(frozen=True)
class Instance:
    cards: int
    tp: int = 1                      # attention tensor parallel (inside one scale-up domain)
    shared_expert_ranks: int = 0     # dedicated cards holding only shared experts
    redundant_experts: int = 0       # extra routed-expert slots (hot-expert copies), instance-wide
    quantization: str = "a8w8"
    kv_dtype: str = "bf16"
    mtp_drafts: int = 0              # draft tokens per step from the MTP layer
    mtp_acceptance: float = 0.7      # per-draft acceptance probability
    moe_comm: str = "alltoall"
    micro_batch_overlap: bool = False  # two-batch overlap of compute and communication
    imbalance: float | None = None   # residual expert-load skew (max/mean rank load) beyond sampling noise;
                                     # None: the model's published residual under EPLB (ModelSpec
                                     # residual_imbalance; docs/planner.md "Expert load")
    overlap_shared: bool = True      # shared experts (and, with allgather, the gate) run while the first
                                     # MoE collective is in flight (moeserve's engine; system-brief item 8)
    flashcomm: str = "off"           # TP AllReduce -> ReduceScatter + AllGather (BF16 'on' or 'int8')
    weight_prefetch: bool = False    # next layer's attention weights stream in while the network is busy
    max_num_seqs: int | None = None  # sequences a DP rank may run at once (the engine's --max-num-seqs)
    dense_tp: int | None = None      # TP of the dense-layer MLP when it differs from attention TP
    attention_dtype: str = "bf16"    # decode MLA math: 'fp8' = FP8 Q / KV on the FP8 tensor path (FlashMLA-FP8)

    def __post_init__(self):
        _require(self.cards >= 1, f"--cards must be >= 1, got {self.cards}")
        _require(self.tp >= 1, f"--tp (attention TP) must be >= 1, got {self.tp}")
        _require(self.cards % self.tp == 0,
                 f"--cards {self.cards} not divisible by attention TP {self.tp}; make --cards a multiple of --tp")
        _require(0 <= self.shared_expert_ranks < self.cards,
                 f"--shared-expert-ranks {self.shared_expert_ranks} must be >= 0 and leave routed-expert "
                 f"ranks out of {self.cards} cards")
        _require(self.quantization in QUANT, f"quantization must be one of {sorted(QUANT)}")
        _require(self.kv_dtype in KV_BYTES, f"kv dtype must be one of {sorted(KV_BYTES)}")
        _require(self.moe_comm in MOE_COMM, f"moe-comm must be one of {MOE_COMM}")
        _require(self.flashcomm in FLASHCOMM, f"flashcomm must be one of {FLASHCOMM}")
        _require(self.mtp_drafts >= 0, f"--mtp-drafts must be >= 0, got {self.mtp_drafts}")
        _require(0.0 <= self.mtp_acceptance <= 1.0,
                 f"--mtp-acceptance is a probability in [0, 1], got {self.mtp_acceptance}")
        _require(self.imbalance is None or self.imbalance >= 1.0,
                 f"--imbalance is max/mean expert load, >= 1; got {self.imbalance}")
        _require(self.max_num_seqs is None or self.max_num_seqs >= 1,
                 f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.dense_tp is None or (self.dense_tp >= 1 and self.cards % self.dense_tp == 0),
                 f"dense_tp {self.dense_tp} must be >= 1 and divide --cards {self.cards}")
        _require(self.redundant_experts >= 0, f"--redundant-experts must be >= 0, got {self.redundant_experts}")
        _require(self.attention_dtype in ATTENTION_DTYPES,
                 f"--attention-dtype must be one of {ATTENTION_DTYPES}, got {self.attention_dtype!r}")
        _require(self.attention_dtype != "fp8" or self.kv_dtype == "fp8",
                 "--attention-dtype fp8 (FlashMLA-FP8) reads FP8 Q and KV; add --kv-cache-dtype fp8")

    @property
    def dp(self) -> int:
        return self.cards // self.tp

    @property
    def seq_parallel(self) -> bool:
        """FlashComm with attention TP: the residual stream is sharded by token over the TP group, so
        token-wise work outside attention's head-parallel core runs on each rank's 1/tp of the tokens."""
        return self.flashcomm != "off" and self.tp > 1

    @property
    def mlp_tp(self) -> int:
        """TP of the dense layers' MLP (the attention TP unless dense_tp says otherwise)."""
        return self.tp if self.dense_tp is None else self.dense_tp

    @property
    def ep(self) -> int:
        """Ranks holding routed experts."""
        return self.cards - self.shared_expert_ranks

    @property
    def weight_bytes(self) -> float:
        return QUANT[self.quantization][0]

    @property
    def compute_dtype(self) -> str:
        return QUANT[self.quantization][1]

    @property
    def act_in_bytes(self) -> float:
        """Bytes per element of a GEMM's quantised input activations: the weights' format under FP4 (block
        scales included), one byte under INT8 / FP8 (their per-token / per-block scales are counted apart),
        BF16 otherwise."""
        dtype = self.compute_dtype
        return 2.0 if dtype == "bf16" else self.weight_bytes if dtype == "fp4" else 1.0

    @property
    def dispatch_bytes(self) -> float:
        return QUANT[self.quantization][2]

    @property
    def kv_bytes(self) -> float:
        return KV_BYTES[self.kv_dtype]

    @property
    def tokens_per_step(self) -> float:
        """Expected tokens emitted per sequence per step: 1 + a + a^2 + ... (chain of drafts)."""
        return sum(self.mtp_acceptance ** i for i in range(self.mtp_drafts + 1))

    def expert_slots(self, n_routed: int) -> int:
        """Routed-expert slots per routed rank."""
        total = n_routed + self.redundant_experts
        _require(total % self.ep == 0,
                 f"expert slots {total} ({n_routed} routed + {self.redundant_experts} redundant) not "
                 f"divisible by {self.ep} routed-expert ranks; change --redundant-experts or EP size")
        return total // self.ep


@dataclass(frozen=True)
class Workload:
    input_len: int = 2048
    output_len: int = 2048
    # Share of each prompt whose KV the prefill finds in the prefix cache (a shared system prompt, earlier
    # turns of a conversation): those tokens are attended to but not computed.
    prefix_hit: float = 0.0

    @property
    def cached_prompt_tokens(self) -> int:
        """Prompt tokens a prefill takes from the prefix cache; the last one is always computed (its logits
        give the first token), as in the engine. The engine caches whole blocks; this ignores the rounding."""
        return min(int(self.prefix_hit * self.input_len), self.input_len - 1)

    @property
    def mean_decode_context(self) -> float:
        """Average KV length seen by a decode step at steady state (outputs uniformly in progress)."""
        return self.input_len + self.output_len / 2
