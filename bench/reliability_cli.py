"""`bench/reliability.py`, group 1: bad CLI inputs."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.reliability_common import (
    EVEN,
    RECIPE,
    SEPARATE,
    Context,
    Outcome,
    Proc,
    error_lines,
    tail,
    tandem,
    traceback_summary,
)

# -- group 1: bad CLI inputs ------------------------------------------------------------------------------------


@dataclass
class CliCase:
    name: str
    args: list[str]  # after `tandem`; @R / @SEP the tiny recipes, @BASE the base run, @W the working directory
    names: list[str]  # substrings the one error line must contain (the bad value, the key)
    codes: tuple[int, ...] = (2,)
    setup: Callable[[Path], None] | None = None
    quick: bool = False
    timeout: float = 90

    @property
    def needs_base(self) -> bool:
        return any("@BASE" in a for a in self.args) or self.name in _BASE_SETUPS


_BASE_SETUPS: set[str] = set()


def _write(name: str, text: str) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)

    return setup


def _user_folder(work: Path) -> None:
    (work / "mine").mkdir()
    (work / "mine" / "notes.txt").write_text("keep me")


BAD_METRICS = "\n".join(["garbage", '{"step": "x"}', "[1, 2, 3]", '{"step": 2, "time": 10']) + "\n"
RECIPE_TEXT = RECIPE.read_text()


def cli_cases() -> list[CliCase]:
    c = CliCase
    return [
        # -- overrides: unknown keys, wrong types, values out of range (`tandem config` validates as `train`)
        c("unknown top-level section", ["config", "@R", "trainning.steps=3"], ["trainning"], quick=True),
        c("unknown nested key (typo)", ["config", "@R", "rollout.sampling.temprature=0.7"], ["temprature"]),
        c("override without '='", ["config", "@R", "run.steps"], ["run.steps"]),
        c("override with an empty key", ["config", "@R", "=3"], ["=3"]),
        c("integer key given a word", ["config", "@R", "run.steps=abc"], ["run.steps", "abc"], quick=True),
        c("run.steps=0", ["config", "@R", "run.steps=0"], ["steps", "0"]),
        c("run.steps negative", ["config", "@R", "run.steps=-3"], ["steps", "-3"]),
        c("float for an integer (1e9 is a string in YAML 1.1)", ["config", "@R", "rollout.sampling.max_new_tokens=1e9"],
          ["max_new_tokens", "1e9"]),
        c("float for an integer (1.0e+9)", ["config", "@R", "rollout.sampling.max_new_tokens=1.0e+9"],
          ["max_new_tokens", "1000000000.0"]),
        c("max_new_tokens above the limit", ["config", "@R", "rollout.sampling.max_new_tokens=1000000000"],
          ["max_new_tokens=1000000000", "limit"]),
        c("temperature NaN", ["config", "@R", "rollout.sampling.temperature=.nan"], ["temperature=nan", "finite"],
          quick=True),
        c("temperature Infinity", ["config", "@R", "rollout.sampling.temperature=.inf"], ["temperature=inf"]),
        c("temperature negative", ["config", "@R", "rollout.sampling.temperature=-1"], ["temperature", "-1"]),
        c("top_p above 1", ["config", "@R", "rollout.sampling.top_p=1.5"], ["top_p", "1.5"]),
        c("top_k negative", ["config", "@R", "rollout.sampling.top_k=-1"], ["top_k=-1", ">= 0"]),
        c("prompts_per_step=0", ["config", "@R", "rollout.prompts_per_step=0"], ["prompts_per_step", "0"]),
        c("n_samples_per_prompt=0", ["config", "@R", "rollout.n_samples_per_prompt=0"], ["n_samples_per_prompt", "0"]),
        c("learning rate negative", ["config", "@R", "trainer.fsdp.optimizer.lr=-0.001"], ["lr", "-0.001"]),
        c("clip_eps_low negative", ["config", "@R", "algorithm.policy_loss.clip_eps_low=-0.1"], ["clip_eps_low", "-0.1"]),
        c("max_staleness negative", ["config", "@R", "runtime.max_staleness=-1"], ["max_staleness", "-1"]),
        c("watchdog_s negative", ["config", "@R", "runtime.watchdog_s=-5"], ["watchdog_s", "-5"]),
        c("reward.timeout_s=0", ["config", "@R", "reward.timeout_s=0"], ["timeout_s", "0"]),
        c("max_prompt_tokens=0", ["config", "@R", "data.max_prompt_tokens=0"], ["max_prompt_tokens", "0"]),
        c("a list where a number goes", ["config", "@R", "run.seed=[1, 2]"], ["run.seed"]),
        c("a mapping where a list goes", ["config", "@R", "reward.terms={name: number}"], ["reward.terms"]),
        # -- choices
        c("loop mode not a choice", ["config", "@R", "runtime.mode=turbo"], ["turbo"]),
        c("placement not a choice", ["config", "@R", "runtime.placement=cloud"], ["cloud"]),
        c("reward.isolation not a choice", ["config", "@R", "reward.isolation=fork"], ["fork"]),
        c("unknown training engine", ["config", "@R", "trainer.engine=deepspeed"], ["deepspeed"]),
        c("unknown inference engine", ["config", "@R", "inference.engine=sglang-ish"], ["sglang-ish"]),
        c("unknown advantage estimator", ["config", "@R", "algorithm.advantage.estimator=grpoo"], ["grpoo"]),
        c("unknown built-in reward", ["config", "@R", "reward.terms=[{name: numbr}]"], ["numbr"]),
        # import paths and engine pairs are checked when `tandem train` starts (`tandem config` does not import them)
        c("train: reward module that does not exist", ["train", "@R", "reward.terms=[{name: 'no_such_pkg.rewards:judge'}]",
                                                       "--run-dir", "run"], ["no_such_pkg"]),
        c("train: reward function that does not exist", ["train", "@R", "reward.terms=[{name: 'tests.runtime.rewards:nope'}]",
                                                         "--run-dir", "run"], ["nope"]),
        c("train: reward with the wrong signature", ["train", "@R", "reward.terms=[{name: 'tests.runtime.rewards:pg_loss'}]",
                                                     "--run-dir", "run"], ["pg_loss"]),
        c("train: generate function that does not exist", ["train", "@R", "rollout.generate=multi_turnn", "--run-dir", "run"],
          ["multi_turnn"]),
        c("train: transport that does not fit the placement", ["train", "@SEP", "sync.transport=inprocess", "--run-dir", "run"],
          ["sync.transport", "inprocess", "separate"]),
        c("train: gae with the megatron trainer", ["train", "@R", "algorithm.advantage.estimator=gae", "trainer.engine=megatron",
                                                   "--run-dir", "run"], ["gae", "megatron"]),
        # -- duplicate keys, broken recipes
        c("duplicate key inside an override", ["config", "@R", "reward.terms=[{name: number, name: format}]"],
          ["duplicate key", "[0].name"]),
        c("broken YAML inside an override", ["config", "@R", "reward.terms=[{name: number"], ["reward.terms"]),
        c("duplicate key in a recipe", ["config", "r.yaml"], ["duplicate key 'run.seed'", "line 4"],
          setup=_write("r.yaml", "run:\n  seed: 1\n  name: a\n  seed: 2\n"), quick=True),
        c("second top-level section in a recipe", ["config", "r.yaml"], ["duplicate key 'run'"],
          setup=_write("r.yaml", RECIPE_TEXT + "run:\n  seed: 5\n")),
        c("recipe file missing", ["config", "missing.yaml"], ["missing.yaml"], quick=True),
        c("recipe is broken YAML", ["config", "r.yaml"], ["r.yaml"], setup=_write("r.yaml", "run: [1, 2\nmodel: x\n")),
        c("recipe is a YAML list", ["config", "r.yaml"], ["r.yaml"], setup=_write("r.yaml", "- a\n- b\n")),
        c("recipe is a folder", ["config", "."], ["."]),
        c("unknown key in a recipe file", ["config", "r.yaml"], ["stepz"],
          setup=_write("r.yaml", RECIPE_TEXT.replace("  steps: 3", "  stepz: 3"))),
        # -- start-up refusals of `tandem train`
        c("train: data file not found", ["train", "@R", "data.source=missing.jsonl", "--run-dir", "run"],
          ["data.source", "missing.jsonl"]),
        c("train: HF dataset folder not found", ["train", "@R", "data.source=hf:missing_dataset", "--run-dir", "run"],
          ["data.source", "missing_dataset"]),
        c("train: unknown model", ["train", "@R", "model.name=no-such-model", "--run-dir", "run"], ["no-such-model"]),
        c("train: exact contract on a bounded pair", ["train", "@R", "run.steps=1", "algorithm.contract.expect=exact",
                                                      "--run-dir", "run"], ["expect=exact", "needs"]),
        c("train: routing_replay on a dense model", ["train", "@R", "run.steps=1", "trainer.fsdp.routing_replay=true",
                                                     "--run-dir", "run"], ["routing_replay", "dense"]),
        c("train: no recipe", ["train"], ["recipe"]),
        c("train: an override after an option", ["train", "@R", "--quiet", "run.steps=0"], ["run.steps=0"],
          quick=True),  # also keeps a component's check named by its dotted key in the suite's subset
        c("train: --debug-train-only on a missing dump", ["train", "@R", "--debug-train-only", "nodump", "--run-dir", "run"],
          ["nodump"]),
        c("train: --resume a missing folder", ["train", "@R", "--resume", "nope"], ["--resume", "nope"]),
        c("train: --resume a folder that is not a run", ["train", "@R", "--resume", "."], ["--resume"]),
        c("train: --resume a trainer checkpoint", ["train", "@R", EVEN, "run.steps=3", "--resume",
                                                   "@BASE/checkpoints/step_2/trainer"], ["--resume", "trainer checkpoint"]),
        c("train: --resume a missing step", ["train", "@R", EVEN, "run.steps=3", "--resume", "@BASE/checkpoints/step_9"],
          ["--resume", "step_9"]),
        c("train: --resume past run.steps", ["train", "@R", EVEN, "run.steps=2", "--resume", "@BASE"],
          ["--resume", "is at step 2 and run.steps=2"]),
        c("train: onto a previous run without --overwrite", ["train", "@R", EVEN, "--run-dir", "@W/copy"], ["copy"],
          setup=lambda w: None),  # the copy is made by the runner (needs the base run)
        # -- tandem export
        c("export onto the working directory (--force)", ["export", "@BASE", ".", "--force"], ["current directory"]),
        c("export onto a parent of it (--force)", ["export", "@BASE", "..", "--force"], ["current directory"]),
        c("export onto the checkpoint (--force)", ["export", "@BASE", "@BASE", "--force"], ["holds the checkpoint"]),
        c("export onto a file (--force)", ["export", "@BASE", "file.txt", "--force"], ["file.txt", "is a file"],
          setup=_write("file.txt", "x")),
        c("export onto a user's folder", ["export", "@BASE", "mine"], ["refusing to replace", "mine", "--force"],
          setup=_user_folder),
        c("export a missing target", ["export", "nope", "out"], ["nope"]),
        c("export a model, not a checkpoint", ["export", "tiny-llama", "out"], ["tiny-llama", "not a checkpoint"]),
        c("export with a bad --dtype", ["export", "@BASE", "out", "--dtype", "float64"], ["--dtype", "float64"]),
        # -- tandem serve (refused before it serves)
        c("serve: --port not a number", ["serve", "tiny-llama", "--port", "http"], ["--port", "http"]),
        c("serve: public host without a key", ["serve", "tiny-llama", "--host", "0.0.0.0"], ["--host 0.0.0.0", "--api-key"]),
        c("serve: --max-model-len above the context", ["serve", "tiny-llama", "--max-model-len", "100000"],
          ["--max-model-len 100000", "max_position_embeddings"]),
        c("serve: --max-model-len 1", ["serve", "tiny-llama", "--max-model-len", "1"], ["--max-model-len 1"]),
        c("serve: unknown model", ["serve", "no-such-model"], ["no-such-model"]),
        c("serve: overrides without a recipe", ["serve", "tiny-llama", "run.seed=1"], ["run.seed=1", "recipe"]),
        c("serve: --engine with a recipe", ["serve", "@R", "--engine", "torch"], ["--engine", "recipe"]),
        c("serve: --chat-template missing", ["serve", "tiny-llama", "--chat-template", "nope.jinja"], ["nope.jinja"]),
        c("serve: --max-sessions 0", ["serve", "tiny-llama", "--max-sessions", "0"], ["max_sessions", "0"]),
        c("serve: --max-request-bytes 10", ["serve", "tiny-llama", "--max-request-bytes", "10"],
          ["max_request_bytes", "10"]),
        c("serve: unknown engine", ["serve", "tiny-llama", "--engine", "nope"], ["nope"]),
        # -- tandem report / eval / models / verify-template
        c("report: only bad metrics lines", ["report", "run"], ["has no valid line", "bad lines: 1, 2, 3, 4"],
          setup=_write("run/metrics.jsonl", BAD_METRICS)),
        c("report: a folder without metrics.jsonl", ["report", "."], ["metrics.jsonl"]),
        c("report: a missing folder", ["report", "nope"], ["nope"]),
        c("eval: a missing target", ["eval", "nope", "--recipe", "@R"], ["nope"]),
        c("eval: a recipe without eval sets", ["eval", "@BASE", "--recipe", "@R"], ["no eval sets"]),
        c("eval: an unknown --sets name", ["eval", "tiny-llama", "--recipe", "@R", "--sets", "nope"], ["nope"]),
        c("eval: without --recipe", ["eval", "tiny-llama"], ["--recipe"]),
        c("eval: a bad override", ["eval", "tiny-llama", "eval.every=-1", "--recipe", "@R"], ["every=-1", ">= 0"]),
        c("eval: an override after --recipe", ["eval", "tiny-llama", "--recipe", "@R", "eval.every=-1"], ["eval.every=-1"]),
        c("models prepare without a name", ["models", "prepare"], ["prepare", "name"]),
        c("models prepare an unknown model", ["models", "prepare", "no-such-model"], ["no-such-model"]),
        c("verify-template: a missing target", ["verify-template", "nope.jinja"], ["nope.jinja"]),
        c("verify-template: --num-conversations 0", ["verify-template", "tiny-llama", "--num-conversations", "0"],
          ["num_conversations", "0"]),
        c("unknown command", ["trian", "@R"], ["trian"]),
    ]


def _cli_args(case: CliCase, ctx: Context, work: Path) -> list[str]:
    subs = {"@R": str(RECIPE), "@SEP": str(SEPARATE), "@W": str(work)}
    if case.needs_base:
        subs["@BASE"] = str(ctx.base)
    out = []
    for a in case.args:
        for k, v in subs.items():
            a = a.replace(k, v)
        out.append(a)
    return out


def classify_cli(p: Proc, codes: tuple[int, ...], names: list[str]) -> tuple[str, str]:
    """(outcome, why) of one bad input."""
    text = f"exit {p.rc}; stderr: {tail(p.err)}" + (f"; stdout: {tail(p.out, 300)}" if p.out.strip() else "")
    if p.rc is None:
        return "hang", text
    if "Traceback (most recent call last)" in p.err + p.out:
        return "traceback", f"exit {p.rc}; {traceback_summary(p.err + p.out)}"
    if p.rc == 0:
        return "silent", text
    lines = error_lines(p.err)
    if p.rc not in codes:
        return "other", f"exit {p.rc}, expected {codes}; " + text
    if not lines:
        where = "on stdout, not stderr" if error_lines(p.out) else "no 'tandem: error:' line"
        return "other", f"{where}; " + text
    if len(lines) > 1:
        return "other", f"{len(lines)} error lines; " + text
    missing = [n for n in names if n not in lines[0]]
    if missing:
        return "other", f"the error line does not name {missing}; " + text
    return "clear", lines[0]


def run_cli(ctx: Context, quick: bool, only: re.Pattern | None = None) -> list[Outcome]:
    cases = [c for c in cli_cases() if (c.quick or not quick) and (only is None or only.search(c.name))]
    results = []
    for i, case in enumerate(cases, 1):
        work = ctx.workdir(case.name)
        if case.setup:
            case.setup(work)
        if case.name == "train: onto a previous run without --overwrite":
            ctx.copy_base(work / "copy")
        args = _cli_args(case, ctx, work)
        p = tandem(args, work, timeout=case.timeout)
        outcome, why = classify_cli(p, case.codes, case.names)
        if case.name == "export onto a user's folder" and (work / "mine" / "notes.txt").read_text() != "keep me":
            outcome, why = "other", "the user's file changed: " + why
        cmd = ctx.display("tandem " + " ".join(_quote(a) for a in args))
        results.append(Outcome("cli", case.name, cmd, outcome, p.seconds, ctx.display(why)))
        _progress("cli", i, len(cases), case.name, outcome, p.seconds, ctx.display(why))
    return results


def _quote(arg: str) -> str:
    return f'"{arg}"' if re.search(r"[\s\[\]{}'*]", arg) or not arg else arg


def _progress(group: str, i: int, n: int, name: str, outcome: str, seconds: float, detail: str = "") -> None:
    detail = " ".join(detail.split())
    detail = f": {detail[:200]}{'...' if len(detail) > 200 else ''}" if detail else ""
    print(f"[{group} {i}/{n}] {name}: {outcome} ({seconds:.1f}s){detail}", file=sys.stderr, flush=True)
