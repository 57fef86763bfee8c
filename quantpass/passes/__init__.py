"""Graph passes: the quantize pass (`quantize_pass.QuantizePass`), the rewrite of every matched site
(`quantize.py`, with each kind's lowering in `lower_*.py`), building and verifying the weights."""
