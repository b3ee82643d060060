"""A third per-layer method on trl-isopo's engine (docs/layerwise.md), in no paper here: per-sequence gradient
clipping per layer. Each covered linear layer's gradient is sum_i A_i min(1, c / ||(V_i, b_i)||) (V_i, b_i), with
(V_i, b_i) sequence i's weight and bias gradient of the advantage-free surrogate at that layer (materialized: an
example). `python examples/seqclip_method.py` trains 2 steps on a tiny model (CPU, ~10 s)."""

import os
import tempfile
from dataclasses import dataclass, field

import torch
from trl import GRPOConfig

from trl_isopo import LayerBackward, LayerGrads, LayerwiseTrainer, MethodName


class SeqClipBackward(LayerBackward):
    def __init__(self, max_norm: float):
        super().__init__(MethodName(title="SeqClip", prefix="seqclip"))
        self.max_norm, self.clipped = max_norm, []  # per layer call: the fraction of sequences clipped

    def grads(self, call):
        X, G = call.X.to(call.dtype), call.G.to(call.dtype) * call.mask.unsqueeze(-1)  # (B, L, d_in), (B, L, d_out)
        V = torch.einsum("blo,bli->boi", G, X)  # sequence i's weight gradient V_i
        b = G.sum(1) if call.has_bias else None  # and its bias gradient
        norm = (V.square().sum((1, 2)) + (b.square().sum(1) if b is not None else 0)).sqrt()
        scale = (self.max_norm / norm).clamp(max=1.0)  # norm 0: no clipping
        self.clipped.append((scale < 1).to(call.dtype).mean())
        w = call.advantages * scale
        return LayerGrads(torch.einsum("b,boi->oi", w, V), None if b is None else w @ b)

    def end_step(self, reduce):  # after each optimizer step: the mean over its layer calls, on every process
        calls, self.clipped = self.clipped, []
        total = reduce(torch.tensor([float(sum(c.item() for c in calls)), len(calls)], dtype=torch.float64))
        return {self.method.metric("clipped_fraction"): float(total[0] / total[1])} if total[1] > 0 else {}


@dataclass
class SeqClipConfig(GRPOConfig):
    seqclip_max_norm: float = field(default=1.0, metadata={"help": "c: the largest per-sequence gradient norm."})


class SeqClipTrainer(LayerwiseTrainer):
    config_class, _name = SeqClipConfig, "SeqClip"

    def make_backward(self, args):
        return SeqClipBackward(args.seqclip_max_norm)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from trl_isopo.tiny import load_tiny_tokenizer, make_tiny_model_dir, tiny_prompt_dataset, tiny_reward

    model_dir = make_tiny_model_dir(os.path.join(tempfile.gettempdir(), "trl-isopo-tiny"))
    args = SeqClipConfig(output_dir=os.path.join(tempfile.gettempdir(), "seqclip"), seqclip_max_norm=0.05,
                         num_generations=4, per_device_train_batch_size=8, max_completion_length=6, max_steps=2,
                         learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True, bf16=False,
                         save_strategy="no")
    trainer = SeqClipTrainer(model_dir, tiny_reward, args=args, train_dataset=tiny_prompt_dataset(16),
                             processing_class=load_tiny_tokenizer(model_dir))
    trainer.train()
    print({k: v for k, v in trainer.state.log_history[-2].items() if k.startswith(("reward", "seqclip/", "loss"))})
