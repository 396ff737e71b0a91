"""Scoped per-forward state (design principle 9): a value visible for the extent of a `with` block.

One mechanism for every piece of state the model runner hands to layers without threading it through
the model's signatures (attention metadata, the MoE placement plan, FlashComm's sequence sharding).
A ContextVar rather than a module global, so threads (the DP front end, the server) cannot see each
other's values and nesting restores the outer value.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Generic, Iterator, TypeVar

import torch

T = TypeVar("T")


class Scoped(Generic[T]):
    def __init__(self, name: str) -> None:
        self._var: contextvars.ContextVar[T | None] = contextvars.ContextVar(name, default=None)

    @contextlib.contextmanager
    def use(self, value: T) -> Iterator[T]:
        token = self._var.set(value)
        try:
            yield value
        finally:
            self._var.reset(token)

    def get(self) -> T | None:
        # While torch.compile traces (engine/compiled_decode.py) nothing is scoped: a ContextVar cannot be
        # read into a graph. The compiled decode graph is only used where none of these values is set during
        # the model's forward (no FlashComm, no expert-load recording); the attention metadata is read by the
        # attention op at run time, outside the graph.
        if torch.compiler.is_compiling():
            return None
        return self._var.get()
