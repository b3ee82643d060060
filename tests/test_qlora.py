"""QLoRA: a frozen bitsandbytes 4-bit (NF4) base with LoRA adapters, under ISOPO and TPO, on the CPU (or a GPU).

- ISOPO against the float64 per-sequence oracle of tests/isopo_oracle.py through the *same* quantized base: ISOPO
  covers the adapters' lora_A / lora_B linears; the base's 4-bit linears are frozen and only pass gradients through.
- `trl-isopo isopo|tpo --load_in_4bit true` trains 2 steps on the tiny model (fast) and on SmolLM2 (slow).

Skipped when bitsandbytes is not installed (`pip install "trl-isopo[quantization]"`).
"""

import os

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from isopo_oracle import DEVICE, dense_weights, make_batch, make_trainer, per_sequence_data, rel_err  # noqa: E402
from isopo_oracle_checks import isopo_grads_fixed, set_settings  # noqa: E402

ADAPTED = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# float32 compute through the quantized base (bitsandbytes has no float64 4-bit matmul); the per-sequence oracle runs
# the same float32 forward one row at a time and its dense formulas in float64. Measured worst relative error over
# the settings below: 6.5e-7 (2026-12-02, CPU, torch 2.13, bitsandbytes 0.50.2); the tolerance leaves two orders of
# magnitude for other BLAS builds.
QLORA_TOL = 1e-4


@pytest.fixture
def fresh_state():
    """The CLI builds its own trainer: reset accelerate's singletons after it (as tests/recipe_support.py does)."""
    from accelerate.state import AcceleratorState, PartialState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


def quantized_base(model_dir):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=qc, dtype=torch.float32, device_map={"": DEVICE}
    )


@pytest.fixture(scope="module")
def qlora_setup(tiny_model_dir, tiny_tokenizer, tmp_path_factory):
    from peft import LoraConfig

    lc = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=ADAPTED, task_type="CAUSAL_LM",
                    init_lora_weights=False)  # lora_B != 0, so lora_A gets a gradient too
    trainer = make_trainer(quantized_base(tiny_model_dir), tiny_tokenizer, tmp_path_factory.mktemp("qlora"),
                           peft_config=lc)
    # TRL casts QLoRA adapters to bf16 (the QLoRA paper's recipe); back to float32 here so that the comparison
    # measures ISOPO's math through the 4-bit base, not bf16 rounding (the training tests below keep bf16).
    for p in trainer.model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    inputs = make_batch(tiny_tokenizer)
    data = per_sequence_data(trainer, inputs)
    for key in ("V", "X", "G"):
        data[key] = {n: v.double() for n, v in data[key].items()}
    return trainer, inputs, data


def test_isopo_covers_the_adapters_over_a_4bit_base(qlora_setup):
    trainer, _, _ = qlora_setup
    modules = dict(trainer.model.named_modules())
    covered = trainer.isopo_coverage["covered"]
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in modules.values()) == 2 * len(ADAPTED)  # 2 layers
    assert len(covered) == 2 * 2 * len(ADAPTED) and all(".lora_A." in n or ".lora_B." in n for n in covered)
    assert not any(p.requires_grad for n, p in trainer.model.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize(
    "knobs",
    [
        pytest.param(dict(p=-1.0, q=0.0, r=0.0, reg=0.0), id="p=-1"),
        pytest.param(dict(p=0.0, q=-1.0, r=-2.0, reg=0.0), id="p=0,q=-1,r=-2"),
    ],
)
def test_isopo_matches_oracle_through_a_4bit_base(qlora_setup, knobs):
    """Every adapter's ISOPO gradient sum_i w_i V_i, with w_i from the dense float64 formulas on per-sequence
    autograd through the same quantized base (all tokens in the Fisher sample, c = 0)."""
    trainer, inputs, data = qlora_setup
    covered = trainer.isopo_coverage["covered"]
    valid = data["mask"].reshape(-1).nonzero().squeeze(1)
    set_settings(trainer, **knobs, route="auto", fisher_tokens=0, interacting=False)
    got = isopo_grads_fixed(trainer, inputs, {n: valid for n in covered})
    A = inputs["advantages"]
    worst = 0.0
    for n in covered:
        w, _ = dense_weights(data["V"][n], data["X"][n], data["G"][n], valid, A, knobs["p"], knobs["q"], knobs["r"],
                             0.0, n_step=len(A))
        want = torch.einsum("b,boi->oi", w, data["V"][n])
        err = rel_err(got[f"{n}.weight"].double(), want)
        worst = max(worst, err)
        assert err < QLORA_TOL, (n, err)
    assert worst > 0.0  # float32 compute: an exact match would mean the comparison did not run through it


def test_cli_rejects_4bit_without_peft(tiny_model_dir, tmp_path, fresh_state):
    from recipe_support import run_recipe

    with pytest.raises(ValueError, match="add --use_peft true"):
        run_recipe("recipes/Qwen3-0.6B/gsm8k/isopo.yaml", tiny_model_dir, tmp_path / "o", "--load_in_4bit", "true")


@pytest.mark.parametrize("method", ["isopo", "tpo"])
def test_cli_qlora_two_steps_on_the_tiny_model(method, tiny_model_dir, tmp_path, fresh_state):
    pytest.importorskip("reasoning_gym")
    from recipe_support import check_two_steps, run_recipe

    recipe = f"recipes/Qwen3-0.6B/graph_color/{method}_lora.yaml"
    out = tmp_path / "out"
    trainer = run_recipe(recipe, tiny_model_dir, out, "--load_in_4bit", "true")
    check_two_steps(trainer, recipe, str(out))
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in trainer.model.modules()) > 0
    lora = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora) and all(torch.isfinite(p).all() for p in lora.values())
    if method == "isopo":
        assert trainer.isopo_coverage["covered"] and all("lora_" in n for n in trainer.isopo_coverage["covered"])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["isopo", "tpo"])
def test_cli_qlora_two_steps_on_smollm2(method, smollm2_dir, tmp_path, fresh_state):
    """`--load_in_4bit true` on the real model (SmolLM2-135M-Instruct, the `smollm2` alias), 2 optimizer steps."""
    pytest.importorskip("reasoning_gym")
    from recipe_support import ROOT, check_two_steps, real_overrides

    from trl_isopo.scripts import train as train_script

    recipe = f"recipes/SmolLM2-135M-Instruct/chain_sum/{method}_lora.yaml"
    out = tmp_path / "out"
    trainer = train_script.run(
        ["--config", os.path.join(ROOT, recipe), *real_overrides(str(out)), "--load_in_4bit", "true"]
    )
    check_two_steps(trainer, recipe, str(out))
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in trainer.model.modules()) == 30 * 7
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    assert trained and all(torch.isfinite(p).all() for p in trained)
