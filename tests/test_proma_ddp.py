"""PROMA under DDP (2 gloo processes on CPU, tests/scripts/proma_ddp.py) against one process.

- intra, `microbatch` target: the update is the order-independent sum of the projected micro-batch gradients, so 2
  processes x GA = 1 give the update of 1 process x GA = 2 on the same micro-batches (each micro-batch's sketches
  seeded by its content here; with the trainer's (process, step, index) seeds the two runs draw different sketches).
- accumulation: one chain per process; the 2-process update is the mean of the per-process chains, not the chain over
  all micro-batches of the step.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))
from proma_steps import DDP_KNOBS, DDP_SEEDS, make_trainer, micro_batches, run_step, sketches_by_content  # noqa: E402
from proma_oracle import assert_matches  # noqa: E402


@pytest.fixture(scope="module")
def two_process(tmp_path_factory):
    from _launch import launch_two_processes

    out = tmp_path_factory.mktemp("proma_ddp") / "run"
    launch_two_processes(os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "proma_ddp.py"), str(out))
    ranks = [torch.load(f"{out}.rank{r}.pt") for r in range(2)]
    assert all(r["world_size"] == 2 for r in ranks)
    return [r["grads"] for r in ranks]


def one_process(tokenizer, path, setting, seeds):
    trainer = make_trainer(tokenizer, path, ga=len(seeds), **DDP_KNOBS[setting])
    sketches_by_content(trainer)
    return trainer, run_step(trainer, micro_batches(tokenizer, seeds))


def covered_weights(trainer):
    return [f"{n}.weight" for n in trainer.proma_coverage["covered"]]


def close(a, b, tol):
    return ((a - b).norm() / b.norm()).item() < tol


@pytest.mark.multiprocess
def test_intra_two_processes_equal_one_process_with_accumulation(two_process, tiny_tokenizer, tmp_path):
    ddp = [r["intra"] for r in two_process]
    seeds = tuple(s for rank in DDP_SEEDS["intra"] for s in rank)
    trainer, single = one_process(tiny_tokenizer, tmp_path, "intra", seeds)
    assert ddp[0].keys() == single.keys()
    for k in covered_weights(trainer):
        assert torch.equal(ddp[0][k], ddp[1][k])  # DDP: both ranks hold the reduced gradient
        assert_matches(ddp[0][k], single[k], tol=1e-9)
    for k in single.keys() - set(covered_weights(trainer)):
        assert close(ddp[0][k], single[k], 1e-6), k


@pytest.mark.multiprocess
def test_accumulation_runs_one_chain_per_process(two_process, tiny_tokenizer, tmp_path):
    ddp = [r["accumulation"] for r in two_process]
    chains = [one_process(tiny_tokenizer, tmp_path / f"r{r}", "accumulation", s)[1]
              for r, s in enumerate(DDP_SEEDS["accumulation"])]  # fmt: skip
    trainer, long_chain = one_process(tiny_tokenizer, tmp_path / "all", "accumulation",
                                      tuple(s for rank in DDP_SEEDS["accumulation"] for s in rank))  # fmt: skip
    for k in covered_weights(trainer):
        mean = 0.5 * (chains[0][k] + chains[1][k])
        assert_matches(ddp[0][k], mean, tol=1e-9)
        assert_matches(ddp[1][k], mean, tol=1e-9)
        # the micro-batch losses are scaled alike (1/4 of a token mean each), so only the projections differ
        assert not close(ddp[0][k], long_chain[k], 1e-3), k
