"""Linear sites in a Dynamo graph: `F.linear`/`nn.Linear`, `x @ W.T` / `torch.matmul`, `addmm`.

Patterns are plain checks on FX nodes. A site's weight must be a placeholder bound to an
`nn.Parameter` (Dynamo lifts every parameter to a placeholder and passes the real Parameter as
the example input); anything else is reported in the plan as left alone, with the reason.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..problem import Problem
from ..quant_registry.names import Kind
from .fx_match import LINEAR_TARGETS, ROUTER_HOPS, argument, is_cast, op_name, reaches, value
from .site import ParamRef, Site, param_refs, source_fqn

MATMUL_TARGETS = {operator.matmul, torch.matmul}
ADDMM_TARGETS = {torch.addmm}


@dataclass
class LinearSite(Site):
    """A linear-like node: `node` computes `x @ W.T (+ bias)`, or `W @ x` where `left` (Mamba's
    `dt_proj.weight @ time_step.transpose(1, 2)`: the linear of `x`'s last two dims swapped, swapped
    back); the rewrite replaces its value."""

    kind = Kind.LINEAR
    node: fx.Node | None = None  # the node whose value the quantized op replaces
    x: fx.Node | None = None
    bias: fx.Node | None = None
    left: bool = False  # `W @ x`: features on x's second-to-last dim
    flat: int = 1  # x's last dims the weight contracts (an einsum's: flattened into K first)
    unflat: tuple[int, ...] = ()  # the output's last dim unflattened to these (an einsum's weight dims)

    @property
    def output_node(self) -> fx.Node:
        return self.node

    @property
    def weight(self) -> ParamRef:
        return self.params[0]

    @property
    def input_nodes(self) -> list[fx.Node]:
        """The activations verify probes, as rows of their last dim: none for `W @ x` (its features
        are on x's dim -2) or an einsum with several contracted or output dims, which verify checks on
        sample rows."""
        if self.left or self.flat > 1 or len(self.unflat) > 1:
            return []
        return [self.x] if self.bias is None else [self.x, self.bias]


def _strip_transpose(node) -> tuple[fx.Node, bool]:
    """(source, True) if `node` is a 2-D transpose of `source` (`w.T`, `w.t()`, `w.transpose(0, 1)`...)."""
    if not isinstance(node, fx.Node):
        return node, False
    if node.op == "call_function" and node.target is getattr and node.args[1] in ("T", "mT"):
        return node.args[0], True
    if node.op == "call_function" and node.target is torch.t:
        return node.args[0], True
    if node.op == "call_method" and node.target == "t":
        return node.args[0], True
    swaps_dims = {d % 2 for d in node.args[1:3] if isinstance(d, int)} == {0, 1}
    if node.op in ("call_method", "call_function") and node.target in ("transpose", torch.transpose) and swaps_dims:
        return node.args[0], True
    if node.op in ("call_method", "call_function") and node.target in ("permute", torch.permute):
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        if tuple(dims) in ((1, 0), (-1, -2)):
            return node.args[0], True
    return node, False


def _match(node: fx.Node, params=frozenset()):
    """(x, weight operand, weight is stored [K, N], bias, weight on the left) for a linear-like node,
    else None. `W @ x` is one where W (after a transpose) is a parameter (in `params`) and x is not."""
    if node.op != "call_function":
        return None
    if node.target in LINEAR_TARGETS:
        return argument(node, 0, "input"), argument(node, 1, "weight"), False, argument(node, 2, "bias"), False
    if node.target in MATMUL_TARGETS:
        left, transposed_left = _strip_transpose(node.args[0])
        if left in params and _strip_transpose(node.args[1])[0] not in params:
            return node.args[1], left, transposed_left, None, True
        weight, transposed = _strip_transpose(node.args[1])
        return node.args[0], weight, not transposed, None, False
    if node.target in ADDMM_TARGETS and not {"beta", "alpha"} & set(node.kwargs):
        weight, transposed = _strip_transpose(node.args[2])
        return node.args[1], weight, not transposed, node.args[0], False
    return None


def _not_a_parameter(weight: fx.Node, params) -> str:
    """Why a matmul's weight operand is no site's: a buffer, an input of the compiled function, or
    computed in the graph (weight_norm's `g * v / |v|`), with the parameters it is computed from."""
    if weight.op == "placeholder":
        name = source_fqn(weight)
        return f"weight is {f'the buffer {name}' if name else 'an input of the compiled function'}, not a parameter"
    sources, seen, stack = [], set(), [weight]
    while stack:
        node = stack.pop()
        for arg in node.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                if arg in params:
                    sources.append(params[arg].name)
                else:
                    stack.append(arg)
    origin = f"from {', '.join(sorted(sources))}" if sources else "from no parameter"
    return f"weight is not a parameter: computed in the graph {origin}; left as the model computes it"


def _from_model_inputs(graph: fx.Graph, params) -> set[fx.Node]:
    """The nodes computed from the model's inputs: tensor placeholders that are no module's parameter
    or buffer, and everything that reads one."""
    found = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node not in params and isinstance(value(node), torch.Tensor) and source_fqn(node) is None:
                found.add(node)
        elif any(arg in found for arg in node.all_input_nodes):
            found.add(node)
    return found


def _module_fqn(node: fx.Node, fallback: str) -> str:
    """The FQN of the innermost module the node ran in (`L['self'].model.layers[0].mlp` -> `model.layers.0.mlp`,
    `L['fn'][0]` -> `0`: a Sequential's first child, `L['args'][0].mlp` -> `mlp`: a module passed in)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return fallback
    path = re.sub(r"\[(\d+)\]", r".\1", list(stack.values())[-1][0])
    return re.sub(r"^L\['args'\]\.\d+\.?|^L\['[^']*'\]\.?", "", path) or fallback  # `.0` after a module: its child


def _feeds_topk(node: fx.Node, hops: int = ROUTER_HOPS, routing=frozenset()) -> bool:
    """A linear whose output reaches `topk`, an `argmax` made one-hot (Switch Transformers' and
    NLLB-MoE's expert choice), or a proven MoE layer's routing (`routing`: its top-k ids and weights,
    however computed: PhiMoE's sparsemixer picks experts with max and masked_fill), within `hops` nodes
    is an MoE router; not through another linear (that one is the router: Llama 4's attention o_proj
    reached its router's topk through the residual add and the norm)."""
    found = reaches(node, lambda u: picks_experts(u) or u in routing, hops, lambda u: u.target not in LINEAR_TARGETS)
    return found is not None


def picks_experts(node: fx.Node) -> bool:
    if node.target in (torch.topk, "topk"):
        return True
    return op_name(node) == "argmax" and any(op_name(user) == "one_hot" for user in node.users)


def find_linear_sites(
    graph: fx.Graph, example_inputs, claimed=frozenset(), expert_linears=None, routing=frozenset(), tied=frozenset()
) -> list[LinearSite]:
    """Every linear-like node not inside a claimed (MoE) region, as a site or a skipped site; `routing`:
    the proven MoE layers' top-k ids and weights (a linear feeding them is their router); `tied`: the ids
    of the model's embedding weights (a linear reading one is a tied head, also where the embedding runs
    in another graph)."""
    expert_linears = expert_linears or {}
    params = param_refs(graph, example_inputs)
    embedded = {n.args[1] for n in graph.nodes if n.op == "call_function" and n.target is F.embedding}
    activations = _from_model_inputs(graph, params)
    sites = []
    for node in graph.nodes:
        if node in claimed or (matched := _match(node, params)) is None:
            continue
        x, weight, stored_kn, bias, left = matched
        ref = params.get(weight)
        if ref is None and weight in activations and weight.op != "placeholder":
            continue  # a product of two activations (CLIP's `text_embeds @ image_embeds.t()`): no layer
        stored = value(weight)
        if not isinstance(stored, torch.Tensor) or stored.dim() != 2:
            continue  # not a matrix product with a 2-D weight
        n, k = (stored.shape[1], stored.shape[0]) if stored_kn else tuple(stored.shape)
        if ref is None:
            fqn = _module_fqn(node, node.name)
            reason = _not_a_parameter(weight, params)
            if is_cast(weight) and (source := params.get(weight.args[0])) is not None:  # DeepSeek-V4's mixing
                reason = f"weight is {source.name} cast to {stored.dtype} in the graph: left as the model computes it"
                if source.name.endswith(".weight"):  # a Linear's weight read by its owner: the Linear's row
                    fqn = source.name.removesuffix(".weight")
            if _feeds_topk(node, routing=routing):  # DeepSeek-V2's: F.linear(x.float(), w.float())
                reason = "MoE router: its outputs pick experts: left alone by default; its weight is cast in the graph"
            sites.append(LinearSite(fqn, [], Problem(int(n), int(k)), reason, node=node, x=x, bias=bias))
            continue
        ref = ParamRef(ref.node, ref.index, ref.name, transposed=stored_kn)
        fqn = ref.name.removesuffix(".weight")
        if weight in embedded or sum(_match(u, params) is not None for u in weight.users) > 1:
            fqn = _module_fqn(node, fqn)  # a shared (tied) weight: name the module that uses it here
        site = LinearSite(fqn, [ref], Problem(int(n), int(k)), node=node, x=x, bias=bias, left=left)
        if weight in expert_linears:
            site.config_kind = Kind.MOE
            site.notes.append(f"expert of {expert_linears[weight]} (not a provable fused MoE): moe spec")
        sites.append(site)
    from .attention import find_attention_sites  # its sites are linear sites: a cycle
    from .einsum_linear import find_einsum_linear_sites
    from .grouped_linear import find_grouped_linear_sites

    einsums = find_einsum_linear_sites(graph, params, claimed)
    for site in [s for s in sites if s.params] + einsums:  # what the defaults leave alone
        weight = site.weight
        if weight.node in embedded or id(example_inputs[weight.index]) in tied:
            site.default_ignore = "weight tied to an embedding"
        elif site.fqn.split(".")[-1] == "lm_head":
            site.default_ignore = "output head (lm_head)"
        elif _feeds_topk(site.node, routing=routing):
            site.default_ignore = "MoE router: its outputs pick experts"
    found = find_attention_sites(graph, params, claimed) + find_grouped_linear_sites(graph, params, claimed)
    return sites + found + einsums
