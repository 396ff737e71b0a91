"""FlashComm for attention tensor parallelism (T > 1): the residual stream is sharded by token over the TP
group instead of replicated.

Without it every TP rank holds all T tokens: o_proj's partial sums are all-reduced and every rank repeats
the residual add, the norms and the MoE router input on the same rows. With it (--flashcomm on|int8):

    shard [T/W, H] -> input norm (on the shard) -> AllGather (BF16, or INT8 + per-token scales) -> [T, H]
    -> this rank's heads -> o_proj partial [T, H] -> ReduceScatter -> shard [T/W, H] -> residual, post norm,
    MLP / MoE on the shard (the MoE already took 1/W of the rows per TP rank)

An all-reduce costs a reduce-scatter plus an all-gather, so the BF16 variant moves the same bytes but
computes nothing twice; the INT8 all-gather carries H + 4 bytes per token instead of 2H. The final norm's
output is gathered in full precision for lm_head. Steps with no tokens (idle DP ranks) stay unsharded.

Scoped: DeepseekModel.forward opens sequence_parallel(); layers ask current_seq_parallel(), and code run
outside (the MTP draft layer) sees None and works on whole batches as before.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from moeserve.distributed.comm import GroupCoordinator
from moeserve.int8 import quantize_per_token
from moeserve.scoped import Scoped

FLASHCOMM_MODES = ("off", "on", "int8")
_CURRENT: Scoped["SeqParallel"] = Scoped("seq_parallel")


@dataclass
class SeqParallel:
    tp: GroupCoordinator
    num_tokens: int  # T of this step, the same on every rank of the TP group
    int8_gather: bool

    @property
    def width(self) -> int:
        return -(-self.num_tokens // self.tp.world_size)  # rows per rank, the last rank's padded

    def _bounds(self) -> tuple[int, int]:
        lo = min(self.tp.rank * self.width, self.num_tokens)
        return lo, min(lo + self.width, self.num_tokens)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] -> this rank's rows [n_r, H]."""
        lo, hi = self._bounds()
        return x[lo:hi]

    def _padded(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        if x.shape[0] == rows:
            return x.contiguous()
        out = x.new_zeros((rows,) + tuple(x.shape[1:]))
        out[: x.shape[0]] = x
        return out

    def gather(self, x: torch.Tensor, allow_int8: bool = True) -> torch.Tensor:
        """This rank's rows [n_r, H] -> all rows [T, H] in x.dtype (INT8 on the wire when configured)."""
        if self.int8_gather and allow_int8:
            q, scale = quantize_per_token(self._padded(x, self.width))  # [w, H] int8, [w, 1] float32
            (q_all, wq), (s_all, ws) = (self.tp.all_gather(t, async_op=True, kind="allgather_tp")
                                        for t in (q, scale))  # values and scales in flight together
            for work in (wq, ws):
                if work is not None:
                    work.wait()
            full = (q_all.float() * s_all).to(x.dtype)
        else:
            full = self.tp.all_gather(self._padded(x, self.width), kind="allgather_tp")
        return full[: self.num_tokens]

    def reduce_scatter(self, partial: torch.Tensor) -> torch.Tensor:
        """Partial sums [T, H] on every rank -> the summed rows of this rank [n_r, H]."""
        out = self.tp.reduce_scatter(self._padded(partial, self.width * self.tp.world_size))
        lo, hi = self._bounds()
        return out[: hi - lo]


class _Unsharded:
    """The identity, when FlashComm is off (or T == 1, or the step is empty)."""

    @staticmethod
    def shard(x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def gather(x: torch.Tensor, allow_int8: bool = True) -> torch.Tensor:
        return x


def current_seq_parallel() -> SeqParallel | None:
    return _CURRENT.get()


@contextlib.contextmanager
def sequence_parallel(tp: GroupCoordinator, mode: str, num_tokens: int):
    """Shard the residual stream of a forward pass over `tp` (mode "on" / "int8"); yields shard/gather."""
    if mode == "off" or tp.world_size == 1 or num_tokens == 0:
        yield _Unsharded()
        return
    sp = SeqParallel(tp, num_tokens, mode == "int8")
    with _CURRENT.use(sp):
        yield sp
