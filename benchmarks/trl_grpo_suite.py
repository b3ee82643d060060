"""Run TRL's own GRPO trainer tests against GRPOTrainer, ISOPOTrainer or TPOTrainer, offline, and count outcomes.

    python benchmarks/trl_grpo_suite.py /path/to/trl/tests [--trainers grpo isopo tpo] [-k EXPR]

TRL's tests load tiny checkpoints and the "zen" prompt dataset from the Hub. This script builds local stand-ins:
randomly initialised tiny models of the same architectures (vocabulary 151936, Qwen2.5's special tokens at their
real ids, a byte-level BPE trained on the zen prompts) written into a Hugging Face hub-cache layout, so every
`from_pretrained(repo_id)` resolves offline; `load_dataset("trl-internal-testing/zen", ...)` returns the same
prompts built in memory. The swap replaces `GRPOTrainer` / `GRPOConfig` in the test module and in `trl`. Vision
checkpoints and other datasets are not imitated: those tests are skipped with the reason.

Outcome "refused": the test raised a ValueError whose raise site is in `trl_isopo` (not in TRL code it calls into),
i.e. the config or trainer declined a GRPO feature it does not support (docs/grpo-config.md lists them). Nothing is
written into the tests folder; results go to a JSON-lines file per trainer next to the hub cache.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import traceback

import pytest

ZEN_TRAIN = [
    "Beautiful is better than", "Explicit is", "Simple is better", "Complex", "Flat is better than",
    "Sparse is better", "Readability", "Special cases aren't special", "Although practicality beats",
    "Errors should never", "Unless explicitly", "In the face of ambiguity, refuse", "There should be one--",
    "Although that way may not be", "Now is better than", "Never is often better",
    "If the implementation is hard to explain, it's",
]  # fmt: skip
ZEN_TEST = ["If the implementation is easy", "Namespaces are one honking"]
# Qwen2.5's special-token ids: the tests hard-code 151643 (pad) and 151645 (eos) in mocked generations.
SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|finetune_right_pad_id|>": 151646}
VOCAB_SIZE = 151936


# The tiny Qwen2.5 checkpoints carry Qwen2.5's chat template, which TRL 1.16 ships (tool calls included).
def _qwen2_5_chat_template() -> str:
    from trl.chat_template_utils import qwen2_5_chat_template

    return qwen2_5_chat_template


MODELS = {  # repo id -> (family, head)
    "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": ("qwen2", "causal"),
    "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "seqcls"),
    "trl-internal-testing/tiny-Qwen3ForCausalLM": ("qwen3", "causal"),
    "trl-internal-testing/tiny-Qwen3ForSequenceClassification": ("qwen3", "seqcls"),
    "trl-internal-testing/tiny-Gemma2ForCausalLM": ("gemma2", "causal"),
    "trl-internal-testing/tiny-LlamaForSequenceClassification-3.2": ("llama", "seqcls"),
    "trl-internal-testing/tiny-Qwen3MoeForCausalLM": ("qwen3_moe", "causal"),
}
UNAVAILABLE = {  # substring of a test id -> why it cannot run offline
    "ConditionalGeneration": "needs a Hub VLM checkpoint and the zen-image dataset",
    "test_training_vlm_multi_image": "needs a Hub VLM checkpoint and the zen-multi-image dataset",
    # its mocked generations are hard-coded ids of Qwen2.5's real vocabulary (<tool_call> JSON), which the stand-in
    # tokenizer (a BPE trained on the zen prompts) decodes to other text: no tool call is ever parsed
    "test_training_with_tools": "decodes hard-coded token ids of the real Qwen2.5 tokenizer",
}
# Outcome of a ValueError raised by TrainingArguments on a CPU without bf16 when a trainer builds its default config.
ENV_ERRORS = ("doesn't support bf16/gpu",)


def build_tokenizer():
    """Byte-level BPE trained on the zen prompts, with Qwen2.5's special tokens at their real ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    text = ZEN_TRAIN + ZEN_TEST + ["user assistant system : Done! I don't know any tool multiply_tool 0123456789 {}"]
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(text * 5, trainer)
    data = json.loads(bpe.to_str())
    data["added_tokens"] = []
    for content, idx in SPECIALS.items():  # in the model vocabulary too, so a BPE rebuild keeps the ids
        data["model"]["vocab"][content] = idx
        data["added_tokens"].append({"id": idx, "content": content, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(data, f)
    tok = PreTrainedTokenizerFast(tokenizer_file=f.name, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                  padding_side="left")
    os.unlink(f.name)
    tok.chat_template = _qwen2_5_chat_template()
    return tok


def build_model(family: str, head: str, tok):
    import torch
    import transformers as tf

    common = dict(vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    configs = {
        "qwen2": lambda: tf.Qwen2Config(**common),
        "qwen3": lambda: tf.Qwen3Config(head_dim=4, **common),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(head_dim=4, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=16, **common),
        "gemma2": lambda: tf.Gemma2Config(head_dim=4, tie_word_embeddings=True, **common),  # tied, like the real one
        "llama": lambda: tf.LlamaConfig(**common),
    }
    cfg = configs[family]()
    if head == "seqcls":
        cfg.num_labels = 1
        cls = tf.AutoModelForSequenceClassification._model_mapping[type(cfg)]
    else:
        cls = tf.AutoModelForCausalLM._model_mapping[type(cfg)]
    torch.manual_seed(0)
    model = cls(cfg)
    if head == "causal":
        model.generation_config = tf.GenerationConfig(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return model


def build_hub_cache(cache_dir: str) -> None:
    """Write every MODELS repo into a hub-cache layout (refs/main -> snapshots/<sha>), skipping those present."""
    tok = None
    for repo, (family, head) in MODELS.items():
        root = os.path.join(cache_dir, "models--" + repo.replace("/", "--"))
        sha = hashlib.sha1(repo.encode()).hexdigest()
        snap = os.path.join(root, "snapshots", sha)
        if os.path.exists(os.path.join(snap, "model.safetensors")):
            continue
        tok = tok or build_tokenizer()
        os.makedirs(snap, exist_ok=True)
        build_model(family, head, tok).save_pretrained(snap)
        tok.save_pretrained(snap)
        os.makedirs(os.path.join(root, "refs"), exist_ok=True)
        with open(os.path.join(root, "refs", "main"), "w") as f:
            f.write(sha)


def zen_dataset(config_name, split=None):
    from datasets import Dataset, DatasetDict

    def make(prompts):
        if config_name == "standard_prompt_only":
            return Dataset.from_dict({"prompt": prompts})
        if config_name == "conversational_prompt_only":
            return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})
        raise KeyError(config_name)

    dataset = DatasetDict({"train": make(ZEN_TRAIN), "test": make(ZEN_TEST)})
    return dataset[split] if split else dataset


# ---------------------------------------------------------------- pytest plugin (loaded with -p trl_grpo_suite)


def _trainer_classes(name: str):
    import trl

    if name == "grpo":
        return trl.GRPOTrainer, trl.GRPOConfig
    import trl_isopo

    return {"isopo": (trl_isopo.ISOPOTrainer, trl_isopo.ISOPOConfig),
            "tpo": (trl_isopo.TPOTrainer, trl_isopo.TPOConfig)}[name]


def _cpu_default(config_cls):
    """The config class with `use_cpu=True` by default: TrainingArguments refuses its bf16 default on a CPU without
    bf16. A named attribute of this module, so Trainer can pickle the arguments."""
    cls = dataclasses.make_dataclass("Cpu" + config_cls.__name__, [("use_cpu", bool, dataclasses.field(default=True))],
                                     bases=(config_cls,))
    cls.__module__ = __name__
    setattr(sys.modules[__name__], cls.__name__, cls)
    return cls


def _compat_shims() -> None:
    """Names that TRL's newer test files import and 1.16 lacks; unused by the tests that run on a CPU."""
    import importlib.util

    import trl.import_utils as trl_imports  # trl is a lazy module: bind the submodules directly
    import trl.trainer.utils as trl_utils

    if not hasattr(trl_utils, "get_kbit_device_map"):  # only the GPU-only QLoRA VLM test calls it
        trl_utils.get_kbit_device_map = lambda: None
    for name, pkg in {"is_jmespath_available": "jmespath", "is_joblib_available": "joblib",
                      "is_llm_blender_available": "llm_blender", "is_mergekit_available": "mergekit"}.items():
        if not hasattr(trl_imports, name):
            setattr(trl_imports, name, lambda p=pkg: importlib.util.find_spec(p) is not None)


def pytest_configure(config):
    _compat_shims()


def _fake_load_dataset(path, name=None, split=None, **kwargs):
    if path != "trl-internal-testing/zen":
        pytest.skip(f"offline: dataset {path} is not imitated")
    return zen_dataset(name, split)


def pytest_collection_modifyitems(config, items):
    import trl

    trainer_cls, config_cls = _trainer_classes(os.environ.get("TRAINER", "grpo"))
    config_cls = _cpu_default(config_cls)
    trl.GRPOTrainer, trl.GRPOConfig = trainer_cls, config_cls
    for item in items:
        if getattr(item.module, "GRPOTrainer", None) is not None:
            item.module.GRPOTrainer, item.module.GRPOConfig = trainer_cls, config_cls
            item.module.load_dataset = _fake_load_dataset
        for key, reason in UNAVAILABLE.items():
            if key in item.nodeid:
                item.add_marker(pytest.mark.skip(reason=f"offline: {reason}"))


def _classify(rep, excinfo) -> tuple[str, str]:
    if rep.skipped:
        if hasattr(rep, "wasxfail"):
            return "xfailed", str(rep.wasxfail)
        return "skipped", str(rep.longrepr[2]) if isinstance(rep.longrepr, tuple) else ""
    if rep.passed:
        return ("xpassed" if hasattr(rep, "wasxfail") else "passed"), ""
    message = f"{excinfo.typename}: {excinfo.value}" if excinfo else str(rep.longrepr)[-300:]
    if rep.when != "call":
        return "error", message
    # raised by trl_isopo itself (its config or trainer declining a feature), not by TRL code it calls into
    frames = traceback.extract_tb(excinfo.tb) if excinfo is not None else []
    ours = bool(frames) and "/trl_isopo/" in frames[-1].filename
    if ours and isinstance(excinfo.value, ValueError) and not any(e in message for e in ENV_ERRORS):
        return "refused", message
    return "failed", message


def _record(item, rep, excinfo) -> None:
    outcome, message = _classify(rep, excinfo)
    with open(os.environ["SUITE_RESULTS"], "a") as f:
        f.write(json.dumps({"test": item.nodeid.split("::", 1)[-1], "outcome": outcome, "when": rep.when,
                            "seconds": round(rep.duration, 1), "message": " ".join(message.split())[:400]}) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Records the final report (after the skip/xfail plugin) of each call, and each non-passing phase."""
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" or rep.outcome != "passed":
        _record(item, rep, call.excinfo)


# ---------------------------------------------------------------- driver

OUTCOMES = ("passed", "failed", "refused", "skipped", "error", "xfailed", "xpassed")


def summarize(path: str) -> collections.Counter:
    rows = {}
    for line in open(path) if os.path.exists(path) else []:
        row = json.loads(line)
        if row["test"] not in rows or row["outcome"] != "passed":  # a teardown error outranks a passed call
            rows[row["test"]] = row
    return collections.Counter(r["outcome"] for r in rows.values()), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests_dir", help="a TRL checkout's tests/ folder (with test_grpo_trainer.py, testing_utils.py)")
    parser.add_argument("--trainers", nargs="+", default=["grpo", "isopo", "tpo"], choices=["grpo", "isopo", "tpo"])
    parser.add_argument("--work_dir", default=os.path.join(tempfile.gettempdir(), "trl_grpo_suite"))
    parser.add_argument("-k", default=None, help="pytest -k expression")
    args = parser.parse_args()

    tests_dir = os.path.abspath(args.tests_dir)
    os.makedirs(args.work_dir, exist_ok=True)
    env = {**os.environ, "HF_HUB_CACHE": os.path.join(args.work_dir, "hub_cache"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "TRL_EXPERIMENTAL_SILENCE": "1", "WANDB_DISABLED": "true",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")])}
    os.environ.update({k: env[k] for k in ("HF_HUB_CACHE", "HF_HUB_OFFLINE")})
    build_hub_cache(env["HF_HUB_CACHE"])

    table = {}
    for name in args.trainers:
        results = os.path.join(args.work_dir, f"results-{name}.jsonl")
        if os.path.exists(results):
            os.remove(results)
        cmd = [sys.executable, "-m", "pytest", os.path.join(tests_dir, "test_grpo_trainer.py"), "-p", "trl_grpo_suite",
               "-p", "no:cacheprovider", "-q", "--rootdir", os.path.dirname(tests_dir)]
        if args.k:
            cmd += ["-k", args.k]
        subprocess.run(cmd, env={**env, "TRAINER": name, "SUITE_RESULTS": results}, cwd=os.path.dirname(tests_dir))
        table[name], rows = summarize(results)
        for row in sorted(rows.values(), key=lambda r: r["test"]):
            if row["outcome"] in ("failed", "refused", "error"):
                print(f"[{name}] {row['outcome']:8s} {row['test']}: {row['message'][:200]}")

    print("\n| trainer | " + " | ".join(OUTCOMES) + " | total |")
    print("|---" * (len(OUTCOMES) + 2) + "|")
    for name, counts in table.items():
        print(f"| {name} | " + " | ".join(str(counts[o]) for o in OUTCOMES) + f" | {sum(counts.values())} |")


if __name__ == "__main__":
    main()
