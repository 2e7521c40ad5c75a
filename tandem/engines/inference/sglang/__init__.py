"""The SGLang inference adapter (satisfies tandem.core.protocols.InferenceEngine) over SGLang's native HTTP
API, and the embedded engine serving that API (`server.create_sglang_app`). SGLang itself is never imported:
the adapter talks HTTP to servers it launches (``python -m sglang.launch_server``) or is given."""

from tandem.engines.inference.sglang.config import SGLangEngineConfig

__all__ = ["SGLangEngine", "SGLangEngineConfig", "SGLangServerError"]


def __getattr__(name: str):
    if name in ("SGLangEngine", "SGLangServerError"):
        from tandem.engines.inference.sglang import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
