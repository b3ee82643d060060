"""Reasoning Gym + GSM8K data and rewards (trl_isopo.gym): exact scores on hand-made answers, offline."""

import json
import os

import pytest

pytest.importorskip("reasoning_gym")

from trl_isopo.gym import (  # noqa: E402
    ReasoningGymAnswerReward,
    build_reasoning_gym_dataset,
    completion_text,
    format_reward,
    gsm8k_answer_reward,
    load_gsm8k,
    make_procedural_dataset,
    parse_number,
)
from trl_isopo.gym.gsm8k import extract_answer_block, extract_gsm8k_gold  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "gsm8k_tiny.jsonl")


def _kk_answer(entry, flip=()):
    """A knights_knaves answer in the task's own format, with the people in `flip` given the wrong role."""
    md = entry["metadata"]
    terms = md["knight_knave_terms"]
    parts = []
    for i, (name, is_knight) in enumerate(zip(md["names"], md["solution"], strict=True)):
        is_knight = (not is_knight) if i in flip else is_knight
        parts.append(f"{name} is {terms['a_knight'] if is_knight else terms['a_knave']}")
    return ", and ".join(parts) + "."


def _wrap(text):
    return f"Let me think. <answer>{text}</answer>"


# ------------------------------------------------------------------------------------------------- graph_color
def test_graph_color_scores_gold_wrong_and_malformed_after_round_trip():
    proc = make_procedural_dataset("graph_color", size=4, seed=1)
    data = build_reasoning_gym_dataset(proc)
    reward = ReasoningGymAnswerReward(proc)
    row = data[0]
    entry = json.loads(row["entry"])  # what the reward sees: the JSON column, not the live entry
    assert entry == json.loads(json.dumps(proc[0], default=str))
    puzzle = entry["metadata"]["puzzle"]
    assert len(puzzle["edges"]) > 0  # so that "all one colour" is a wrong colouring
    gold = json.dumps(entry["metadata"]["possible_answer"])
    all_one = json.dumps({str(v): puzzle["color_options"][0] for v in puzzle["vertices"]})
    completions = [
        _wrap(gold),  # a valid colouring
        _wrap(all_one),  # parses as JSON, violates an edge
        gold,  # no <answer> block -> extract_answer gives None
        _wrap("vertex 0 gets red"),  # not JSON
        _wrap(all_one) + " and finally " + _wrap(gold),  # the last block counts
    ]
    scores = reward(completions, entry=[row["entry"]] * len(completions))
    assert scores == [1.0, 0.01, 0.0, 0.0, 1.0]
    # identical to the task's own score_answer on the live (non-JSON) entry
    from reasoning_gym.utils import extract_answer

    assert scores == [proc.score_answer(extract_answer(c), proc[0]) for c in completions]


# ---------------------------------------------------------------------------------------------- knights_knaves
def test_knights_knaves_full_partial_and_zero_credit():
    proc = make_procedural_dataset("knights_knaves", size=3, seed=5, task_config={"n_people": 3})
    data = build_reasoning_gym_dataset(proc)
    reward = ReasoningGymAnswerReward(proc)
    row = data[0]
    entry = json.loads(row["entry"])
    assert len(entry["metadata"]["names"]) == 3
    first_name = entry["metadata"]["names"][0]
    completions = [
        _wrap(entry["answer"]),  # gold
        _wrap(_kk_answer(entry)),  # gold, rebuilt from metadata
        _wrap(_kk_answer(entry, flip={0})),  # 2 of 3 right -> 0.3 + 0.7 * 2/3
        _wrap(_kk_answer(entry, flip={0, 1})),  # 1 of 3 right -> 0.3 + 0.7 * 1/3
        _wrap(_kk_answer(entry, flip={0, 1, 2})),  # none right -> 0
        _wrap(f"{first_name} is {entry['metadata']['knight_knave_terms']['a_knight']}"),  # a name missing -> 0
        entry["answer"],  # no <answer> block -> 0
    ]
    scores = reward(completions, entry=[row["entry"]] * len(completions))
    assert scores[:2] == [1.0, 1.0]
    assert scores[2] == pytest.approx(0.3 + 0.7 * 2 / 3, abs=1e-12)
    assert scores[3] == pytest.approx(0.3 + 0.7 * 1 / 3, abs=1e-12)
    assert scores[4:] == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------------- composite
def test_composite_dispatches_to_each_task():
    spec = {"datasets": [{"name": "graph_color", "weight": 1.0}, {"name": "knights_knaves", "weight": 1.0}]}
    proc = make_procedural_dataset("composite", size=12, seed=3, task_config=spec)
    data = build_reasoning_gym_dataset(proc)
    assert set(data["task"]) == {"graph_color", "knights_knaves"}
    gc = next(i for i, t in enumerate(data["task"]) if t == "graph_color")
    kk = next(i for i, t in enumerate(data["task"]) if t == "knights_knaves")
    gc_entry, kk_entry = json.loads(data[gc]["entry"]), json.loads(data[kk]["entry"])
    gc_gold = _wrap(json.dumps(gc_entry["metadata"]["possible_answer"]))
    kk_gold = _wrap(kk_entry["answer"])
    for reward in (ReasoningGymAnswerReward(proc), ReasoningGymAnswerReward(None)):  # None: default-config scorers
        entries = [data[gc]["entry"], data[gc]["entry"], data[kk]["entry"], data[kk]["entry"]]
        # each row is scored by its own task: the other task's gold answer is worth nothing
        assert reward([gc_gold, kk_gold, kk_gold, gc_gold], entry=entries) == [1.0, 0.0, 1.0, 0.0]
    # the composite's score_answer agrees on the decoded entries
    assert proc.score_answer(extract_answer_block(gc_gold), gc_entry) == 1.0
    assert proc.score_answer(extract_answer_block(kk_gold), kk_entry) == 1.0


def test_composite_mapping_form_and_errors():
    proc = make_procedural_dataset(
        "composite", size=4, seed=0, task_config={"datasets": {"graph_color": {"config": {"num_colors": 4}}}}
    )
    assert proc.datasets["graph_color"].config.num_colors == 4
    with pytest.raises(ValueError, match="needs task_config"):
        make_procedural_dataset("composite", size=4, seed=0)
    with pytest.raises(ValueError, match="unknown keys"):
        make_procedural_dataset(
            "composite", size=4, seed=0, task_config={"datasets": [{"name": "graph_color", "w": 1}]}
        )


# ----------------------------------------------------------------------------------------------- dataset builder
def test_builder_is_deterministic_and_seeded():
    a = build_reasoning_gym_dataset("graph_color", size=3, seed=7)
    b = build_reasoning_gym_dataset("graph_color", size=3, seed=7)
    c = build_reasoning_gym_dataset("graph_color", size=3, seed=8)
    assert a["entry"] == b["entry"]
    assert list(a["entry"]) != list(c["entry"])
    # Reasoning Gym generates item i from seed + i: seed 8 item 0 is seed 7 item 1 (why eval seeds default far away)
    assert json.loads(c[0]["entry"])["question"] == json.loads(a[1]["entry"])["question"]
    assert json.loads(c[0]["entry"])["question"] != json.loads(a[0]["entry"])["question"]
    assert a.column_names == ["prompt", "entry", "task"]


def test_difficulty_config_is_applied_and_bad_config_is_explained():
    data = build_reasoning_gym_dataset(
        "graph_color", size=2, seed=0, task_config={"min_num_vertices": 6, "max_num_vertices": 6}
    )
    assert json.loads(data[0]["entry"])["metadata"]["puzzle"]["vertices"] == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="Valid config fields: .*num_colors"):
        make_procedural_dataset("graph_color", size=2, seed=0, task_config={"colours": 3})
    with pytest.raises(ValueError, match="Did you mean .*graph_color"):
        make_procedural_dataset("graph_colour", size=2, seed=0)
    with pytest.raises(ValueError, match="dataset_seed"):
        make_procedural_dataset("graph_color", size=2, seed=0, task_config={"seed": 3})


def test_prompts_conversational_and_chat_templated(tiny_tokenizer):
    from reasoning_gym.utils import SYSTEM_PROMPTS

    conv = build_reasoning_gym_dataset("knights_knaves", size=1, seed=0)
    question = json.loads(conv[0]["entry"])["question"]
    assert conv[0]["prompt"] == [
        {"role": "system", "content": SYSTEM_PROMPTS["default"]},
        {"role": "user", "content": question},
    ]
    text = build_reasoning_gym_dataset(
        "knights_knaves", size=1, seed=0, tokenizer=tiny_tokenizer, system_prompt="none"
    )
    # the tiny chat template is "<role> : <content> " per message, then "assistant : "
    assert text[0]["prompt"] == f"user : {question} assistant : "


# ------------------------------------------------------------------------------------------------------- format
def test_format_reward_exact_cases():
    completions = [
        "<answer>42</answer>",
        "<think>a b</think>\n<answer>42</answer>\n",
        "I reason here.\n<answer> 42 </answer>",
        "<answer>42</answer> trailing words",
        "<answer>1</answer><answer>2</answer>",
        "<answer>   </answer>",
        "no tags at all",
        "<answer>42",
        [{"role": "assistant", "content": "<answer>x</answer>"}],
    ]
    assert format_reward(completions) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "hi"}]}]) == "hi"


# -------------------------------------------------------------------------------------------------------- GSM8K
def test_gsm8k_fixture_loads_with_gold_numbers():
    data = load_gsm8k(FIXTURE, system_prompt="none")
    assert len(data) == 6
    assert list(data["answer"]) == ["12", "1500", "13", "2.25", "-3", "105"]
    assert data[0]["prompt"] == [
        {"role": "user", "content": "Mia has 3 boxes with 4 pencils in each box. How many pencils does she have?"}
    ]
    assert data[1]["solution"].endswith("#### 1,500")
    assert len(load_gsm8k(FIXTURE, size=2)) == 2
    with pytest.raises(ValueError, match="size=7 but"):
        load_gsm8k(FIXTURE, size=7)


def test_gsm8k_reward_exact_numeric_match():
    gold = ["12", "1500", "13", "2.25", "-3", "105"]
    completions = [
        "<answer>12</answer>",
        "<answer>$1,500</answer>",
        "13",  # no <answer> block
        "<answer>2.250</answer>",
        "<answer>3</answer>",  # sign matters
        "<answer>104</answer> no wait <answer>105.</answer>",  # the last block counts, trailing period ok
    ]
    assert gsm8k_answer_reward(completions, answer=gold) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert gsm8k_answer_reward(["<answer>12 pencils</answer>", "<answer>12.0</answer>"], answer=["12", "12"]) == [
        0.0,
        1.0,
    ]
    # the raw GSM8K solution text also works as the gold column
    assert gsm8k_answer_reward(["<answer>1500</answer>"], answer=["... rolls.\n#### 1,500"]) == [1.0]
    assert gsm8k_answer_reward([[{"role": "assistant", "content": "<answer>7</answer>"}]], answer=["7"]) == [1.0]


def test_gsm8k_helpers_and_errors(tmp_path):
    from reasoning_gym.utils import extract_answer

    for text in ["<answer> 5 </answer>", "x<answer>a</answer>y<answer>b\n</answer>", "none", "<answer>\n7\n</answer>"]:
        assert extract_answer_block(text) == extract_answer(text)
    assert parse_number(" $1,200. ") == parse_number("1200") and parse_number("1.2.3") is None
    assert extract_gsm8k_gold("so #### 72") == "72"
    with pytest.raises(ValueError, match="#### <number>"):
        extract_gsm8k_gold("no marker here")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"q": "x", "a": "#### 1"}) + "\n")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['answer', 'question'\]"):
        load_gsm8k(str(bad))
    disk = tmp_path / "disk"
    from datasets import DatasetDict, load_dataset

    DatasetDict({"train": load_dataset("json", data_files=FIXTURE, split="train")}).save_to_disk(str(disk))
    assert list(load_gsm8k(str(disk), split="train")["answer"]) == ["12", "1500", "13", "2.25", "-3", "105"]
