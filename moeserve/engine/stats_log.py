"""The periodic stats line a vLLM operator expects in the log while the engine is busy (off with
--disable-log-stats):

  Engine 000: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s, Running: 8 reqs,
  Waiting: 2 reqs, KV cache usage: 41.3%, Prefix cache hit rate: 22.0%

Throughputs are over the interval since the last line; the hit rate is cumulative (queries and hits since
start), as vLLM's. Nothing is logged while idle, so a quiet server keeps a quiet log.
"""
from __future__ import annotations

import logging
import time

LOG_INTERVAL_S = 10.0


class StatsLogger:
    def __init__(self, engine_index: int = 0, interval: float = LOG_INTERVAL_S,
                 logger: logging.Logger | None = None) -> None:
        self.engine_index, self.interval = engine_index, interval
        self.logger = logger or logging.getLogger("moeserve.stats")
        self._last = time.monotonic()
        self._prompt = self._generated = 0

    def count(self, prompt_tokens: int, generated_tokens: int) -> None:
        self._prompt += prompt_tokens
        self._generated += generated_tokens

    def maybe_log(self, stats, now: float | None = None) -> str | None:
        """Log (and return) the line when the interval has passed and there was work; else None."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._last
        if elapsed < self.interval:
            return None
        busy = self._prompt or self._generated or stats.num_running or stats.num_waiting
        line = None
        if busy:
            hit = 100.0 * stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
            line = (f"Engine {self.engine_index:03d}: Avg prompt throughput: {self._prompt / elapsed:.1f} tokens/s, "
                    f"Avg generation throughput: {self._generated / elapsed:.1f} tokens/s, "
                    f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                    f"KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%, Prefix cache hit rate: {hit:.1f}%")
            self.logger.info(line)
        self._last, self._prompt, self._generated = now, 0, 0
        return line
