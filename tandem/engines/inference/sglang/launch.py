"""Launching servers for the adapter (when ``SGLangEngineConfig.urls`` is empty): ``python -m
sglang.launch_server`` (``launch: sglang``), or ``python -m tandem serve RECIPE --api sglang`` on the embedded
engine (``launch: embedded``, ``replicas`` of them), whose recipe holds the model and ``inference.torch``."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tandem.engines.inference.sglang.config import SGLangEngineConfig

__all__ = ["INSTALL", "embedded_command", "embedded_recipe", "launch_command", "launch_server", "launch_servers",
           "stop_servers"]

INSTALL = ("pip install 'sglang[all]==0.5.23' (a CUDA machine), or start servers yourself and set "
           "SGLangEngineConfig.urls, or set launch: embedded (the same API served by the embedded engine)")


def _flag(key: str, value: Any) -> list[str]:
    flag = "--" + key.replace("_", "-")
    if value is True:
        return [flag]
    if value is False or value is None:
        return []
    if isinstance(value, list | tuple):
        return [flag, *map(str, value)]
    return [flag, str(value)]


def launch_command(config: SGLangEngineConfig, model_folder: Path, port: int, *, routed_experts: bool) -> list[str]:
    """The argv that starts one SGLang server for ``config`` (Tandem's keys first, then ``server_args``)."""
    owned: dict[str, Any] = {
        "model_path": str(model_folder), "dtype": config.model.dtype, "context_length": config.max_model_len,
        "random_seed": config.seed, "host": config.host, "port": port, "skip_tokenizer_init": True,
        "api_key": config.api_key, "enable_return_routed_experts": routed_experts,
    }
    argv = [config.launch_python or sys.executable, "-m", "sglang.launch_server"]
    for key, value in [*owned.items(), *config.server_args.items()]:
        argv += _flag(key, value)
    return argv


def embedded_command(config: SGLangEngineConfig, recipe: Path, port: int) -> list[str]:
    """The argv that starts one embedded-engine server speaking SGLang's API from ``recipe``."""
    argv = [config.launch_python or sys.executable, "-m", "tandem", "serve", str(recipe), "--api", "sglang",
            "--host", config.host, "--port", str(port)]
    return argv + (["--api-key", config.api_key] if config.api_key else [])


def embedded_recipe(config: SGLangEngineConfig, folder: Path) -> Path:
    """A recipe with the model and ``inference.torch`` (``server_args`` over the adapter's own keys), in
    ``folder``; a key the embedded engine does not have is a ValueError naming it and the keys it has."""
    import dataclasses

    import yaml

    from tandem.engines.registry import INFERENCE_ENGINES

    # the embedded engine's settings, through the registry (an adapter does not import another adapter)
    known = {f.name for f in dataclasses.fields(INFERENCE_ENGINES.get("torch").config_class())} - {"model"}
    unknown = sorted(set(config.server_args) - known)
    if unknown:
        raise ValueError(f"server_args[{unknown[0]!r}] is not a setting of the embedded engine (launch: embedded "
                         f"takes inference.torch keys: {', '.join(sorted(known))})")
    torch_section: dict[str, Any] = {"max_model_len": config.max_model_len, "seed": config.seed, **config.server_args}
    if config.replicas > 1:  # replicas share the machine's cores
        torch_section.setdefault("num_threads", max(1, (os.cpu_count() or 1) // config.replicas))
    recipe = {"model": {"name": config.model.name, "dtype": config.model.dtype},
              "inference": {"engine": "torch", "torch": torch_section}}
    path = folder / "embedded-sglang-server.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch_servers(config: SGLangEngineConfig, model_folder: Path, *, routed_experts: bool):
    """Start ``config.replicas`` servers (``config.launch``'s kind), each up: ``[(process, base URL)]``.
    If one fails, those already started are stopped."""
    started: list = []
    try:
        with tempfile.TemporaryDirectory(prefix="tandem-sglang-launch-") as tmp:
            recipe = embedded_recipe(config, Path(tmp)) if config.launch == "embedded" else None
            for i in range(config.replicas):
                port = (config.port + i if config.port else 0) or _free_port(config.host)
                argv = (embedded_command(config, recipe, port) if recipe is not None else
                        launch_command(config, model_folder, port, routed_experts=routed_experts))
                started.append(launch_server(config, argv, port))
    except BaseException:
        stop_servers([proc for proc, _ in started])
        raise
    return started


def stop_servers(procs: list) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def launch_server(config: SGLangEngineConfig, argv: list[str], port: int):
    """Start one server with ``argv`` and wait until ``/health_generate`` answers 200: ``(process, base URL)``.

    ImportError naming the install when this Python has no SGLang (``launch: sglang``, no ``launch_python``);
    RuntimeError with the tail of the server's output when it exits or does not come up in time.
    """
    import httpx

    if config.launch == "sglang" and config.launch_python is None and importlib.util.find_spec("sglang") is None:
        raise ImportError(f"SGLang is not installed in this Python ({sys.executable}): {INSTALL}")
    log = tempfile.NamedTemporaryFile(prefix=f"sglang-{port}-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)  # a pipe nobody reads would fill up
    proc.log_path = log.name
    log.close()
    url = f"http://{config.host}:{port}"
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    deadline = time.monotonic() + config.startup_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = Path(proc.log_path).read_bytes()[-3000:].decode(errors="replace")
            raise RuntimeError(f"the {config.launch} server exited with code {proc.returncode} during start-up "
                               f"({' '.join(argv)}):\n{tail}")
        try:
            if httpx.get(url + "/health_generate", headers=headers, timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the {config.launch} server did not answer /health_generate within {config.startup_timeout_s} s "
                       f"(startup_timeout_s): {' '.join(argv)}")
