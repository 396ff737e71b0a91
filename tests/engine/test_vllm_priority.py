"""--scheduling-policy priority (vLLM's): lower `priority` values are admitted first, ties by arrival."""
from moeserve.config import SchedulerConfig
from moeserve.engine.kv_cache import KVCacheManager
from moeserve.engine.request import Request
from moeserve.engine.scheduler import Scheduler
from moeserve.sampling_params import SamplingParams


def _req(rid: str, priority: int) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=2), priority=priority)


def test_priority_orders_the_waiting_queue():
    sched = Scheduler(SchedulerConfig(policy="priority", max_num_seqs=1), KVCacheManager(64, 16))
    for rid, prio in (("a", 5), ("b", 0), ("c", 5), ("d", -1)):
        sched.add_request(_req(rid, prio))
    assert [r.request_id for r in sched.waiting] == ["d", "b", "a", "c"]
    assert [s.request.request_id for s in sched.schedule().scheduled] == ["d"]


def test_fcfs_keeps_arrival_order():
    sched = Scheduler(SchedulerConfig(), KVCacheManager(64, 16))
    for rid, prio in (("a", 5), ("b", 0)):
        sched.add_request(_req(rid, prio))
    assert [r.request_id for r in sched.waiting] == ["a", "b"]
