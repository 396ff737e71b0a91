"""Ranks as processes over gloo on loopback, for tests that run collectives for real: spawn them, gather what
each rank reports. Also the greedy generation the multi-rank engine tests compare against one process."""
from __future__ import annotations

import datetime

import torch.multiprocessing as mp

from moeserve.distributed.parallel_state import host_rendezvous


def spawn_ranks(rank_main, nprocs: int) -> dict:
    """Run rank_main(rank, port, results) in nprocs processes and return the results dict the ranks filled in.
    port: a tcp://127.0.0.1 rendezvous store this process serves (init_distributed connects to it),
    listening before the ranks start, as the engine's front end serves its ranks'."""
    store = host_rendezvous("127.0.0.1", 0, datetime.timedelta(seconds=120))
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(rank_main, args=(store.port, shared), nprocs=nprocs)
        return dict(shared)


def greedy_tokens(llm, prompts: list[list[int]], params) -> list[list[int]]:
    """Each prompt's output token ids; the engine is shut down after, also when generate raises."""
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    finally:
        if hasattr(llm, "shutdown"):
            llm.shutdown()
