"""The connection between a trainer and its engine process: frames, the unpickling allowlist, errors.

Each frame is a header (8-byte call id, 1-byte status) plus a pickle of the call or its result.
Pickle runs code named in the data, so both ends unpickle with an allowlist (`_WireUnpickler`): the
protocol dataclasses, numpy arrays and plain containers; a frame naming any other global is refused
with an error for that call (`UndecodableFrame` carries its call id). Weight tensors never travel as
pickles: `update_weights` sends flat buckets as raw frames after the call.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import struct
import traceback
from typing import Any

import numpy as np
import torch

from tandem.core.protocols import CapabilityError, EngineAsleepError, EngineClosedError, GenerationRequest

__all__ = [
    "CONTROL",
    "ERROR",
    "FATAL",
    "MANY",
    "OK",
    "READY",
    "EngineCallError",
    "EngineProcessError",
    "UndecodableFrame",
    "decode",
    "encode",
    "error_payload",
    "plain_request",
    "rebuild_error",
]

_HEAD = struct.Struct("<qB")  # call id, status
OK, ERROR, READY, FATAL = 0, 1, 2, 3
CONTROL = -1  # call id of READY / FATAL frames
MANY = "__many__"  # a frame holding several calls [(call_id, method, args)], started together
# errors the trainer can handle by type; any other raises as EngineCallError with the type in its text
_MAPPED_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError, "TimeoutError": TimeoutError,
                  "EngineAsleepError": EngineAsleepError, "EngineClosedError": EngineClosedError,
                  "CapabilityError": CapabilityError}


class EngineProcessError(RuntimeError):
    """The engine process died, failed to start, or was closed."""


class EngineCallError(RuntimeError):
    """A call raised inside the engine process (its type and message are in the text)."""


class UndecodableFrame(Exception):
    """A frame whose payload could not be unpickled; ``call_id`` says which call to answer with it."""

    def __init__(self, call_id: int, reason: str) -> None:
        super().__init__(reason)
        self.call_id = call_id


_ALLOWED_GLOBALS = {
    "tandem.core.protocols": {"GenerationRequest", "GenerationResult", "Completion", "SamplingParams", "FinishReason",
                              "EngineInfo"},
    "numpy": {"ndarray", "dtype"},
    "numpy._core.numeric": {"_frombuffer"},
    "numpy.core.numeric": {"_frombuffer"},
    "numpy._core.multiarray": {"_reconstruct", "scalar"},
    "numpy.core.multiarray": {"_reconstruct", "scalar"},
}


class _WireUnpickler(pickle.Unpickler):
    """Unpickles only the protocol dataclasses, numpy arrays/scalars and built-in containers."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} may not cross the engine connection (allowed: the protocol dataclasses, "
            "numpy arrays, lists, dicts, numbers and strings)"
        )


def encode(call_id: int, status: int, payload: Any) -> bytes:
    return _HEAD.pack(call_id, status) + pickle.dumps(payload, protocol=5)


def decode(frame: bytes) -> tuple[int, int, Any]:
    """``(call_id, status, payload)``; a payload that fails to unpickle raises `UndecodableFrame`."""
    call_id, status = _HEAD.unpack_from(frame)
    try:
        payload = _WireUnpickler(io.BytesIO(memoryview(frame)[_HEAD.size :])).load()
    except Exception as e:
        raise UndecodableFrame(call_id, f"{type(e).__name__}: {e}") from e
    return call_id, status, payload


def error_payload(e: BaseException) -> tuple[str, str, str]:
    """An exception as plain strings: its type name, message and formatted traceback."""
    return type(e).__name__, str(e), "".join(traceback.format_exception(e))


def rebuild_error(payload: tuple[str, str, str], method: str, pid: int | None) -> Exception:
    """The trainer-side exception for an `error_payload`, with the engine's traceback as a note."""
    type_name, message, remote_tb = payload
    cls = _MAPPED_ERRORS.get(type_name)
    error = cls(message) if cls is not None else EngineCallError(f"{type_name}: {message}")
    error.add_note(f"raised by {method}() in the engine process (pid {pid}):\n{remote_tb.rstrip()}")
    return error


def plain_request(request: GenerationRequest) -> GenerationRequest:
    """Token ids as a list (a tensor may not cross the connection; the engine accepts either)."""
    ids = request.prompt_token_ids
    if isinstance(ids, torch.Tensor | np.ndarray):
        return dataclasses.replace(request, prompt_token_ids=ids.tolist())
    return request
