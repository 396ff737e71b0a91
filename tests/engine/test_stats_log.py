"""The periodic stats line (vLLM's LoggingStatLogger shape): only while busy, throughput per interval."""
from moeserve.engine.stats_log import StatsLogger
from moeserve.protocol import EngineStats


def test_line_every_interval_while_busy_and_none_idle():
    log = StatsLogger(interval=10.0)
    log._last = 0.0
    assert log.maybe_log(EngineStats(), now=5.0) is None  # interval not over
    log.count(prompt_tokens=1000, generated_tokens=50)
    line = log.maybe_log(EngineStats(num_running=3, num_waiting=1, kv_cache_usage=0.25, prefix_cache_queries=200,
                                     prefix_cache_hits=50), now=10.0)
    assert line == ("Engine 000: Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")
    assert log.maybe_log(EngineStats(), now=25.0) is None  # idle: nothing
