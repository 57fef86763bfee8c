"""Pattern matchers: find linear and MoE sites in Dynamo graphs."""
