"""Prompt data: JSONL, Parquet, local HF `datasets`, or a shipped synthetic task.

Each record has a prompt (a string, or a list of chat messages), a label and optional metadata. The
source renders prompts through the tokenizer's chat template (once, at load), shuffles with a seed per
epoch, and hands out prompts in order; its position (epoch, offset) is saved with checkpoints so a
resumed run continues with exactly the prompts it would have seen. Prompts taken but not trained on
when a checkpoint was written (rollouts in flight in the asynchronous modes) are *requeued*: served
before the epoch order continues, and saved in the position too (``requeued``), so a resume drops none.

Bad records never stop a run silently: a malformed JSONL line is reported with its line number and
skipped (or fails the load, per ``bad_line``); empty prompts are dropped; prompts longer than
``max_prompt_tokens`` are dropped or truncated (``overlong_prompt``). All are counted in `stats`.
"""

from __future__ import annotations

import collections
import json
import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tandem.config import ConfigError
from tandem.rollout.tasks import ArithmeticTaskConfig, arithmetic_records

__all__ = ["DataConfig", "DataError", "DataSource", "PromptRecord"]

log = logging.getLogger(__name__)


class DataError(ConfigError):
    """A data problem that stops loading (missing file, no usable record, bad line with bad_line=fail).

    A `ConfigError` (so a ValueError): the CLI reports it in one line with exit code 2, like a bad key.
    """


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """The recipe's ``data:`` section. ``source`` is a .jsonl/.parquet path, ``hf:<local path>`` for a
    `datasets` folder saved with ``save_to_disk``, or ``synthetic:arithmetic``."""

    source: str = "synthetic:arithmetic"
    prompt_key: str = "prompt"
    label_key: str = "label"
    metadata_keys: list[str] = field(default_factory=list)
    split: str = "train"
    apply_chat_template: bool = True
    system_prompt: str | None = None
    max_prompt_tokens: int = 512
    overlong_prompt: Literal["drop", "truncate"] = "drop"
    bad_line: Literal["skip", "fail"] = "skip"
    shuffle: bool = True
    seed: int = 0
    arithmetic: ArithmeticTaskConfig = field(default_factory=ArithmeticTaskConfig)

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens={self.max_prompt_tokens} must be >= 1")
        if self.source.startswith("synthetic:") and self.source != "synthetic:arithmetic":
            raise ValueError(f"unknown synthetic task {self.source!r} (available: synthetic:arithmetic)")


@dataclass(kw_only=True, slots=True)
class PromptRecord:
    index: int  # position in the loaded dataset (stable across epochs)
    prompt: str | list[dict[str, Any]]
    prompt_token_ids: list[int]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)


def _read_jsonl(path: Path, bad_line: str, stats: dict[str, int]) -> list[dict[str, Any]]:
    rows = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
            except ValueError as e:
                if bad_line == "fail":
                    raise DataError(f"{path}:{lineno}: malformed JSONL line: {e}") from None
                log.warning("%s:%d: skipping malformed JSONL line: %s", path, lineno, e)
                stats["bad_lines"] += 1
                continue
            rows.append(row)
    return rows


def _load_rows(cfg: DataConfig, stats: dict[str, int]) -> list[dict[str, Any]]:
    src = cfg.source
    if src == "synthetic:arithmetic":
        return arithmetic_records(cfg.arithmetic)
    if src.startswith("hf:"):
        try:
            import datasets
        except ImportError:
            raise DataError(f"{src}: reading HF datasets needs `pip install tandem-rl[data]`") from None
        if not Path(src[3:]).is_dir():
            raise DataError(f"data.source: dataset folder not found: {src[3:]}")
        ds = datasets.load_from_disk(src[3:])
        if isinstance(ds, datasets.DatasetDict):
            if cfg.split not in ds:
                raise DataError(f"{src}: no split {cfg.split!r} (splits: {', '.join(ds)})")
            ds = ds[cfg.split]
        return [dict(r) for r in ds]
    path = Path(src)
    if not path.is_file():
        raise DataError(f"data.source: data file not found: {path}")
    if path.suffix == ".jsonl":
        return _read_jsonl(path, cfg.bad_line, stats)
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading Parquet needs `pip install tandem-rl[data]`") from None
        return pq.read_table(path).to_pylist()
    raise DataError(
        f"{path}: unsupported data format {path.suffix!r} (use .jsonl, .parquet, hf:, synthetic:)"
    )


class DataSource:
    """Seeded, resumable iteration over tokenized prompts."""

    def __init__(self, cfg: DataConfig, tokenizer: Any) -> None:
        self.cfg = cfg
        self.stats = {"bad_lines": 0, "empty_prompts": 0, "overlong_dropped": 0, "overlong_truncated": 0}
        self.records = self._prepare(_load_rows(cfg, self.stats), tokenizer)
        if not self.records:
            raise DataError(f"{cfg.source}: no usable prompt (stats: {self.stats})")
        self.epoch, self.offset = 0, 0
        self._order = self._epoch_order(0)
        self._position = {r.index: p for p, r in enumerate(self.records)}  # record index -> place in records
        self._requeued: collections.deque[int] = collections.deque()  # places served before the order

    def _render(self, prompt: Any, tokenizer: Any) -> list[int]:
        if not self.cfg.apply_chat_template:
            text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.cfg.system_prompt is not None and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.cfg.system_prompt}, *messages]
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def _prepare(self, rows: list[dict[str, Any]], tokenizer: Any) -> list[PromptRecord]:
        cfg, out = self.cfg, []
        for i, row in enumerate(rows):
            if cfg.prompt_key not in row:
                raise DataError(
                    f"{cfg.source}: record {i} has no prompt key {cfg.prompt_key!r} (keys: {sorted(row)})"
                )
            prompt = row[cfg.prompt_key]
            if not prompt or (isinstance(prompt, str) and not prompt.strip()):
                self.stats["empty_prompts"] += 1
                continue
            ids = self._render(prompt, tokenizer)
            if len(ids) > cfg.max_prompt_tokens:
                if cfg.overlong_prompt == "drop":
                    self.stats["overlong_dropped"] += 1
                    continue
                # keep the end: it holds the generation prompt the model must continue from
                ids = ids[-cfg.max_prompt_tokens :]
                self.stats["overlong_truncated"] += 1
            meta = {k: row[k] for k in cfg.metadata_keys if k in row}
            out.append(
                PromptRecord(
                    index=i, prompt=prompt, prompt_token_ids=ids, label=row.get(cfg.label_key), metadata=meta
                )
            )
        dropped = {k: v for k, v in self.stats.items() if v}
        if dropped:
            log.warning("%s: %d prompts kept; dropped/changed: %s", cfg.source, len(out), dropped)
        return out

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.cfg.shuffle:
            random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_prompts(self, n: int) -> list[PromptRecord]:
        """The next ``n`` prompts, crossing into a freshly shuffled epoch when one runs out."""
        out = []
        while self._requeued and len(out) < n:
            out.append(self.records[self._requeued.popleft()])
        while len(out) < n:
            if self.offset >= len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            out.append(self.records[self._order[self.offset]])
            self.offset += 1
        return out

    def positions(self, records: Iterable[PromptRecord]) -> list[int]:
        """The places of ``records`` in this source (what a checkpoint stores for a prompt)."""
        return [self._position[r.index] for r in records]

    def requeue(self, records: Iterable[PromptRecord]) -> None:
        """Serve ``records`` again, before the epoch order continues (in the order given)."""
        self._requeued.extend(self.positions(records))

    def state_dict(self, *, requeue: Iterable[PromptRecord] = ()) -> dict[str, Any]:
        """The position; ``requeue``: prompts taken but not used yet (rollouts in flight), which a source
        loaded from this state serves first."""
        state: dict[str, Any] = {"epoch": self.epoch, "offset": self.offset, "num_records": len(self.records)}
        requeued = [*self._requeued, *self.positions(requeue)]
        if requeued:
            state["requeued"] = requeued
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_records") != len(self.records):
            raise DataError(
                f"resume: the data has {len(self.records)} usable prompts, the checkpoint was taken with "
                f"{state.get('num_records')}; the data changed"
            )
        requeued = [int(p) for p in state.get("requeued", ())]
        bad = [p for p in requeued if not 0 <= p < len(self.records)]
        if bad:
            raise DataError(f"resume: requeued prompt place {bad[0]} is outside the {len(self.records)} prompts")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._epoch_order(self.epoch)
        self._requeued = collections.deque(requeued)
