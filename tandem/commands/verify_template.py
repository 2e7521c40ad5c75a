"""``tandem verify-template MODEL_OR_TEMPLATE``: check that a chat template is prefix-stable (TITO).

Renders random conversations (system, user, assistant text with reasoning blocks and tool calls, tool
results, several turns) and checks that the render of every prefix is a prefix of the full render, as
text and as token ids, and that the generation prompt is followed by the assistant's text verbatim.
Prints the first divergence of each check with the template construct behind it; exit code 1 if any.
See tandem/rollout/template_check.py.
"""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="MODEL_OR_TEMPLATE",
                   help="a registry model name or HF folder (its tokenizer's template), or a .jinja template file")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for a template file's token checks (default: tiny-llama's ChatML tokenizer)")
    p.add_argument("--num-conversations", type=int, default=200, help="random conversations (default 200)")
    p.add_argument("--max-turns", type=int, default=4, help="assistant turns per conversation (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tools", action="store_true", help="no tools or tool calls in the conversations")
    p.add_argument("--no-reasoning", action="store_true", help="no <think> blocks in assistant texts")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tandem.config import ConfigError
    from tandem.models import load_tokenizer
    from tandem.rollout.chat import ChatTemplate
    from tandem.rollout.template_check import VerifyConfig, verify_template

    try:
        cfg = VerifyConfig(num_conversations=args.num_conversations, max_turns=args.max_turns, seed=args.seed,
                           tools=not args.no_tools, reasoning=not args.no_reasoning)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    path = Path(args.target)
    if path.is_file():
        tokenizer_name = args.tokenizer or "tiny-llama"
        template = ChatTemplate(load_tokenizer(tokenizer_name), chat_template=path.read_text())
        what = f"{path} (tokenizer {tokenizer_name})"
    else:
        template = ChatTemplate(load_tokenizer(args.target))
        what = args.target
    mode = "tools in the system message" if not template.native_tools else "native tools section"
    report = verify_template(template, cfg)
    print(f"{what} ({mode}): {report.format()}")
    return 0 if report.ok else 1
