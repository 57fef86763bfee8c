"""MoE sites lowered to one `quantpass::fused_moe` per experts region (an expert-parallel site's with
its `expert_map`), and verify's two sides: the region's own nodes, extracted, against the op."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..kernels import ops
from ..patterns.expert_parallel import ExpertParallelMoESite, expert_map
from ..patterns.fx_match import value
from ..patterns.moe import MoESite
from ..quant_registry.formats import concat_rows
from .fx_utils import erase_dead
from .lower_site import SiteLowering

SAMPLE_TOKENS = 16  # tokens in `sample_inputs` when the graph's token count is dynamic


class MoELowering(SiteLowering):
    def weight_count(self, site: MoESite) -> int:
        return 2  # w13, w2

    def signature(self, site: MoESite) -> tuple:
        return (site.gate_up_layout, len(site.params))

    def prepare(self, site: MoESite, weights, spec, backend):
        names = " + ".join(ref.name for ref in site.params[:-1])
        w13 = weights[0] if len(weights) == 2 else concat_rows(weights[:2], names)  # [E, 2I, H] gate rows first
        return list(ops.prepare_moe_weights(backend, w13, weights[-1], site.gate_up_layout))  # w2 [E, H, I]

    def expert_map(self, site: MoESite, hidden, graph: fx.Graph | None = None):
        """`quantpass::fused_moe`'s expert_map argument: None, every expert is this rank's."""
        return None

    def op_args(self, site: MoESite, hidden, topk_weights, topk_ids, weights, b13, b2, spec, backend, expert_map):
        (w13, w13_scale, w13_scale2, w13_input_scale), (w2, w2_scale, w2_scale2, w2_input_scale) = weights
        static = () if w13_input_scale is None else (w13_input_scale, w2_input_scale)  # static activation keys
        return (
            hidden, topk_weights, topk_ids,
            w13, w13_scale, w13_scale2, w2, w2_scale, w2_scale2, b13, b2, expert_map,
            ops.key_arg(spec.weight), ops.key_arg(spec.activation), backend,
            site.activation, site.gate_up_layout, site.apply_router_weight_on_input,
            site.problem.n, site.alpha, site.limit, *static,
        )  # fmt: skip

    def rewrite(self, site: MoESite, graph, weights, spec, backend, device_type, differentiable=False):
        target = ops.moe_call(backend, device_type, differentiable)
        mapping = self.expert_map(site, site.hidden, graph)
        inputs = (site.hidden, site.topk_weights, site.topk_ids)
        args = self.op_args(site, *inputs, weights, site.b13, site.b2, spec, backend, mapping)
        out_value, hidden_value = value(site.output), value(site.hidden)
        with graph.inserting_before(site.output):
            new = result = graph.call_function(target, args)
            if out_value.dtype != hidden_value.dtype:  # the op returns hidden's dtype
                result = graph.call_method("to", (new, out_value.dtype))
        new.meta.update(site.output.meta)
        new.meta["val"] = new.meta["example_value"] = out_value.to(hidden_value.dtype)
        if result is not new:
            result.meta.update(site.output.meta)
            result.meta["val"] = out_value
        site.output.replace_all_uses_with(result)
        erase_dead(graph, site.region)
        return result

    def sample_inputs(self, site: MoESite, like, device, dtype):
        tokens, hidden_size = site.tokens or SAMPLE_TOKENS, site.problem.k
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(tokens, hidden_size, generator=generator)
        if like is not None and like.is_floating_point() and like.numel() > 1:
            hidden = hidden * like.float().std() + like.float().mean()
        ids = torch.rand(tokens, site.problem.experts, generator=generator).argsort(dim=-1)[:, : site.problem.topk]
        weights = torch.rand(tokens, site.problem.topk, generator=generator).softmax(dim=-1)
        hidden_dtype = value(site.hidden).dtype if site.hidden is not None else dtype  # the region's own dtypes
        return [
            hidden.to(device, hidden_dtype),
            weights.to(device, value(site.topk_weights).dtype),
            ids.to(device, value(site.topk_ids).dtype),
        ]

    def run_original(self, site: MoESite, inputs, values):
        biases = [b for b in site.biases(inputs[0].device) if b is not None]
        with torch.no_grad():
            return site.original(*inputs, *values, *biases)

    def run_quantized(self, site: MoESite, inputs, weights, spec, backend, device_type):
        target = ops.moe_call(backend, device_type)
        b13, b2 = site.biases(inputs[0].device)
        tensors = [ops.op_tensors(w, spec, site.fqn) for w in weights]
        out = target(*self.op_args(site, *inputs, tensors, b13, b2, spec, backend, self.expert_map(site, inputs[0])))
        return out.to(value(site.output).dtype)


class ExpertParallelMoELowering(MoELowering):
    """This rank's experts, called with the global ids and an `expert_map` (global id -> local index)."""

    def expert_map(self, site: ExpertParallelMoESite, hidden, graph: fx.Graph | None = None):
        """In the graph, a node computing the map (before the region's output); eagerly, the map itself."""
        if graph is None:
            return site.expert_map(hidden.device)
        args = (site.global_experts, site.first_expert, site.problem.experts, value(site.hidden).device)
        with graph.inserting_before(site.output):
            node = graph.call_function(expert_map, args)
        node.meta["val"] = node.meta["example_value"] = torch.empty(
            site.global_experts, dtype=torch.int32, device="meta"
        )
        return node

    def sample_inputs(self, site: ExpertParallelMoESite, like, device, dtype):
        hidden, weights, ids = super().sample_inputs(site, like, device, dtype)
        generator = torch.Generator().manual_seed(1)
        scores = torch.rand(ids.shape[0], site.global_experts, generator=generator)
        return [hidden, weights, scores.argsort(dim=-1)[:, : ids.shape[1]].to(ids.device, ids.dtype)]

    def run_original(self, site: ExpertParallelMoESite, inputs, values):
        """The proven region reads the normalized prologue's local ids and masked weights."""
        hidden, weights, ids = inputs
        local = site.expert_map(ids.device)[ids.long()]
        elsewhere = local < 0
        local_ids = torch.where(elsewhere, site.problem.experts - 1, local).to(ids.dtype)
        return super().run_original(site, [hidden, weights.masked_fill(elsewhere, 0), local_ids], values)
