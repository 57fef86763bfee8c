"""Which lowering each kind of matched site gets: the one table from site classes to `SiteLowering`s."""

from __future__ import annotations

from ..patterns.attention import ProjectionSite
from ..patterns.expert_parallel import ExpertParallelMoESite
from ..patterns.grouped_linear import GroupedLinearSite
from ..patterns.linear import LinearSite
from ..patterns.moe import MoESite
from ..patterns.moe_expert_gemms import ExpertGemmSite
from ..patterns.site import Site
from .lower_attention import ProjectionLowering
from .lower_expert_gemms import ExpertGemmLowering
from .lower_grouped_linear import GroupedLinearLowering
from .lower_linear import LinearLowering
from .lower_moe import ExpertParallelMoELowering, MoELowering
from .lower_site import SiteLowering

LOWERINGS: dict[type[Site], SiteLowering] = {
    LinearSite: LinearLowering(),
    GroupedLinearSite: GroupedLinearLowering(),
    ProjectionSite: ProjectionLowering(),
    MoESite: MoELowering(),
    ExpertParallelMoESite: ExpertParallelMoELowering(),
    ExpertGemmSite: ExpertGemmLowering(),
}


def lowering_for(site: Site) -> SiteLowering:
    """The lowering of `site`'s class (exactly: a subclass matched elsewhere needs its own row)."""
    found = LOWERINGS.get(type(site))
    if found is None:
        known = ", ".join(cls.__name__ for cls in LOWERINGS)
        raise TypeError(f"no lowering for site class {type(site).__name__!r}; lowered classes: {known}")
    return found
