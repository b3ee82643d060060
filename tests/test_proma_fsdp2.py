"""PROMA's per-layer backward under FSDP2 (torch `fully_shard`, 2 gloo processes on CPU; docs/proma.md, "Gradient
accumulation and data parallelism").

As for ISOPO (tests/test_isopo_fsdp2.py), accelerate does not apply FSDP on CPU, so the check is at the torch level:
tests/scripts/proma_fsdp2.py shards a tiny Qwen2, trains 3 steps with each rank holding half of every step's batch,
and compares with one process computing the mean of the two ranks' chains from the same halves and sketch keys.
"""

import json
import os

import pytest
from _launch import launch_two_processes

HERE = os.path.dirname(__file__)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["intra", "accumulation"])
def test_fsdp2_two_processes_match_the_mean_of_their_chains(mode, tmp_path):
    out = tmp_path / mode
    proc = launch_two_processes(os.path.join(HERE, "scripts", "proma_fsdp2.py"), str(out), mode)
    r0, r1 = (json.load(open(f"{out}.rank{r}.json")) for r in (0, 1))
    assert r0["world_size"] == r1["world_size"] == 2, proc.stdout[-2000:]
    assert r0["sharded"] and r1["sharded"] and r0["changed"]
    # Every covered layer (14 block linears and the head, an ordinary linear here) projected in every micro-batch of
    # every step, on both ranks.
    assert len(r0["covered"]) == 15
    calls = 15 * (1 if mode == "intra" else 2)
    assert r0["projected_calls"] == r1["projected_calls"] == [calls] * 3
    # Parameters after 3 steps equal the one-process mean of the chains (fp32); the control (swapped sketch keys for
    # intra, another micro-batch split for accumulation) differs by orders of magnitude more.
    assert r0["max_rel_diff"] < 1e-5, r0["max_rel_diff"]
    assert r0["control_rel_diff"] > 1e-3, r0["control_rel_diff"]
