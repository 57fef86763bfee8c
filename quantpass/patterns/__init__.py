"""Detection: find linear and MoE sites in Dynamo graphs (what a site is; `passes/` lowers them)."""
