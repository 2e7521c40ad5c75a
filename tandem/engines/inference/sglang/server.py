"""The embedded engine behind SGLang's native HTTP API (``tandem serve --api sglang``).

Serves the subset of SGLang 0.5.x's server API that RL frameworks drive, with SGLang's field names and
semantics (tandem/engines/inference/sglang/protocol.py cites where each comes from), over any Tandem
`InferenceEngine` (the embedded torch engine by default)::

    POST /generate                        input_ids (one prompt or a batch), sampling_params, rid, n,
                                          return_logprob, return_routed_experts, lora_path
    POST /abort_request                   {"rid"} or {"abort_all": true}: partial output, finish "abort"
    POST /update_weights_from_disk        a safetensors folder (model_path), weight_version
    POST /update_weight_version           the weight version alone (new_version; after an adapter load)
    POST /init_weights_update_group       join a broadcast group (gloo here; nccl needs CUDA)
    POST /update_weights_from_distributed names, dtypes, shapes broadcast from rank 0 of that group
    POST /destroy_weights_update_group
    POST /pause_generation                mode "abort" or "in_place" (retract: refused, see below)
    POST /continue_generation
    POST /release_memory_occupation       engine.sleep();  /resume_memory_occupation: wake_up()
    POST /load_lora_adapter               a peft folder under lora_name;  /unload_lora_adapter
    GET  /health, /health_generate        one greedy token, or 503
    GET  /server_info (= /get_server_info) server args, version, internal_states (the engine's counters)
    GET  /model_info (= /get_model_info: weight_version);  GET|POST /flush_cache

Bad input is a 400 naming the field and value (SGLang turns validation errors into 400 too); a field of
SGLang's that this server does not implement is refused by name unless it holds its default, never
silently ignored. The engine runs on the serving event loop (``agenerate``), like the session server.
Pause modes: ``abort`` aborts what is in flight and holds new requests until ``/continue_generation``;
``in_place`` holds running requests where they are, with their cache (no engine step runs; weight
updates, aborts and health still do), and new ones at the door (an engine without a hold, the Ray
replicas' router, holds new ones only: running requests go on, and updates land between steps); ``retract`` (back to the waiting queue,
cache dropped) is refused: the embedded engine does not retract.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tandem.core.protocols import EngineError, GenerationRequest, SamplingParams
from tandem.engines.inference.common import derive_seed
from tandem.engines.inference.sglang import protocol as P
from tandem.rollout.server import BodySizeLimit, SafeJSONResponse

__all__ = ["SGLangAPIError", "create_sglang_app", "eos_token_ids"]

# Request fields of GenerateReqInput this server reads. Any other field (SGLang has ~70, and sglang-router
# forwards them all) is accepted only at an empty value (null, false, 0, "", [], {}) or its SGLang default
# below; anything else is refused by name: never silently dropped.
_GENERATE_FIELDS = {"rid", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                    "top_logprobs_num", "return_routed_experts", "routed_experts_start_len", "lora_path", "stream",
                    "text", "return_text_in_logprobs"}
_GENERATE_DEFAULTS = {"stream": False, "text": None, "logprob_start_len": -1, "top_logprobs_num": 0,
                      "routed_experts_start_len": 0}
_OTHER_DEFAULTS = {"log_metrics": True}
_MAX_N = 1024  # samples per prompt in one request  # GenerateReqInput fields whose default is not empty
_IGNORED_SAMPLING = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}


class SGLangAPIError(Exception):
    """A 4xx answer: ``message`` names the field and the value."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def _error(message: str, status: int = 400) -> SafeJSONResponse:
    # SGLang's _create_error_response shape ({"error": {"message"}}) plus its ErrorResponse fields
    return SafeJSONResponse({"object": "error", "message": message, "code": status,
                             "error": {"message": message, "code": status}}, status_code=status)


class _State:
    """What the server holds besides the engine: pause gate, broadcast groups, model facts."""

    def __init__(self, engine, *, model_path: str, served_model_name: str, eos_token_ids: tuple[int, ...],
                 routing: tuple[int, int] | None) -> None:
        self.engine = engine
        self.model_path, self.served_model_name = model_path, served_model_name
        self.eos_token_ids, self.routing = eos_token_ids, routing
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.groups: dict[str, Any] = {}
        self.pauses = 0  # /pause_generation calls served (in internal_states)


def create_sglang_app(engine, *, model_path: str, served_model_name: str = "tandem",
                      eos_token_ids: tuple[int, ...] = (), api_key: str | None = None,
                      max_request_bytes: int = 64 << 20):
    """The ASGI app serving ``engine`` with SGLang's native API (see the module docstring): the FastAPI
    app (``.app``) behind a request-body size limit."""
    info = engine.info
    routing = None
    if info.routed_experts:
        from tandem.engines.inference.sglang.engine import model_facts

        routing = model_facts(model_path)[1]
    st = _State(engine, model_path=str(model_path), served_model_name=served_model_name,
                eos_token_ids=tuple(eos_token_ids), routing=routing)
    app = FastAPI(title="Tandem (SGLang API)", version=P.PINNED_VERSION, default_response_class=SafeJSONResponse)
    app.state.sglang = st

    @app.middleware("http")
    async def handle(request: Request, call_next):
        if api_key is not None and request.url.path not in ("/health", "/health_generate"):
            given = request.headers.get("authorization", "").removeprefix("Bearer ")
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                return _error("missing or wrong bearer token", 401)
        try:
            return await call_next(request)
        except SGLangAPIError as e:
            return _error(e.message, e.status)

    _routes(app, st)
    return BodySizeLimit(app, max_request_bytes)


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise SGLangAPIError(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise SGLangAPIError(f"the body must be a JSON object, got {type(body).__name__}")
    return body


def _fields(body: dict[str, Any], allowed: dict[str, Any], what: str) -> dict[str, Any]:
    """``body`` over ``allowed`` (field -> default); an unknown field holding a value is a 400 naming it
    (one holding nothing, as sglang-router and newer clients send, is ignored)."""
    for key in sorted(set(body) - set(allowed) - {"rid", "http_worker_ipc"}):
        if not _default(body[key], None):  # a field of a later release, or a typo, holding something
            raise SGLangAPIError(f"{what}: unknown field {key!r} (fields: {', '.join(sorted(allowed))})")
    return {k: body.get(k, default) for k, default in allowed.items()}


def _routes(app: FastAPI, st: _State) -> None:  # noqa: C901 - one flat list of endpoints
    engine = st.engine

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        body = await _body(request)
        items, single = _parse_generate(body, st)
        await st.resumed.wait()  # paused: requests wait for /continue_generation (SGLang's is_pause)
        results = await asyncio.gather(*(engine.agenerate(r) for r in items))
        outputs = []
        for req, res in zip(items, results, strict=True):
            if res.error is not None:
                raise SGLangAPIError(f"rid {req.request_id!r}: {res.error}")
            outputs.append(_output(req, res, st, logprobs=bool(body.get("return_logprob"))))
        return outputs[0] if single else outputs

    @app.post("/abort_request")
    async def abort_request(request: Request):
        obj = _fields(await _body(request), {"rid": "", "abort_all": False, "finished_reason": None,
                                             "abort_message": None}, "/abort_request")
        if obj["abort_all"] is True:
            engine.abort_all()
        elif isinstance(obj["rid"], str) and obj["rid"]:
            engine.abort(obj["rid"])
        else:
            raise SGLangAPIError(f"/abort_request: rid={obj['rid']!r} must be a request id (or abort_all: true)")
        return Response(status_code=200)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        obj = _fields(await _body(request), {"model_path": None, "load_format": None, "abort_all_requests": False,
                                             "weight_version": None, "is_async": False, "torch_empty_cache": False,
                                             "keep_pause": False, "recapture_cuda_graph": False, "token_step": 0,
                                             "flush_cache": True, "manifest": None}, "/update_weights_from_disk")
        if obj["is_async"] or obj["manifest"] is not None or obj["load_format"] not in (None, "auto", "safetensors"):
            raise SGLangAPIError("/update_weights_from_disk: is_async, manifest and load_format other than "
                                 "safetensors are not supported by the embedded engine")
        version = _version(obj["weight_version"], engine)
        folder = obj["model_path"]
        if not isinstance(folder, str) or not Path(folder).is_dir():
            return _update_result(False, f"model_path={folder!r} is not a folder")
        try:
            tensors = await asyncio.to_thread(_read_folder, Path(folder))
        except (OSError, ValueError) as e:
            return _update_result(False, f"cannot read {folder}: {e}")
        return _apply(st, tensors, version, obj["abort_all_requests"])

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        obj = _fields(await _body(request), {"master_address": None, "master_port": None, "rank_offset": None,
                                             "world_size": None, "group_name": "weight_update_group",
                                             "backend": "nccl"}, "/init_weights_update_group")
        try:
            st.groups[obj["group_name"]] = await asyncio.to_thread(_join_group, obj)
        except (ValueError, TypeError, RuntimeError) as e:
            return _update_result(False, f"init_weights_update_group failed: {e}")
        return _update_result(True, f"joined weight update group {obj['group_name']!r}")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        obj = _fields(await _body(request), {"names": None, "dtypes": None, "shapes": None,
                                             "group_name": "weight_update_group", "flush_cache": True,
                                             "abort_all_requests": False, "weight_version": None,
                                             "load_format": None, "torch_empty_cache": False, "selector": "all"},
                      "/update_weights_from_distributed")
        if obj["selector"] != "all":
            raise SGLangAPIError(f"/update_weights_from_distributed: selector={obj['selector']!r} is not supported "
                                 "(only 'all')")
        group = st.groups.get(obj["group_name"])
        if group is None:
            raise SGLangAPIError(f"/update_weights_from_distributed: no group {obj['group_name']!r} "
                                 "(call /init_weights_update_group first)")
        version = _version(obj["weight_version"], engine)
        metas = _tensor_metas(obj)
        try:
            tensors = await asyncio.to_thread(_receive, group, metas)
        except RuntimeError as e:
            return _update_result(False, f"broadcast failed: {e}")
        return _apply(st, tensors, version, obj["abort_all_requests"])

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        obj = _fields(await _body(request), {"group_name": "weight_update_group"}, "/destroy_weights_update_group")
        found = st.groups.pop(obj["group_name"], None) is not None
        return _update_result(found, "destroyed" if found else f"no group {obj['group_name']!r}")

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        obj = _fields(await _body(request), {"mode": "abort"}, "/pause_generation")
        if obj["mode"] not in ("abort", "in_place"):
            raise SGLangAPIError(f"/pause_generation: mode={obj['mode']!r} is not supported (the embedded engine "
                                 "holds requests in place but does not retract them); use mode 'in_place' or 'abort'")
        if obj["mode"] == "in_place" and callable(getattr(engine, "pause_generation", None)):
            engine.pause_generation()  # running requests stay where they are, with their cache
        # in_place on an engine without a hold (the Ray replicas' router): new requests wait at the door and
        # running ones go on; each replica applies a weight update between two of its steps either way
        st.resumed.clear()
        st.pauses += 1
        if obj["mode"] == "abort":
            engine.abort_all()
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        _fields(await _body(request), {"torch_empty_cache": True}, "/continue_generation")
        if callable(getattr(engine, "continue_generation", None)):
            engine.continue_generation()
        st.resumed.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request):
        _check_tags(_fields(await _body(request), {"tags": None}, "/release_memory_occupation")["tags"])
        try:
            engine.sleep()
        except EngineError as e:
            raise SGLangAPIError(f"release_memory_occupation: {e}") from None
        return None

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request):
        _check_tags(_fields(await _body(request), {"tags": None}, "/resume_memory_occupation")["tags"])
        engine.wake_up()
        return None

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        obj = _fields(await _body(request), {"lora_name": None, "lora_path": None, "pinned": False,
                                             "lora_id": None}, "/load_lora_adapter")
        if not callable(getattr(engine, "add_lora_adapter", None)):
            return _lora_result(False, "this engine serves no named LoRA adapters", engine)
        if not isinstance(obj["lora_name"], str) or not isinstance(obj["lora_path"], str):
            raise SGLangAPIError(f"/load_lora_adapter: lora_name={obj['lora_name']!r} and lora_path="
                                 f"{obj['lora_path']!r} must be strings")
        try:
            engine.add_lora_adapter(obj["lora_name"], obj["lora_path"])
        except (ValueError, OSError) as e:
            return _lora_result(False, f"load_lora_adapter {obj['lora_name']!r}: {e}", engine)
        return _lora_result(True, None, engine)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        obj = _fields(await _body(request), {"new_version": None, "abort_all_requests": True},
                      "/update_weight_version")
        if obj["new_version"] is None:
            raise SGLangAPIError("/update_weight_version: new_version is required")
        return _apply(st, [], _version(obj["new_version"], engine), bool(obj["abort_all_requests"]))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        obj = _fields(await _body(request), {"lora_name": None, "lora_id": None}, "/unload_lora_adapter")
        if not isinstance(obj["lora_name"], str):
            raise SGLangAPIError(f"/unload_lora_adapter: lora_name={obj['lora_name']!r} must be a string")
        try:
            engine.remove_lora_adapter(obj["lora_name"])
        except (ValueError, KeyError, AttributeError) as e:
            return _lora_result(False, f"unload_lora_adapter {obj['lora_name']!r}: {e}", engine)
        return _lora_result(True, None, engine)

    @app.get("/health")
    @app.get("/health_generate")
    async def health_generate():
        if engine.health()["status"] != "ok" or not st.resumed.is_set():
            return Response(status_code=503)
        probe = GenerationRequest(prompt_token_ids=[0], sampling=SamplingParams(temperature=0.0, max_new_tokens=1),
                                  request_id=f"HEALTH_CHECK_{uuid.uuid4().hex}")
        res = await engine.agenerate(probe)
        return Response(status_code=200 if res.error is None else 503)

    @app.get("/server_info")
    @app.get("/get_server_info")  # SGLang 0.5.23 keeps it, deprecated
    async def get_server_info():
        info, health = engine.info, engine.health()
        return {"model_path": st.model_path, "served_model_name": st.served_model_name,
                "context_length": info.max_context, "dtype": info.dtype, "skip_tokenizer_init": True,
                "enable_lora": info.lora_adapters, "enable_return_routed_experts": info.routed_experts,
                "enable_deterministic_inference": info.deterministic, "weight_version": str(engine.weight_version),
                "internal_states": [health], "version": P.PINNED_VERSION,
                "tandem": {"engine": info.name, "engine_version": info.version, "vocab_size": info.vocab_size,
                           "moe_layers": list(info.moe_layers), "can_sleep": info.can_sleep, "pauses": st.pauses}}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        return {"model_path": st.model_path, "tokenizer_path": st.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": str(engine.weight_version)}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        # the embedded engine keeps no prefix cache across requests; like SGLang, refuse while busy
        busy = engine.health().get("running", 0)
        return Response(content="Cache flushed.\n" if not busy else f"Cache not flushed: {busy} running request(s).\n",
                        status_code=200 if not busy else 400)


def eos_token_ids(folder: str | Path) -> tuple[int, ...]:
    """The model's end-of-sequence ids (config.json and generation_config.json): where a request with
    ``ignore_eos: false`` stops, as SGLang does."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = Path(folder) / name
        value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        for t in value if isinstance(value, list) else [value]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return tuple(ids)


def _parse_generate(body: dict[str, Any], st: _State) -> tuple[list[GenerationRequest], bool]:
    """The engine requests of a ``/generate`` body (one per batch item and sample) and whether it was a
    single prompt with one sample (answered with one object instead of a list)."""
    for key in sorted(set(body) - _GENERATE_FIELDS):
        if not _default(body[key], _OTHER_DEFAULTS.get(key)):
            raise SGLangAPIError(f"/generate: field {key}={str(body[key])[:80]!r} is not supported by the embedded "
                                 "engine (it serves input_ids in, token ids + log-probs out)")
    for key, default in _GENERATE_DEFAULTS.items():
        if body.get(key, default) not in (default, None):
            raise SGLangAPIError(f"/generate: {key}={body[key]!r} is not supported by the embedded engine "
                                 f"(only {default!r})")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise SGLangAPIError(f"/generate: input_ids={str(ids)[:80]} must be a non-empty list of token ids "
                             "(or a list of such lists); the embedded engine takes no text")
    single = not isinstance(ids[0], list)
    prompts = [ids] if single else ids
    sp = body.get("sampling_params") or {}
    sps = [sp] * len(prompts) if isinstance(sp, dict) else sp
    if not isinstance(sps, list) or len(sps) != len(prompts) or not all(isinstance(s, dict) for s in sps):
        raise SGLangAPIError(f"/generate: sampling_params must be an object or a list of {len(prompts)} objects")
    ns = {s.get("n", 1) for s in sps}
    if len(ns) != 1:
        raise SGLangAPIError("/generate: The parallel_sample_num should be the same for all samples in sample params.")
    n = ns.pop()
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= _MAX_N:
        raise SGLangAPIError(f"/generate: sampling_params n={n!r} must be an integer in [1, {_MAX_N}]")
    names = _rids(body.get("rid"), len(prompts), n, single)
    loras = body.get("lora_path")
    loras = [loras] * len(prompts) if loras is None or isinstance(loras, str) else loras
    if not isinstance(loras, list) or len(loras) != len(prompts):
        raise SGLangAPIError(f"/generate: lora_path must be a name or a list of {len(prompts)} names")
    routed = bool(body.get("return_routed_experts", False))
    items = []
    for s in range(n):  # SGLang's expansion order: input_ids * n (sample-major)
        for b, (prompt, params) in enumerate(zip(prompts, sps, strict=True)):
            sampling = _sampling(params, st, routed, n, s)
            rid = names(b, s, len(items))
            items.append(GenerationRequest(prompt_token_ids=prompt, sampling=sampling, request_id=rid, lora=loras[b]))
    return items, single and n == 1


def _rids(rid: Any, count: int, n: int, single: bool):
    """``(prompt index, sample index, item index) -> rid``: SGLang's naming (io_struct ``_normalize_rid``): a
    string names a single request as is and item ``k`` of a batch ``<rid>_<k>``; a list names each prompt
    (its samples ``<rid>_<s>`` when ``n > 1``); none gives random ids."""
    if rid is None:
        return lambda b, s, k: uuid.uuid4().hex
    if isinstance(rid, str):
        return (lambda b, s, k: rid) if single and n == 1 else (lambda b, s, k: f"{rid}_{k}")
    if isinstance(rid, list) and len(rid) == count and all(isinstance(r, str) for r in rid):
        if len(set(rid)) != len(rid):
            raise SGLangAPIError(f"/generate: Duplicate request IDs detected within the request: {rid}")
        return (lambda b, s, k: rid[b]) if n == 1 else (lambda b, s, k: f"{rid[b]}_{s}")
    raise SGLangAPIError(f"/generate: rid={str(rid)[:80]} must be a string or a list of {count} strings")


def _sampling(params: dict[str, Any], st: _State, routed: bool, n: int, index: int) -> SamplingParams:
    """Tandem sampling params from SGLang's (refusing, by name, what the embedded engine cannot do)."""
    for key in sorted(set(params) - set(P.SAMPLING_DEFAULTS)):
        if not _default(params[key], None):
            raise SGLangAPIError(f"sampling_params: unknown key {key!r} (={params[key]!r})")
    for key, default in P.SAMPLING_DEFAULTS.items():
        value = params.get(key, default)
        if key in ("max_new_tokens", "temperature", "top_p", "top_k", "n", "stop_token_ids", "ignore_eos",
                   "sampling_seed") or key in _IGNORED_SAMPLING:
            continue
        if value not in (default, None, [], {}):
            raise SGLangAPIError(f"sampling_params: {key}={value!r} is not supported by the embedded engine")
    top_k = params.get("top_k", -1)
    if top_k is None or top_k == -1:
        top_k = 0
    elif isinstance(top_k, int) and not isinstance(top_k, bool) and top_k < 1:
        raise SGLangAPIError(f"sampling_params: top_k must be -1 (disable) or at least 1, got {top_k}.")
    stop = params.get("stop_token_ids") or []
    if not isinstance(stop, list):
        raise SGLangAPIError(f"sampling_params: stop_token_ids={stop!r} must be a list of token ids")
    if not params.get("ignore_eos", False):
        stop = list(stop) + [t for t in st.eos_token_ids if t not in stop]
    seed = params.get("sampling_seed")
    if seed is not None and n > 1 and isinstance(seed, int):
        seed = derive_seed(seed, index)  # n copies of one seed would be n equal samples
    raw = {"temperature": params.get("temperature", 1.0), "top_p": params.get("top_p", 1.0), "top_k": top_k,
           "max_new_tokens": params.get("max_new_tokens", 128), "stop_token_ids": tuple(stop), "seed": seed,
           "return_routed_experts": routed}
    for key in ("temperature", "top_p", "max_new_tokens"):
        if raw[key] is None:
            raw[key] = P.SAMPLING_DEFAULTS[key]
    try:
        return SamplingParams.coerce(raw)
    except (ValueError, TypeError) as e:
        raise SGLangAPIError(f"sampling_params: {e}") from None


def _default(value: Any, default: Any) -> bool:
    """Whether a field the server does not read holds nothing (or its SGLang default)."""
    return value == default or value is None or value is False or (
        isinstance(value, int | float | str | list | dict) and not isinstance(value, bool) and not value)


def _output(req: GenerationRequest, res, st: _State, *, logprobs: bool) -> dict[str, Any]:
    c = res.completions[0]
    n_out = len(c.token_ids)
    versions = c.weight_versions or [st.engine.weight_version]
    spans = [{"version": str(v), "start": 0 if i == 0 else None, "end": n_out if i == len(versions) - 1 else None}
             for i, v in enumerate(versions)]  # the engine records which versions, not where they changed
    meta: dict[str, Any] = {
        "id": req.request_id, "finish_reason": P.finish_reason_json(c.finish_reason, token_ids=c.token_ids),
        "prompt_tokens": len(req.prompt_token_ids), "completion_tokens": n_out, "cached_tokens": 0,
        "weight_version": spans[-1]["version"], "weight_versions": spans,
    }
    if logprobs:  # [logprob, token id, text]: no text, the server has no tokenizer (skip_tokenizer_init)
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.log_probs, c.token_ids, strict=True)]
    if c.routed_experts is not None:
        meta["routed_experts"] = P.encode_routed_experts(c.routed_experts)
    return {"output_ids": list(c.token_ids), "meta_info": meta}


def _version(value: Any, engine) -> int:
    if value is None:
        return engine.weight_version
    try:
        return P.parse_version(value)
    except ValueError as e:
        raise SGLangAPIError(f"weight_version: {e}") from None


def _apply(st: _State, tensors: list, version: int, abort_all: bool):
    if abort_all:
        st.engine.abort_all()
    try:
        st.engine.update_weights(tensors, version=version)
    except ValueError as e:
        return _update_result(False, str(e))
    return _update_result(True, f"Succeeded to update model weights. Weight version updated to {version}.")


def _update_result(success: bool, message: str):
    return SafeJSONResponse({"success": success, "message": message, "num_paused_requests": 0},
                            status_code=200 if success else 400)


def _lora_result(success: bool, message: str | None, engine):
    loaded = {name: name for name in (engine.lora_adapters() if hasattr(engine, "lora_adapters") else {})}
    return SafeJSONResponse({"success": success, "error_message": message, "loaded_adapters": loaded},
                            status_code=200 if success else 400)


def _check_tags(tags: Any) -> None:
    if tags is not None and (not isinstance(tags, list) or not set(tags) <= {"weights", "kv_cache", "cuda_graph"}):
        raise SGLangAPIError(f"tags={tags!r} must be a list of 'weights', 'kv_cache', 'cuda_graph' (or null)")


def _read_folder(folder: Path) -> list:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError("no *.safetensors file in it")
    return [item for f in files for item in load_file(str(f)).items()]


def _tensor_metas(obj: dict[str, Any]) -> list[tuple[str, Any, tuple[int, ...]]]:
    import torch

    names, dtypes, shapes = obj["names"], obj["dtypes"], obj["shapes"]
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)):
        raise SGLangAPIError("/update_weights_from_distributed: names, dtypes and shapes must be lists of one length")
    metas = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        torch_dtype = getattr(torch, str(dtype).removeprefix("torch."), None)
        if not isinstance(torch_dtype, torch.dtype):
            raise SGLangAPIError(f"/update_weights_from_distributed: dtype {dtype!r} of {name!r} is not a torch dtype")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise SGLangAPIError(f"/update_weights_from_distributed: shape {shape!r} of {name!r} is not a list of sizes")
        metas.append((str(name), torch_dtype, tuple(shape)))
    return metas


def _join_group(obj: dict[str, Any]):
    """A standalone process group (not the default one) at rank ``rank_offset`` of ``world_size``; the
    trainer's rank 0 hosts the store at ``master_address:master_port`` (SGLang's init_custom_process_group)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    backend = obj["backend"]
    if backend not in ("gloo", "nccl") or (backend == "nccl" and not torch.cuda.is_available()):
        raise ValueError(f"backend={backend!r} is not available here (gloo on CPU, nccl with CUDA)")
    rank, size = obj["rank_offset"], obj["world_size"]
    if not (isinstance(rank, int) and isinstance(size, int) and 0 < rank < size):
        raise ValueError(f"rank_offset={rank!r} must be in [1, world_size={size!r}) (rank 0 is the trainer)")
    store = dist.TCPStore(str(obj["master_address"]), int(obj["master_port"]), size, is_master=False,
                          timeout=timedelta(seconds=60))
    store = dist.PrefixStore(f"sglang/{obj['group_name']}/", store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, size), "cuda"
    return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=300)), "cpu"


def _receive(group, metas) -> list:
    import torch
    import torch.distributed as dist

    pg, device = group
    out = []
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for name, dtype, shape in metas:
        t = torch.empty(shape, dtype=dtype, device=device)
        pg.broadcast([t], opts).wait()
        out.append((name, t.cpu()))
    return out
