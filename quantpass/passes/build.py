"""Quantize a graph's sites one at a time, in the order the graph runs them.

With verify on, Dynamo's (unrewritten) graph runs once on the example inputs beside the build:
when it reaches a site, that site's weights are quantized and, the first time a kind of site is
seen, checked on the activations that really reach it (not a sample: a mask buffer full of
`finfo.min` is no activation). Each original parameter is released (its storage freed) right after
the last site that reads it is done, so the first compile never holds more than the unquantized
model plus one layer's quantized weights. Inputs the graph writes into (KV caches, counters) run on
copies and the RNG state is restored: the example call itself is not disturbed.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ..patterns.site import param_refs
from ..weight_cache import WEIGHTS, return_freed_memory
from .fx_utils import mutated_placeholders
from .verify import rows, verify_site, verify_token

logger = logging.getLogger("quantpass")

PROGRESS_MIN_SITES = 200  # show a progress bar when quantizing at least this many sites


def build_and_verify(gm: fx.GraphModule, example_inputs, chosen, verify: bool, verified: set | None = None) -> None:
    """`verified`: tokens (kinds of site) already checked, e.g. by the backend's earlier graphs."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    chosen = sorted(chosen, key=lambda q: order[q.probe[1]])
    builder = _Builder(example_inputs, chosen, verify, set() if verified is None else verified)
    pending = verify and any(verify_token(q, example_inputs) not in builder.verified for q in chosen)
    # A recompile (new shapes) meets parameters an earlier graph released: the original graph can't run.
    released = any(
        WEIGHTS.is_released(example_inputs[ref.index]) for ref in param_refs(gm.graph, example_inputs).values()
    )
    if pending and not released:
        try:
            _ProbeRunner(gm, chosen, builder).run_on(example_inputs)
        except Exception as error:
            if isinstance(error, _SiteFailed):
                raise error.__cause__ from None
            logger.info(
                "quantpass: verify could not run the graph (%s: %s); using sample inputs", type(error).__name__, error
            )
    builder.finish()


class _SiteFailed(Exception):
    """Carries an error raised by our own work (quantizing, verifying) through the graph run."""


class _Builder:
    def __init__(self, example_inputs, chosen, verify: bool, verified: set):
        self.example_inputs, self.chosen, self.verify, self.verified = example_inputs, chosen, verify, verified
        self.last = {i: q for q in chosen for i in q.binding.param_indices}  # param index -> last site reading it
        self.done: set[int] = set()
        self.progress = _progress(len(chosen))

    def site(self, q, inputs=None, original=None) -> None:
        if id(q) in self.done:
            return
        self.done.add(id(q))
        params = [self.example_inputs[i] for i in q.binding.param_indices]
        if any(release and not WEIGHTS.canonical_values(p) for p, release in zip(params, q.binding.release)):
            WEIGHTS.drop(params, q.binding.token)  # built by a graph that kept the originals: build to free them
        q.binding.qtensors(self.example_inputs)  # quantize (cached: shared bindings build once)
        token = verify_token(q, self.example_inputs)
        if self.verify and token not in self.verified:
            if inputs is not None and (not inputs or inputs[0].numel() == 0):  # none to probe / no rows: samples
                inputs = original = None
            verify_site(q, self.example_inputs, inputs, original)
            self.verified.add(token)
        released = [
            WEIGHTS.release(self.example_inputs[index])
            for index, release in zip(q.binding.param_indices, q.binding.release)
            if release and self.last[index] is q
        ]
        if any(released):
            return_freed_memory()  # layer by layer: the compile's peak stays near the model plus one layer
        self.progress.update()

    def finish(self) -> None:
        for q in self.chosen:  # not reached by the graph run (or verify off)
            self.site(q)
        return_freed_memory()  # the build's temporaries, also when nothing was released (keep_original_weights)
        self.progress.close()


class _ProbeRunner(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, chosen, builder: _Builder):
        super().__init__(gm, garbage_collect_values=True)
        self.builder = builder
        self.at: dict[fx.Node, list] = {}
        for q in chosen:
            self.at.setdefault(q.probe[1], []).append(q)
        self.wanted = {n for q in chosen for n in q.probe[0]}
        self.kept: dict[fx.Node, object] = {}

    def run_on(self, example_inputs) -> None:
        mutated = mutated_placeholders(self.graph)
        written = {i for i, n in enumerate(self.graph.find_nodes(op="placeholder")) if n in mutated}
        args = [
            _concrete(v.clone() if i in written and isinstance(v, torch.Tensor) else v)
            for i, v in enumerate(example_inputs)
        ]
        devices = [v.device.index or 0 for v in args if isinstance(v, torch.Tensor) and v.device.type == "cuda"]
        with torch.random.fork_rng(devices=sorted(set(devices))), torch.no_grad():
            self.run(*args)

    def run_node(self, n: fx.Node):
        result = super().run_node(n)
        if n in self.wanted:
            self.kept[n] = rows(result)
        for q in self.at.get(n, ()):
            try:
                self.builder.site(q, [self.kept[i] for i in q.probe[0]], rows(result))
            except Exception as error:
                raise _SiteFailed() from error
        return result


def _concrete(value):
    """A dynamic size's example value (Dynamo passes the SymInt): computing with the symbol would
    add guards that specialise it."""
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return value.node.hint
    return value


class _NoProgress:
    def update(self):
        pass

    def close(self):
        pass


def _progress(total: int):
    if total < PROGRESS_MIN_SITES:
        return _NoProgress()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="quantpass: quantizing weights", unit="site")
