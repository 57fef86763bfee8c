"""Quantized weights keyed by the parameter objects actually passed, never baked into a graph.

Dynamo reuses one compiled graph for every instance of a module class, so the runtime wrapper
asks this cache for each call's weights: the key is the identity of the parameter objects (held
weakly: an entry dies with its parameter) plus what to build; the entry is valid while each
parameter's `_version` and `data_ptr()` are unchanged. An in-place update (`param.copy_(new)`,
RL weight sync) bumps `_version`, `module.to(...)` swaps the data pointer: either re-quantizes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence

import torch


def _state(params: Sequence[torch.Tensor]) -> tuple:
    return tuple((p._version, p.data_ptr()) for p in params)


class WeightCache:
    def __init__(self):
        self._entries: dict[tuple, tuple[tuple, object]] = {}
        self._tokens: dict[Hashable, int] = {}
        self._finalizers: dict[int, weakref.finalize] = {}
        self.builds = 0  # how many times something was quantized (tests read it)

    def intern(self, token: Hashable) -> int:
        """A small int standing for `token`: hashing a tuple of QuantKeys on every call of a
        200-site model cost ~0.3 ms per forward (1.5 us per site, measured); an int costs ~0.3 us."""
        return self._tokens.setdefault(token, len(self._tokens))

    def get(self, params: Sequence[torch.Tensor], token: Hashable, build: Callable[[list[torch.Tensor]], object]):
        """The value `build(params)` made for these parameter objects and `token` (best an `intern`ed
        int: it is hashed on every call), rebuilt if stale."""
        key = (*map(id, params), token)
        state = _state(params)
        entry = self._entries.get(key)
        if entry is not None and entry[0] == state:
            return entry[1]
        with torch.no_grad():
            value = build([p.detach() for p in params])
        self.builds += 1
        self._entries[key] = (state, value)
        for p in params:
            if id(p) not in self._finalizers:
                self._finalizers[id(p)] = weakref.finalize(p, self._forget, id(p))
        return value

    def _forget(self, param_id: int) -> None:
        self._finalizers.pop(param_id, None)
        for key in [k for k in self._entries if param_id in k[:-1]]:
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        """Bytes of the distinct tensors the cache holds (what quantpass adds to a process)."""
        seen, total = set(), 0
        for _, value in self._entries.values():
            for t in value[1] if isinstance(value, tuple) else ():
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        return total

    def clear(self) -> None:
        self._entries.clear()


WEIGHTS = WeightCache()
