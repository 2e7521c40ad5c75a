"""``tandem serve MODEL_OR_RECIPE [key=value ...]``: the session server in front of an inference engine.

With ``runtime.placement: ray`` in the recipe it serves ``inference.replicas`` Ray actor replicas behind
the router (least load, session affinity: every turn of a session on one replica).

Serves OpenAI-compatible chat sessions with token-in-token-out bookkeeping (tandem/rollout/server.py)
on 127.0.0.1:8000 by default; another ``--host`` needs ``--api-key`` (or ``$TANDEM_API_KEY``). A recipe gives the model, the engine (``inference.engine``, any engine of
the registry, a plug-in included) with its settings (``inference.<engine>``), and the agent's limits
(``rollout.agent``); a model name or HF folder serves that model on ``--engine`` (default: the embedded
``torch`` engine) with its defaults. The engine runs in this process, driven by the server's event loop.

``--api sglang`` serves SGLang's native server API instead (``/generate`` with ``input_ids``, weight updates,
pause, memory release: tandem/engines/inference/sglang/server.py, docs/sglang.md), from one engine or from
the Ray replicas behind the router.
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
    p.add_argument("--engine", default=None,
                   help="inference engine for a model name: a registered name or 'module:ENTRY' (default torch); "
                        "a recipe names its own (inference.engine)")
    p.add_argument("--max-model-len", type=int, default=None, help="context per sequence (engine KV-cache slot)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences decoded together")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--chat-template", default=None, help="a .jinja file to use instead of the tokenizer's template")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=FOLDER",
                   help="serve a peft LoRA adapter folder under NAME (repeatable; the embedded engine): requests "
                        "with \"model\": NAME use it, \"base\" the base model")
    p.add_argument("--no-verify-tokens", action="store_true", help="skip the token-level drift check")
    p.add_argument("--api", choices=["openai", "sglang"], default="openai",
                   help="openai (default): chat sessions with token bookkeeping; sglang: SGLang's native server API "
                        "(/generate with input_ids, weight updates, pause, memory release; docs/sglang.md)")


def _engine_config(args: argparse.Namespace):
    """``(engine entry, its filled config, model name, the recipe's agent section or None)``."""
    import dataclasses
    from pathlib import Path

    from tandem.config import ConfigError, load_config
    from tandem.engines.registry import INFERENCE_ENGINES, RunFacts, Unsupported
    from tandem.models import ModelConfig
    from tandem.plugins import PluginError
    from tandem.runtime import builders

    try:
        if Path(args.target).suffix in (".yaml", ".yml"):
            from tandem.runtime.config import RunConfig

            if args.engine is not None:
                raise ConfigError(f"--engine {args.engine!r}: a recipe names its engine (inference.engine={args.engine})")
            cfg = load_config(RunConfig, args.target, args.overrides)
            entry = cfg.inference.entry
            ec = entry.configure(builders.run_facts(cfg), cfg.inference.config)
            model_name, agent, recipe_cfg = cfg.model.name, cfg.rollout.agent, cfg
        else:
            if args.overrides:
                raise ConfigError(f"overrides {args.overrides} need a recipe, not the model {args.target!r}")
            entry = INFERENCE_ENGINES.get(args.engine or "torch")
            model = ModelConfig(name=args.target)
            ec = entry.configure(RunFacts(model=model, max_context=_model_context(args.target)), None)
            model_name, agent, recipe_cfg = args.target, None, None
    except (Unsupported, PluginError) as e:
        raise ConfigError(str(e)) from None
    if args.max_model_len is not None:
        _check_max_model_len(args.max_model_len, model_name)
    changes = {}
    for flag, name, value in (("--max-model-len", "max_model_len", args.max_model_len),
                              ("--max-num-seqs", "max_num_seqs", args.max_num_seqs),
                              ("--dtype", "model", args.dtype)):
        if value is None:
            continue
        if not any(f.name == name for f in dataclasses.fields(ec)):
            raise ConfigError(f"{flag} does not apply to inference.engine: {entry.name} (its config has no {name})")
        changes[name] = dataclasses.replace(ec.model, dtype=value) if name == "model" else value
    try:
        return entry, dataclasses.replace(ec, **changes), model_name, agent, recipe_cfg
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _load_adapters(engine, specs: list[str]) -> None:
    """``--lora NAME=FOLDER``: each adapter loaded by name, or one `ConfigError` naming the problem."""
    from tandem.config import ConfigError

    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise ConfigError(f"--lora {spec!r} must be NAME=FOLDER (a peft adapter folder)")
        if not callable(getattr(engine, "add_lora_adapter", None)):
            raise ConfigError(f"--lora: this engine ({type(engine).__name__}) does not serve named adapters; "
                              "the embedded engine (--engine torch) does")
        try:
            engine.add_lora_adapter(name, folder)
        except (ValueError, FileNotFoundError, OSError) as e:
            raise ConfigError(f"--lora {spec}: {e}") from None


def _check_max_model_len(value: int, model_name: str) -> None:
    """--max-model-len must be >= 2 (a prompt token and a new one) and within the model's positions."""
    from tandem.config import ConfigError

    if value < 2:
        raise ConfigError(f"--max-model-len {value} must be >= 2 (one prompt token and one new token)")
    limit = _model_context(model_name)
    if value > limit:
        raise ConfigError(f"--max-model-len {value} exceeds the context of {model_name} "
                          f"(max_position_embeddings={limit})")


def _model_context(name: str) -> int:
    from tandem.models import resolve_model
    from tandem.models.hf_config import read_hf_config

    return int(read_hf_config(resolve_model(name)).max_position_embeddings)


def run(args: argparse.Namespace) -> int:
    import logging
    import os
    from pathlib import Path

    from tandem.config import ConfigError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    entry, ec, model_name, agent, recipe_cfg = _engine_config(args)
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
        raise ConfigError(f"--host {args.host} without --api-key: anyone who reaches {args.host}:{args.port} "
                          "could use the server; pass --api-key KEY (or set $TANDEM_API_KEY), or serve on "
                          "127.0.0.1")

    from tandem.models import load_tokenizer
    from tandem.rollout.chat import ChatTemplate
    from tandem.rollout.server import create_app, serve_forever

    if args.api == "sglang":
        return _serve_sglang(args, entry, ec, model_name, api_key, recipe_cfg)
    from tandem.rollout.session import SessionStore

    engine, cluster = _build_engine(entry, ec, recipe_cfg)
    try:
        _load_adapters(engine, args.lora)
    except BaseException:
        (cluster or engine).close()
        raise
    template = ChatTemplate(load_tokenizer(model_name),
                            chat_template=Path(template_file).read_text() if template_file else None)
    app = create_app(SessionStore(engine, template, sessions), server_cfg)
    print(f"tandem serve: {model_name} ({entry.name} engine) on http://{args.host}:{args.port} "
          f"(POST /sessions, then OpenAI base_url http://{args.host}:{args.port}/sessions/<id>/v1)", flush=True)
    try:
        serve_forever(app, args.host, args.port)
    finally:
        (cluster or engine).close()
    return 0


def _build_engine(entry, ec, recipe_cfg):
    """``(engine, Ray cluster or None)``: the engine in this process, or with ``runtime.placement: ray`` in the
    recipe, ``inference.replicas`` Ray actor replicas behind the router (which is then the engine)."""
    from tandem.config import ConfigError

    if recipe_cfg is not None and recipe_cfg.runtime.placement == "ray":
        from tandem.runtime.ray.placement import RayPlacement

        gpus = entry.bundle_gpus(ec, recipe_cfg.ray.engine_gpus)
        cluster = RayPlacement(recipe_cfg, engine_gpus=gpus, with_trainer=False)
        cluster.start(trainer_spec=None, engine_spec=entry.spec(ec))
        return cluster.router, cluster
    try:
        return entry.spec(ec).build(), None
    except ValueError as e:  # the engine refused its settings: a config error, not a crash
        raise ConfigError(f"inference.engine {entry.name}: {e}") from e


def _serve_sglang(args: argparse.Namespace, entry, ec, model_name: str, api_key: str | None, recipe_cfg) -> int:
    """``--api sglang``: the engine (or the Ray replicas' router) behind SGLang's native HTTP API
    (tandem/engines/inference/sglang/server.py)."""
    from tandem.engines.inference.sglang.server import create_sglang_app, eos_token_ids
    from tandem.models import resolve_model
    from tandem.rollout.server import serve_forever

    engine, cluster = _build_engine(entry, ec, recipe_cfg)
    try:
        _load_adapters(engine, args.lora)
        folder = resolve_model(model_name)
        app = create_sglang_app(engine, model_path=str(folder), served_model_name=model_name,
                                eos_token_ids=eos_token_ids(folder), api_key=api_key,
                                max_request_bytes=args.max_request_bytes)
        print(f"tandem serve: {model_name} ({entry.name} engine) with SGLang's API on http://{args.host}:{args.port} "
              "(POST /generate)", flush=True)
        serve_forever(app, args.host, args.port)
    finally:
        (cluster or engine).close()
    return 0
