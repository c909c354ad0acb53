"""Planning time flat in depth (issue 12): GPT-2 small's shapes (h 768, 12 heads, seq 1024,
vocab 50257) on (2, 4) with every parameter placed by the ILP, at 12 and 24 layers, on the meta
device (shardwise/plan/timing.py; `shardwise bench` prints 2 to 24 layers). Identical layers
share the program's columns (plan/layers.py), so 24 layers plan in about the time of 12.
CPU seconds of this process (time.process_time), so other work on the machine does not count.

    python -m pytest tests/plan/test_planning_depth.py -q -p no:cacheprovider -m slow    # ~3 min
"""
import time

import pytest

from shardwise.plan.timing import plan_time


@pytest.mark.slow
def test_24_layers_plan_in_about_the_time_of_12():
    rows = {}
    for n in (12, 24):
        t0 = time.process_time()
        rows[n] = dict(plan_time(n), cpu=time.process_time() - t0)
    assert rows[24]["columns"] <= 1.15 * rows[12]["columns"], rows
    assert rows[24]["cpu"] < 1.3 * rows[12]["cpu"], rows
