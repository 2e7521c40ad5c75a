"""Prompt data: formats, seeded resumable order, and the bad-record policy."""

from __future__ import annotations

import json
import logging

import pytest

from tandem.config import ConfigError, from_dict
from tandem.models import load_tokenizer
from tandem.rollout.data import DataConfig, DataError, DataSource
from tandem.rollout.tasks import ArithmeticTaskConfig, arithmetic_records


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-llama")


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_arithmetic_task_is_seeded_and_exact():
    cfg = ArithmeticTaskConfig(num_examples=50, min_value=2, max_value=20, ops=["+", "-", "*"], seed=3)
    a, b = arithmetic_records(cfg), arithmetic_records(cfg)
    assert a == b and len(a) == 50
    for r in a:
        x, op, y = r["prompt"].split("?")[0].removeprefix("What is ").split()
        assert eval(f"{x}{op}{y}") == r["label"] and r["label"] >= 0  # noqa: S307 - our own digits
    words = arithmetic_records(ArithmeticTaskConfig(num_examples=5, style="word"))
    assert all("How many" in r["prompt"] for r in words)


def test_jsonl_malformed_lines_are_reported_and_skipped(tmp_path, tok, caplog):
    p = _write(
        tmp_path / "d.jsonl",
        ['{"prompt": "a", "label": 1}', "{not json", "[1, 2]", '{"prompt": "b", "label": 2}'],
    )
    with caplog.at_level(logging.WARNING):
        src = DataSource(DataConfig(source=str(p), shuffle=False), tok)
    assert [r.label for r in src.records] == [1, 2]
    assert src.stats["bad_lines"] == 2
    assert "d.jsonl:2: skipping malformed JSONL line" in caplog.text
    with pytest.raises(DataError, match=r"d.jsonl:2: malformed JSONL line"):
        DataSource(DataConfig(source=str(p), bad_line="fail"), tok)


def test_empty_and_overlong_prompts(tmp_path, tok):
    long = "word " * 400
    p = _write(
        tmp_path / "d.jsonl",
        [json.dumps({"prompt": x, "label": i}) for i, x in enumerate(["", "  ", "ok", long])],
    )
    src = DataSource(DataConfig(source=str(p), max_prompt_tokens=128), tok)
    assert src.stats["empty_prompts"] == 2 and src.stats["overlong_dropped"] == 1 and len(src.records) == 1
    src = DataSource(DataConfig(source=str(p), max_prompt_tokens=128, overlong_prompt="truncate"), tok)
    kept = [r for r in src.records if r.label == 3][0]
    assert len(kept.prompt_token_ids) == 128 and src.stats["overlong_truncated"] == 1
    # truncation keeps the end, which holds the generation prompt
    gen_prompt = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert kept.prompt_token_ids[-len(gen_prompt) :] == gen_prompt


def test_chat_template_and_system_prompt(tok):
    src = DataSource(
        DataConfig(system_prompt="Be brief.", arithmetic=ArithmeticTaskConfig(num_examples=3)), tok
    )
    text = tok.decode(src.records[0].prompt_token_ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is")
    assert text.endswith("<|im_start|>assistant\n")


def test_order_is_seeded_epochs_reshuffle_and_resume_continues(tok):
    cfg = DataConfig(arithmetic=ArithmeticTaskConfig(num_examples=10), seed=5)
    a = DataSource(cfg, tok)
    first = [r.index for r in a.next_prompts(7)]
    state = a.state_dict()
    rest = [r.index for r in a.next_prompts(8)]  # crosses into epoch 1
    assert sorted(first + rest[:3]) == list(range(10))
    assert a.epoch == 1
    b = DataSource(cfg, tok)
    b.load_state_dict(state)
    assert [r.index for r in b.next_prompts(8)] == rest
    assert [r.index for r in DataSource(cfg, tok).next_prompts(7)] == first


def test_missing_file_and_bad_config(tok):
    with pytest.raises(DataError, match="data file not found: nope.jsonl"):
        DataSource(DataConfig(source="nope.jsonl"), tok)
    with pytest.raises(ConfigError, match="unknown synthetic task 'synthetic:chess'"):
        from_dict(DataConfig, {"source": "synthetic:chess"})
    with pytest.raises(ConfigError, match="overlong_prompt: 'cut' is not a valid choice"):
        from_dict(DataConfig, {"overlong_prompt": "cut"})


def test_parquet_and_hf_datasets_sources(tmp_path, tok):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    rows = [{"question": f"What is {i} + 1?", "answer": i + 1, "level": i % 3} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    cfg = dict(prompt_key="question", label_key="answer", metadata_keys=["level"], shuffle=False)
    src = DataSource(DataConfig(source=str(tmp_path / "d.parquet"), **cfg), tok)
    assert [r.label for r in src.records] == [1, 2, 3, 4, 5, 6] and src.records[4].metadata == {"level": 1}
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "hf"))
    hf = DataSource(DataConfig(source=f"hf:{tmp_path / 'hf'}", **cfg), tok)
    assert [r.prompt_token_ids for r in hf.records] == [r.prompt_token_ids for r in src.records]
    with pytest.raises(DataError, match="no split 'test'"):
        DataSource(DataConfig(source=f"hf:{tmp_path / 'hf'}", split="test", **cfg), tok)
    with pytest.raises(DataError, match="record 0 has no prompt key 'prompt'"):
        DataSource(DataConfig(source=str(tmp_path / "d.parquet")), tok)
