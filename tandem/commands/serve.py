"""``tandem serve MODEL_OR_RECIPE [key=value ...]``: the session server in front of the embedded engine.

Serves OpenAI-compatible chat sessions with token-in-token-out bookkeeping (tandem/rollout/server.py)
on 127.0.0.1:8000 by default. A recipe gives the model and the engine settings (``inference.torch``)
and the agent's limits (``rollout.agent``); a model name or HF folder serves that model with defaults.
The engine runs in this process, driven by the server's event loop.
"""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="MODEL_OR_RECIPE", help="a registry model name, an HF folder or a YAML recipe")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. model.dtype=bfloat16")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $TANDEM_API_KEY, else no authentication)")
    p.add_argument("--max-sessions", type=int, default=1024)
    p.add_argument("--max-turns", type=int, default=64, help="model turns per session")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20)
    p.add_argument("--max-model-len", type=int, default=None, help="context per sequence (engine KV-cache slot)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences decoded together")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--chat-template", default=None, help="a .jinja file to use instead of the tokenizer's template")
    p.add_argument("--no-verify-tokens", action="store_true", help="skip the token-level drift check")


def _engine_config(args: argparse.Namespace):
    import dataclasses
    from pathlib import Path

    from tandem.config import ConfigError, load_config
    from tandem.engines.inference.torch import TorchEngineConfig
    from tandem.models import ModelConfig

    if Path(args.target).suffix in (".yaml", ".yml"):
        from tandem.runtime import builders
        from tandem.runtime.config import RunConfig

        cfg = load_config(RunConfig, args.target, args.overrides)
        ec, model_name, agent = builders.torch_engine_config(cfg), cfg.model.name, cfg.rollout.agent
    else:
        if args.overrides:
            raise ConfigError(f"overrides {args.overrides} need a recipe, not the model {args.target!r}")
        ec, model_name, agent = TorchEngineConfig(model=ModelConfig(name=args.target)), args.target, None
    changes = {k: v for k, v in (("max_model_len", args.max_model_len), ("max_num_seqs", args.max_num_seqs))
               if v is not None}
    if args.dtype:
        changes["model"] = dataclasses.replace(ec.model, dtype=args.dtype)
    try:
        return dataclasses.replace(ec, **changes), model_name, agent
    except ValueError as e:
        raise ConfigError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    import logging
    import os
    import sys
    from pathlib import Path

    from tandem.config import ConfigError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ec, model_name, agent = _engine_config(args)
    template_file = args.chat_template or (agent.chat_template if agent else None)
    from tandem.rollout.server import LOOPBACK, ServerConfig
    from tandem.rollout.session import SessionConfig

    api_key = args.api_key or os.environ.get("TANDEM_API_KEY") or None
    try:
        sessions = SessionConfig(max_sessions=args.max_sessions, max_turns=args.max_turns,
                                 verify_tokens=not args.no_verify_tokens,
                                 max_context_tokens=agent.max_context_tokens if agent else None)
        server_cfg = ServerConfig(host=args.host, port=args.port, api_key=api_key,
                                  max_request_bytes=args.max_request_bytes, model_name=model_name, sessions=sessions)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if template_file is not None and not Path(template_file).is_file():
        raise ConfigError(f"--chat-template {template_file!r} is not a file")
    if args.host not in LOOPBACK and api_key is None:
        print(f"tandem: warning: serving on {args.host} without --api-key: anyone who reaches it can use it",
              file=sys.stderr)

    from tandem.engines.inference.torch import TorchEngine
    from tandem.models import load_tokenizer
    from tandem.rollout.chat import ChatTemplate
    from tandem.rollout.server import create_app, serve_forever
    from tandem.rollout.session import SessionStore

    engine = TorchEngine(ec)
    template = ChatTemplate(load_tokenizer(ec.model.name),
                            chat_template=Path(template_file).read_text() if template_file else None)
    app = create_app(SessionStore(engine, template, sessions), server_cfg)
    print(f"tandem serve: {model_name} on http://{args.host}:{args.port} "
          f"(POST /sessions, then OpenAI base_url http://{args.host}:{args.port}/sessions/<id>/v1)", flush=True)
    try:
        serve_forever(app, args.host, args.port)
    finally:
        engine.close()
    return 0
