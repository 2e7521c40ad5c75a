"""Shared pieces of the SGLang adapter tests: embedded-engine servers speaking SGLang's API, adapters on
them, a stub HTTP server for the failures a real server can produce (5xx, slowness)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

from tandem.engines.inference.sglang import SGLangEngine, SGLangEngineConfig
from tandem.models import ModelConfig
from tests.serve_helpers import serving

MAX_MODEL_LEN = 256


def sglang_server(model: str = "tiny-llama", *extra: str, max_model_len: int = MAX_MODEL_LEN):
    """``tandem serve MODEL --api sglang`` in a subprocess (a context manager yielding its base URL)."""
    return serving([model, "--api", "sglang", "--max-model-len", str(max_model_len), "--max-num-seqs", "8", *extra])


def adapter(url: str | list[str], model: str = "tiny-llama", **kw) -> SGLangEngine:
    urls = [url] if isinstance(url, str) else url
    kw.setdefault("max_model_len", MAX_MODEL_LEN)
    return SGLangEngine(SGLangEngineConfig(model=ModelConfig(name=model), urls=urls, **kw))


@contextlib.contextmanager
def stub_server(app) -> Iterator[str]:
    """Serve a FastAPI ``app`` on a free loopback port in a thread; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def failing_app(*, version: str = "0.5.23", generate_status: int = 500, generate_delay_s: float = 0.0):
    """A server that identifies as SGLang ``version`` and answers /generate with ``generate_status``
    (after ``generate_delay_s``): what an overloaded or crashing SGLang server looks like on the wire."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.get("/server_info")
    async def info():
        return {"version": version, "weight_version": "default", "context_length": 4096, "internal_states": [{}]}

    @app.post("/generate")
    async def generate():
        await asyncio.sleep(generate_delay_s)
        return JSONResponse({"error": {"message": "CUDA out of memory (stub)"}}, status_code=generate_status)

    @app.post("/pause_generation")
    @app.post("/continue_generation")
    async def pause_or_continue():
        return {"message": "ok", "status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update():
        return JSONResponse({"success": False, "message": "internal failure (stub)"}, status_code=500)

    return app


def router_available() -> str | None:
    """None if sglang-router is installed here, else why not (the reason a test skips with)."""
    import importlib.util

    if importlib.util.find_spec("sglang_router") is None:
        return "sglang-router is not installed (pip install sglang-router==0.3.2: a Rust binary, no torch)"
    return None


@contextlib.contextmanager
def sglang_router(workers: list[str], policy: str = "round_robin", timeout_s: float = 60) -> Iterator[str]:
    """``python -m sglang_router.launch_router`` in front of ``workers``; yields its base URL once /health
    answers; stopped on leaving."""
    import subprocess
    import sys
    import tempfile

    import httpx2 as httpx

    from tests.serve_helpers import free_port

    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="sglang-router-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *workers,
                             "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()), "--policy", policy, "--log-level", "warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, open(log.name).read()[-3000:]
            assert time.monotonic() < deadline, "sglang-router did not come up"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
