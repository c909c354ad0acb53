"""Lowering: layout changes as collectives, and the per-rank program."""
