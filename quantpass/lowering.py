"""Hand a (rewritten) graph to Inductor, AOTAutograd-eager or plain eager.

Every `torch._inductor` / `torch._dynamo` backend import lives here, so supporting torch 2.11
through 2.14 means keeping one module working.
"""

from __future__ import annotations

import torch.fx as fx

LOWERINGS = ("inductor", "aot_eager", "eager")


def lower(gm: fx.GraphModule, example_inputs, lowering: str = "inductor", cache_uuid: str | None = None):
    """A callable `f(*args)` running `gm`."""
    if lowering == "eager":
        return gm.forward
    if lowering == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    if lowering == "inductor":
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        if cache_uuid is None:
            return compile_fx(gm, example_inputs)
        # Inductor's FX graph cache keys on custom passes' uuid(): ours carries the quantpass
        # pass's source hash and config, so a graph built by another config is never served.
        cache_pass = _cache_key_pass(cache_uuid, inductor_config.post_grad_custom_post_pass)
        with inductor_config.patch(post_grad_custom_post_pass=cache_pass):
            return compile_fx(gm, example_inputs)
    raise ValueError(f"invalid lowering {lowering!r}; valid: {', '.join(LOWERINGS)}")


def _cache_key_pass(uuid: str, inner):
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class QuantpassCacheKey(CustomGraphPass):
        """A no-op post-grad pass whose uuid() makes quantpass's config part of the cache key."""

        def __call__(self, graph):
            if inner is not None:
                inner(graph)

        def uuid(self):
            return (uuid, None if inner is None else inner.uuid())

    return QuantpassCacheKey()
