"""The plugin types, as typed protocols (GAIE's plugin interfaces in Python).

A plugin is one object that implements one or more of these; the scheduler
finds what to call by type, never by a method name looked up at run time:

* `Filter` narrows the candidates; `Scorer` returns one value per candidate
  (higher is better; clamped to [0, 1], then weighted by its profile);
  `Picker` chooses from the weighted totals. A profile has filters, scorers
  and one picker.
* `PreRequest.pre_request(req, ep)`: once the plugin's profile has picked
  `ep`, before the answer is sent (the prefix scorer records the hashed prompt).
* `PostResponse.learn(address, hashes)`: after the answer, once the whole
  prompt is hashed (the prefix scorer learns the rest of it).
* `PoolListener.forget(address)`: an endpoint left the pool.

Plugins shipped with kvyard subclass the protocols they implement: their hook
methods are abstract there, so a misspelt hook (`pre_requst`) makes the class
impossible to build — the config fails at load instead of the hook silently
never running. A plugin that implements a protocol without subclassing it is
still found (the protocols are runtime-checkable).
"""
from __future__ import annotations

import random
from abc import abstractmethod
from typing import Protocol, runtime_checkable

from ..pool.endpoints import Endpoint
from .types import SchedRequest


@runtime_checkable
class Filter(Protocol):
    __slots__ = ()
    name: str

    @abstractmethod
    def filter(self, req: SchedRequest, eps: list[Endpoint]) -> list[Endpoint]: ...


@runtime_checkable
class Scorer(Protocol):
    __slots__ = ()
    name: str

    @abstractmethod
    def score(self, req: SchedRequest, eps: list[Endpoint]) -> list[float]: ...


@runtime_checkable
class Picker(Protocol):
    __slots__ = ()
    name: str

    @abstractmethod
    def pick(self, totals: list[float], rng: random.Random) -> list[int]:
        """Indexes into `totals`: the pick first, then fallbacks."""


@runtime_checkable
class PreRequest(Protocol):
    __slots__ = ()

    @abstractmethod
    def pre_request(self, req: SchedRequest, ep: Endpoint) -> None: ...


@runtime_checkable
class PostResponse(Protocol):
    __slots__ = ()

    @abstractmethod
    def learn(self, address: str, hashes: list[int]) -> None: ...


@runtime_checkable
class PoolListener(Protocol):
    __slots__ = ()

    @abstractmethod
    def forget(self, address: str) -> None: ...


HOOKS = (PreRequest, PostResponse, PoolListener)
