"""ISOPO's per-layer backward under FSDP2 (torch `fully_shard`, 2 gloo processes on CPU).

accelerate does not apply FSDP on CPU (a CPU launch runs as MULTI_CPU with plain parameters), so the check is at the
torch level: tests/scripts/isopo_fsdp2.py shards a tiny Qwen2 (every decoder layer and the root), trains 3 steps of
ISOPO (p=-1, c=1, a Fisher sample smaller than the tokens) with each rank holding half of every step's batch, and
compares with one process training on the same halves as two micro-batches (gradients averaged, EMA over both).
"""

import json
import os

import pytest
from _launch import launch_two_processes

HERE = os.path.dirname(__file__)


@pytest.mark.multiprocess
def test_fsdp2_two_processes_match_one_process(tmp_path):
    out = tmp_path / "fsdp2"
    proc = launch_two_processes(os.path.join(HERE, "scripts", "isopo_fsdp2.py"), str(out))
    r0, r1 = (json.load(open(f"{out}.rank{r}.json")) for r in (0, 1))
    assert r0["world_size"] == r1["world_size"] == 2, proc.stdout[-2000:]
    assert r0["sharded"] and r1["sharded"]  # parameters were DTensor shards, not replicas
    assert r0["changed"]
    # Parameters after 3 steps equal the one-process run (fp32); a run with the two halves' Fisher seeds swapped
    # differs by orders of magnitude more, so the comparison can fail.
    assert r0["max_rel_diff"] < 1e-5, r0["max_rel_diff"]
    assert r0["control_rel_diff"] > 1e-2, r0["control_rel_diff"]
    # The EMA (all-reduced once per step) is identical on both ranks and equal to the one-process EMA.
    assert r0["ema"] == r1["ema"] and r0["ema_matches_reference"]
    # Every covered layer (14 block linears and the LM head) produced its record in every micro-batch.
    assert len(r0["covered"]) == 15
    assert r0["records_per_micro_batch"] == r1["records_per_micro_batch"] == [15, 15, 15]


def test_sharding_rule():
    from trl_isopo.isopo.isopo_backward import ISOPO
    from trl_isopo.layerwise.install import unsupported_sharding

    assert unsupported_sharding(ISOPO, False, False, 0, 0.0) is None  # one process / DDP
    assert unsupported_sharding(ISOPO, False, False, 2, 0.0) is None  # ZeRO-2
    # ZeRO-2 with the KL pass (test_isopo_zero2.py)
    assert "beta > 0" in unsupported_sharding(ISOPO, False, False, 2, 0.04)
    assert unsupported_sharding(ISOPO, True, True, 0, 0.0) is None  # FSDP2
    assert "FSDP1" in unsupported_sharding(ISOPO, True, False, 0, 0.0)
    assert "ZeRO-3" in unsupported_sharding(ISOPO, False, False, 3, 0.0)
    assert "beta > 0" in unsupported_sharding(ISOPO, True, True, 0, 0.04)
