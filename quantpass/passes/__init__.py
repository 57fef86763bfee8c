"""Graph passes: the quantize rewrite, verification, and the pass manager."""
