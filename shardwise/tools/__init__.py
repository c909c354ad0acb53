"""The tools room beside the pipeline (no pipeline room imports it): bench.py, ``shardwise bench``."""
