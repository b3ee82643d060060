"""Model cards for `trl-isopo train`: Hub tags, the method's paper citation and the exact training command.

TRL writes `README.md` through `trainer.create_model_card(...)`, which `GRPOTrainer._save_checkpoint` calls on every
checkpoint and `Trainer.push_to_hub` calls before uploading. `attach_model_card(trainer, method, command)` wraps that
method on the trainer instance, so every card it writes (checkpoint, final save, push) gets

- the tags `trl`, `trl-isopo` and the method's tag (`grpo`, `isopo` or `target-policy-optimization`; never `tpo`,
  the Hub tag of TRL's unrelated *Triple* Preference Optimization);
- the method's paper citation (added only if the trainer's own `_paper` did not already put it in the card);
- a "Training command" section with the command line, the recipe file's content and the task description.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence

from trl_isopo.methods import get_method

TRAINING_COMMAND_HEADING = "## Training command"


def method_tags(method: str) -> list[str]:
    """Hub tags: `trl`, `trl-isopo` and the method's trainer's own `_tag_names` (the single source of truth)."""
    return list(dict.fromkeys(["trl", "trl-isopo", *get_method(method).trainer_cls._tag_names]))


def method_paper(method: str) -> dict:
    """`{"title", "id", "citation"}` of a method's paper: its trainer's own `_paper`."""
    return get_method(method).trainer_cls._paper


def format_command(argv: Sequence[str] | None = None, prog: str = "trl-isopo train") -> str:
    """Shell-quoted command line: `trl-isopo train --config ... --flag value`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return " ".join([prog, *(shlex.quote(a) for a in argv)])


def training_command_section(command: str, recipe_text: str | None = None, description: str | None = None) -> str:
    lines = [
        TRAINING_COMMAND_HEADING,
        "",
        "Trained with trl-isopo (built on TRL):",
        "",
    ]
    lines += ["```bash", command, "```", ""]
    if description:
        lines += [description, ""]
    if recipe_text:
        lines += ["Recipe (`--config` file):", "", "```yaml", recipe_text.rstrip(), "```", ""]
    return "\n".join(lines)


def decorate_card_text(
    text: str, method: str, command: str, recipe_text: str | None = None, description: str | None = None
) -> str:
    """Add the method's citation (if missing) and the training-command section to a card's markdown."""
    paper = method_paper(method)
    if paper["id"] not in text:
        text = (
            text.rstrip()
            + f"\n\nCite {paper['title']} (arXiv {paper['id']}) as:\n\n```bibtex\n{paper['citation']}\n```\n"
        )
    if TRAINING_COMMAND_HEADING in text:  # re-save: replace the old section
        text = text[: text.index(TRAINING_COMMAND_HEADING)].rstrip() + "\n"
    section = training_command_section(command, recipe_text, description)
    return text.rstrip() + "\n\n" + section


def attach_model_card(
    trainer, method: str, command: str, recipe_text: str | None = None, description: str | None = None
):
    """Make every `trainer.create_model_card(...)` call add tags, citation and training command (see module doc)."""
    tags_for_method = method_tags(method)
    original = trainer.create_model_card

    def create_model_card(model_name=None, dataset_name=None, tags=None, **kwargs):
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        tags += [t for t in tags_for_method if t not in tags]
        result = original(model_name=model_name, dataset_name=dataset_name, tags=tags, **kwargs)
        path = os.path.join(trainer.args.output_dir, "README.md")
        if trainer.is_world_process_zero() and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                text = f.read()
            with open(path, "w", encoding="utf-8") as f:
                f.write(decorate_card_text(text, method, command, recipe_text, description))
        return result

    trainer.create_model_card = create_model_card
    # The model's own tags (used by `model.push_to_hub` and kept in the saved config's metadata).
    if hasattr(trainer.model, "add_model_tags"):
        trainer.model.add_model_tags(tags_for_method)
    return trainer
