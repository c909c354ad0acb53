"""Lowering: the per-rank programs (layout changes as collectives) and the Plan that offers them."""
