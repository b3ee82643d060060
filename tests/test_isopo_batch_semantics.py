"""ISOPO's batch semantics are TRL's: the optimizer-step update does not depend on how the step's sequences are split
over processes and micro-batches, and a batch repeated twice gives the update of the batch once (docs/isopo.md,
"Batch semantics").

Before the step normalization, the c = 0 settings summed unit-norm per-sequence directions: 2 processes gave half the
update of 1 process x GA=2, and X+X twice that of X. Gradients of 2 optimizer steps (the second reads the first's EMA),
float64, every token in the Fisher estimate, to 1e-5 relative.
"""

import os

import pytest
import torch
from isopo_steps import SETTINGS, concat, make_trainer, micro_batch, rel_diff, run_steps, with_reference

TOL = 1e-5
SEEDS = (11, 12)  # X_1, X_2




def prepared(tokenizer, setting, trainer_for_ref, parts):
    """Micro-batches as lists of parts (data seeds) concatenated; reference log-probs per part, so that X+X
    carries the same reference values as X twice."""
    out = []
    for seeds in parts:
        pieces = [micro_batch(tokenizer, s) for s in seeds]
        if trainer_for_ref.beta:
            pieces = [with_reference(trainer_for_ref, p, s) for p, s in zip(pieces, seeds)]
        out.append(concat(*pieces))
    return out


def run(tokenizer, tmp_path, setting, parts, ga):
    B = 4 * len(parts[0])
    trainer = make_trainer(tokenizer, tmp_path / f"{setting}-{ga}-{B}-{parts}", setting, ga=ga, batch_size=B)
    return run_steps(trainer, prepared(tokenizer, setting, trainer, parts))


@pytest.fixture(scope="module")
def two_process(tmp_path_factory):
    from _launch import launch_two_processes

    out = tmp_path_factory.mktemp("split") / "result"
    script = os.path.join(os.path.dirname(__file__), "scripts", "isopo_batch_split.py")
    launch_two_processes(script, str(out), ",".join(map(str, SEEDS)))
    ranks = [torch.load(f"{out}.rank{r}.pt") for r in (0, 1)]
    assert ranks[0]["world_size"] == ranks[1]["world_size"] == 2
    return ranks


@pytest.mark.multiprocess
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_two_processes_equal_one_process_with_accumulation(two_process, tiny_tokenizer, tmp_path, setting):
    """1 process x GA=2 over (X_1, X_2) = 2 processes x GA=1 (rank r: X_r), both ranks alike; another split of the
    data (X_1 twice) differs."""
    one = run(tiny_tokenizer, tmp_path, setting, [[SEEDS[0]], [SEEDS[1]]], ga=2)
    ddp = [r["grads"][setting] for r in two_process]
    for step in range(len(one)):
        assert rel_diff(ddp[0][step], ddp[1][step]) == 0.0
        assert rel_diff(ddp[0][step], one[step]) < TOL, (step, rel_diff(ddp[0][step], one[step]))
    other = run(tiny_tokenizer, tmp_path, setting, [[SEEDS[0]], [SEEDS[0]]], ga=2)
    assert rel_diff(other[0], one[0]) > 1e-2


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_repeated_batch_gives_the_same_update(tiny_tokenizer, tmp_path, setting):
    """One micro-batch X = X+X (same sequences twice) = 1 process x GA=2 over (X, X); a different X differs."""
    x = run(tiny_tokenizer, tmp_path, setting, [[SEEDS[0]]], ga=1)
    xx = run(tiny_tokenizer, tmp_path, setting, [[SEEDS[0], SEEDS[0]]], ga=1)
    x_ga2 = run(tiny_tokenizer, tmp_path, setting, [[SEEDS[0]], [SEEDS[0]]], ga=2)
    for step in range(len(x)):
        assert rel_diff(xx[step], x[step]) < TOL, (step, rel_diff(xx[step], x[step]))
        assert rel_diff(x_ga2[step], x[step]) < TOL, (step, rel_diff(x_ga2[step], x[step]))
    control = run(tiny_tokenizer, tmp_path, setting, [[SEEDS[1]]], ga=1)
    assert rel_diff(control[0], x[0]) > 1e-2
