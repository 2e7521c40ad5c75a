"""SGLang's native HTTP API, the subset Tandem speaks: field names, request building, response parsing.

Both sides use this module: the adapter (`SGLangEngine`) builds ``/generate`` bodies and reads the
responses; the embedded engine's server (`tandem.engines.inference.sglang.server`) reads the same bodies
and writes the same responses. Field names are SGLang 0.5.x's, taken from its source (docs/sglang.md cites
the files and commits): ``GenerateReqInput`` and the control requests in
``python/sglang/srt/managers/io_struct.py``, ``SamplingParams`` in
``python/sglang/srt/sampling/sampling_params.py``, the response's ``meta_info`` in
``python/sglang/srt/managers/tokenizer_manager.py``, the weight-version spans in
``python/sglang/srt/utils/weight_versions.py``, the endpoints in
``python/sglang/srt/entrypoints/http_server.py``. Nothing here imports SGLang.
"""

from __future__ import annotations

import base64
import fnmatch
from typing import Any

import numpy as np

from tandem.core.protocols import Completion, FinishReason, SamplingParams

__all__ = [
    "PINNED_VERSION",
    "completion_from_output",
    "decode_routed_experts",
    "encode_routed_experts",
    "finish_reason_json",
    "generate_body",
    "sample_ids",
    "version_problem",
]

PINNED_VERSION = "0.5.23"  # the SGLang release whose field names this module follows

# SGLang 0.5.23's API-facing ``SamplingParams`` fields (sampling_params.py) and their defaults (checked
# against tests/engines/sglang_0_5_23_schema.json, derived from the release's wheel).
SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128, "stop": None, "stop_token_ids": None, "stop_regex": None, "temperature": 1.0,
    "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "beam_width": None, "json_schema": None,
    "regex": None, "ebnf": None, "structural_tag": None, "ignore_eos": False, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "no_stop_trim": False, "stream_interval": None, "logit_bias": None,
    "sampling_seed": None, "custom_params": None, "watermark": None,
}


def version_problem(version: Any, accepted: str) -> str | None:
    """Why a server reporting ``version`` is refused (None: accepted). ``accepted`` is an fnmatch
    pattern (``0.5.23*``): the fields this module reads were checked against that release only."""
    if not isinstance(version, str) or not version:
        return f"the server reports no SGLang version (get_server_info 'version'={version!r})"
    if not fnmatch.fnmatchcase(version, accepted):
        return (f"the server runs SGLang {version}, but this adapter speaks the API of SGLang {accepted} "
                f"(pinned {PINNED_VERSION}; field names differ between releases): run that version, or set "
                "SGLangEngineConfig.sglang_version to accept this one after checking docs/sglang.md")
    return None


def init_group_body(*, address: str, port: int, rank_offset: int, world_size: int, group: str,
                    backend: str) -> dict[str, Any]:
    """``InitWeightsUpdateGroupReqInput``: join the group whose rank 0 (the trainer) hosts the store."""
    return {"master_address": address, "master_port": port, "rank_offset": rank_offset, "world_size": world_size,
            "group_name": group, "backend": backend}


def distributed_update_body(names: list[str], dtypes: list[str], shapes: list[list[int]], *, group: str,
                            version: int) -> dict[str, Any]:
    """``UpdateWeightsFromDistributedReqInput``: the tensors rank 0 broadcasts next, in order."""
    return {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group, "weight_version": str(version),
            "flush_cache": True}


def disk_update_body(folder: str, version: int) -> dict[str, Any]:
    """``UpdateWeightFromDiskReqInput``: reload the weights of a model folder."""
    return {"model_path": folder, "weight_version": str(version), "flush_cache": True, "abort_all_requests": False}


def sample_ids(request_id: str, n: int) -> list[str]:
    """The SGLang ``rid`` of each sample of a request: one batch item per sample (see `generate_body`)."""
    return [f"{request_id}/{i}" for i in range(n)]


def generate_body(prompt: list[int], sampling: SamplingParams, *, rids: list[str], seeds: list[int],
                  max_new_tokens: int, lora: str | None = None) -> dict[str, Any]:
    """A ``/generate`` body (``GenerateReqInput``) for the samples of one request.

    The ``n`` samples are a batch of ``n`` copies of the prompt, each with its own ``sampling_seed`` and
    ``rid``: SGLang expands ``n > 1`` by copying the sampling params, so one seed would give ``n`` equal
    samples; per-sample rids let an abort return each sample's partial tokens. ``ignore_eos`` is set
    because Tandem engines stop only on ``stop_token_ids`` (the stop token is kept: ``no_stop_trim``).
    Greedy is ``temperature = 0`` (SGLang turns it into top-k 1 at temperature 1, so its log-probs are
    ``log_softmax(logits)``, Tandem's greedy convention).
    """
    n = len(rids)
    params = []
    for seed in seeds:
        p: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": float(sampling.temperature),
                             "top_p": float(sampling.top_p), "top_k": int(sampling.top_k) if sampling.top_k > 0 else -1,
                             "ignore_eos": True, "no_stop_trim": True, "n": 1, "sampling_seed": int(seed)}
        if sampling.stop_token_ids:
            p["stop_token_ids"] = [int(t) for t in sampling.stop_token_ids]
        params.append(p)
    body: dict[str, Any] = {"input_ids": [list(prompt)] * n, "sampling_params": params, "rid": list(rids),
                            "return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 0}
    if sampling.return_routed_experts:
        body["return_routed_experts"] = True
    if lora is not None:
        body["lora_path"] = [lora] * n
    return body


def merge_bodies(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """One batch ``/generate`` body holding the items of several `generate_body` bodies (same
    ``return_routed_experts``), in order; ``lora_path`` is per item (None: the default)."""
    if len(bodies) == 1:
        return bodies[0]
    merged = {**bodies[0], "input_ids": [], "sampling_params": [], "rid": []}
    merged.pop("lora_path", None)
    for b in bodies:
        for key in ("input_ids", "sampling_params", "rid"):
            merged[key] += b[key]
    if any("lora_path" in b for b in bodies):
        merged["lora_path"] = [x for b in bodies for x in b.get("lora_path", [None] * len(b["rid"]))]
    return merged


def split_body(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A batch body as single-item bodies (one prompt, one sampling dict): what sglang-router 0.3 accepts
    (its request type refuses a list of sampling params, measured)."""
    out = []
    for i, rid in enumerate(body["rid"]):
        one = {k: v for k, v in body.items() if k not in ("input_ids", "sampling_params", "rid", "lora_path")}
        one |= {"input_ids": body["input_ids"][i], "sampling_params": body["sampling_params"][i], "rid": rid}
        if body.get("lora_path") is not None and body["lora_path"][i] is not None:
            one["lora_path"] = body["lora_path"][i]
        out.append(one)
    return out


_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def finish_reason_json(reason: FinishReason, *, token_ids: list[int], matched: int | None = None,
                       message: str | None = None) -> dict[str, Any] | None:
    """SGLang's ``BaseFinishReason.to_json()`` shapes: ``{"type": "stop", "matched": id}``,
    ``{"type": "length", "length": n}``, ``{"type": "abort", "message": ...}``."""
    if reason == FinishReason.STOP:
        return {"type": "stop", "matched": matched if matched is not None else token_ids[-1]}
    if reason == FinishReason.LENGTH:
        return {"type": "length", "length": len(token_ids)}
    return {"type": "abort", "message": message or "aborted"}


def encode_routed_experts(routes: np.ndarray) -> str:
    """``meta_info["routed_experts"]``: base64 of the little-endian int32 C-order array
    ``[tokens - 1, layers, topk]`` (SGLang's encoding, tokenizer_manager.py)."""
    return base64.b64encode(np.ascontiguousarray(routes, dtype="<i4").tobytes()).decode("ascii")


def decode_routed_experts(data: str, *, num_layers: int, topk: int, rows: int) -> np.ndarray:
    """The routed experts of ``meta_info`` as ``[rows, num_layers, topk]`` int32; ValueError on a size that
    does not fit (a server started without routing capture, or another model)."""
    raw = np.frombuffer(base64.b64decode(data), dtype="<i4")
    if raw.size != rows * num_layers * topk:
        raise ValueError(f"routed_experts holds {raw.size} ids; expected {rows} tokens x {num_layers} MoE layers "
                         f"x top-{topk} = {rows * num_layers * topk}")
    return raw.reshape(rows, num_layers, topk).astype(np.int32)


def parse_version(value: Any) -> int:
    """A Tandem weight version from SGLang's string ``weight_version`` (SGLang's start value "default" is 0)."""
    if value in (None, "default"):
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"weight_version {value!r} is not an integer: Tandem labels every update with one "
                         "(a weight update from another client renamed the version)") from None


def completion_from_output(output: dict[str, Any], *, prompt_len: int,
                           routing: tuple[int, int] | None = None) -> Completion:
    """A Tandem `Completion` from one ``/generate`` output (``output_ids`` + ``meta_info``).

    Token ids come from ``output_token_logprobs`` (``[logprob, token_id, text]`` per token) and must equal
    ``output_ids``; a missing or short log-prob list is an error, never padded. ``routing`` is
    ``(num_layers, topk)`` where routed experts were asked for.
    """
    meta = output.get("meta_info")
    if not isinstance(meta, dict):
        raise ValueError(f"a /generate output without meta_info: {str(output)[:200]}")
    rows = meta.get("output_token_logprobs")
    if not isinstance(rows, list):
        raise ValueError("meta_info has no output_token_logprobs (the request set return_logprob)")
    token_ids = [int(r[1]) for r in rows]
    log_probs = [float(r[0]) for r in rows]
    output_ids = output.get("output_ids")
    if output_ids is not None and list(output_ids)[-len(token_ids) or len(output_ids):] != token_ids:
        raise ValueError(f"output_ids {list(output_ids)[:8]}... disagree with output_token_logprobs {token_ids[:8]}...")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in _FINISH:
        raise ValueError(f"unknown finish_reason {finish!r}")
    spans = meta.get("weight_versions")
    versions = ([parse_version(s["version"]) for s in spans] if isinstance(spans, list) and spans
                else [parse_version(meta.get("weight_version"))])
    routes = None
    if routing is not None and meta.get("routed_experts") is not None:
        routes = decode_routed_experts(meta["routed_experts"], num_layers=routing[0], topk=routing[1],
                                       rows=prompt_len + len(token_ids) - 1)
    return Completion(token_ids=token_ids, log_probs=log_probs, finish_reason=_FINISH[kind],
                      weight_versions=versions if token_ids else [], routed_experts=routes)


def error_message(body: Any, text: str) -> str:
    """The message of an SGLang error body: ``{"error": {"message"}}``, ``{"message"}`` or the raw text."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:  # 0.5.23's /generate contract gate: {"error": "<text>"}
            return err
        if body.get("message"):
            return str(body["message"])
        if body.get("error_message"):
            return str(body["error_message"])
    return text.strip()[:500] or "(empty body)"
