"""Test models (see zoo.py)."""
