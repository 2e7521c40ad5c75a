"""Launching ``python -m sglang.launch_server`` for the adapter (when ``SGLangEngineConfig.urls`` is empty)."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tandem.engines.inference.sglang.config import SGLangEngineConfig

__all__ = ["INSTALL", "launch_command", "launch_server"]

INSTALL = ("pip install 'sglang[all]==0.5.23' (a CUDA machine), or start servers yourself and set "
           "SGLangEngineConfig.urls (e.g. `tandem serve MODEL --api sglang` serves the same API from the embedded "
           "engine)")


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


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch_server(config: SGLangEngineConfig, model_folder: Path, *, routed_experts: bool):
    """Start a server and wait until ``/health_generate`` answers 200: ``(process, base URL)``.

    ImportError naming the install when this Python has no SGLang (and no ``launch_python`` is given);
    RuntimeError with the tail of the server's output when it exits or does not come up in time.
    """
    import httpx

    if config.launch_python is None and importlib.util.find_spec("sglang") is None:
        raise ImportError(f"SGLang is not installed in this Python ({sys.executable}): {INSTALL}")
    port = config.port or _free_port(config.host)
    argv = launch_command(config, model_folder, port, routed_experts=routed_experts)
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
            raise RuntimeError(f"the SGLang server exited with code {proc.returncode} during start-up "
                               f"({' '.join(argv)}):\n{tail}")
        try:
            if httpx.get(url + "/health_generate", headers=headers, timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the SGLang server did not answer /health_generate within {config.startup_timeout_s} s "
                       f"(startup_timeout_s): {' '.join(argv)}")
