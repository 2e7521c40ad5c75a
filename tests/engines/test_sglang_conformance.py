"""The SGLang adapter and the embedded server against SGLang 0.5.23's own API definition.

``sglang_0_5_23_schema.json`` is derived from the released wheel (``scripts/sglang_schema.py``: field
names and defaults of the request classes, the server's routes; its sha256 is in the file). The tests
check, on the wire, that every body the adapter sends uses only fields of the pinned release, and that the
embedded server accepts every field of those classes at its default (a client or sglang-router sending the
full request is served, not refused). With ``SGLANG_WHEEL`` pointing at the wheel (and msgspec installed),
SGLang's own generated JSON contract (``sglang.api.v1.api_types.GenerateRequest``, the gate of its
``/generate``) decodes the adapter's bodies too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import torch
from fastapi import FastAPI, Request

from tandem.core.protocols import SamplingParams
from tandem.engines.inference.sglang import protocol as P
from tests.engines.sglang_helpers import adapter, sglang_server, stub_server

SCHEMA = json.loads((Path(__file__).parent / "sglang_0_5_23_schema.json").read_text())
CLASSES = SCHEMA["classes"]
BASE = set(CLASSES["BaseReq"])  # rid, http_worker_ipc: every control request has them


def _bodies() -> list[dict]:
    sampling = SamplingParams(n=2, temperature=0.7, top_k=5, stop_token_ids=(2,), return_routed_experts=True)
    one = P.generate_body([5, 6, 7], sampling, rids=["a/0", "a/1"], seeds=[1, 2], max_new_tokens=8, lora="x")
    plain = P.generate_body([9], SamplingParams(temperature=0), rids=["b/0"], seeds=[3], max_new_tokens=4)
    return [one, plain, P.merge_bodies([one, plain]), *P.split_body(one)]


def test_the_schema_is_the_pinned_release():
    assert SCHEMA["sglang"] == P.PINNED_VERSION == "0.5.23" and len(SCHEMA["sha256"]) == 64


@pytest.mark.parametrize("body", _bodies(), ids=["n2-lora-routed", "greedy", "merged", "split0", "split1"])
def test_generate_bodies_use_only_fields_of_the_release(body):
    assert set(body) <= set(CLASSES["GenerateReqInput"]), set(body) - set(CLASSES["GenerateReqInput"])
    params = body["sampling_params"]
    for p in params if isinstance(params, list) else [params]:
        assert set(p) <= set(CLASSES["SamplingParams"]), set(p) - set(CLASSES["SamplingParams"])
    api = {k for k, v in CLASSES["SamplingParams"].items()
           if k not in ("stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized",
                        "ebnf_full_assistant")}
    assert set(P.SAMPLING_DEFAULTS) == api  # the server's list of SGLang's sampling keys is the release's


def test_control_bodies_use_only_fields_of_the_release():
    pairs = [
        (P.disk_update_body("/x", 3), "UpdateWeightFromDiskReqInput"),
        (P.init_group_body(address="a", port=1, rank_offset=1, world_size=2, group="g", backend="gloo"),
         "InitWeightsUpdateGroupReqInput"),
        (P.distributed_update_body(["w"], ["float32"], [[2]], group="g", version=3), "UpdateWeightsFromDistributedReqInput"),
    ]
    for body, cls in pairs:
        fields = set(CLASSES[cls]) | BASE
        assert set(body) <= fields, (cls, set(body) - fields)
        required = {k for k, v in CLASSES[cls].items() if v == "<required>"}
        assert required <= set(body), (cls, required - set(body))


def test_the_adapters_calls_on_the_wire_use_the_releases_endpoints_and_fields(tmp_path):
    """A recording server stands in for SGLang: every path and body the adapter sends is checked."""
    seen: list[tuple[str, dict]] = []
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def record(path: str, request: Request):
        body = await request.body()
        seen.append(("/" + path, json.loads(body) if body else {}))
        if path == "server_info":
            return {"version": "0.5.23", "weight_version": "default", "context_length": 4096, "internal_states": [{}]}
        return {"success": True, "message": "ok"}

    with stub_server(app) as url:
        engine = adapter(url)
        engine.update_weights([("model.norm.weight", torch.ones(64))], version=1)
        engine.pause_generation()
        engine.continue_generation()
        engine.sleep()
        engine.wake_up()
        engine.flush_cache()
        engine.load_lora_adapter_from_path("x", str(tmp_path))
        engine.health()
        engine.close()
    classes = {"/update_weights_from_disk": "UpdateWeightFromDiskReqInput", "/pause_generation": "PauseGenerationReqInput",
               "/continue_generation": "ContinueGenerationReqInput", "/abort_request": "AbortReq",
               "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
               "/resume_memory_occupation": "ResumeMemoryOccupationReqInput", "/load_lora_adapter": "LoadLoRAAdapterReqInput"}
    assert {p for p, _ in seen} >= set(classes) - {"/abort_request"}
    for path, body in seen:
        assert path in SCHEMA["endpoints"], path
        if path in classes:
            fields = set(CLASSES[classes[path]]) | BASE
            assert set(body) <= fields, (path, set(body) - fields)


def test_the_server_serves_only_endpoints_of_the_release():
    from tandem.engines.inference.sglang.server import create_sglang_app
    from tandem.engines.inference.torch import TorchEngine, TorchEngineConfig
    from tandem.models import ModelConfig, resolve_model

    engine = TorchEngine(TorchEngineConfig(model=ModelConfig(name="tiny-llama"), max_model_len=64, max_num_seqs=1))
    app = create_sglang_app(engine, model_path=str(resolve_model("tiny-llama"))).app  # inside BodySizeLimit
    paths = {r.path for r in app.routes if not r.path.startswith(("/docs", "/openapi", "/redoc"))}
    assert paths <= set(SCHEMA["endpoints"]), paths - set(SCHEMA["endpoints"])
    engine.close()


def _literal_defaults(cls: str) -> dict:
    return {k: v for k, v in CLASSES[cls].items() if not (isinstance(v, str) and v.startswith("<"))}


def test_the_server_accepts_every_field_of_the_release_at_its_default():
    """A body holding all 72 GenerateReqInput fields (and every sampling key) at their defaults is served;
    so are the control requests with every field of their class."""
    body = _literal_defaults("GenerateReqInput") | {"input_ids": [5, 6, 7], "return_logprob": True,
                                                   "sampling_params": _literal_defaults("SamplingParams") | {
                                                       "max_new_tokens": 3, "top_k": -1}}
    with sglang_server() as url:
        r = httpx.post(f"{url}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 3 and len(r.json()["meta_info"]["output_token_logprobs"]) == 3
        for path, cls, extra in [
            ("/pause_generation", "PauseGenerationReqInput", {}),
            ("/continue_generation", "ContinueGenerationReqInput", {}),
            ("/release_memory_occupation", "ReleaseMemoryOccupationReqInput", {}),
            ("/resume_memory_occupation", "ResumeMemoryOccupationReqInput", {}),
            ("/abort_request", "AbortReq", {"rid": "none"}),
            ("/update_weights_from_disk", "UpdateWeightFromDiskReqInput", {"model_path": "/nonexistent"}),
            ("/destroy_weights_update_group", "DestroyWeightsUpdateGroupReqInput", {}),
        ]:
            full = _literal_defaults(cls) | _literal_defaults("BaseReq") | extra
            r = httpx.post(f"{url}{path}", json=full, timeout=60)
            assert "unknown field" not in r.text and r.status_code in (200, 400), (path, r.text)


def _api_types():
    """SGLang's generated API types from the wheel named by SGLANG_WHEEL (pure Python + msgspec)."""
    import importlib.util
    import sys
    import zipfile

    wheel = os.environ.get("SGLANG_WHEEL")
    if not wheel or not Path(wheel).is_file():
        pytest.skip("set SGLANG_WHEEL to sglang-0.5.23-*.whl (pip download sglang==0.5.23 --no-deps) to check "
                    "against SGLang's own /generate contract")
    if importlib.util.find_spec("msgspec") is None:
        pytest.skip("SGLang's API types need msgspec (pip install msgspec)")
    source = zipfile.ZipFile(wheel).read("sglang/api/v1/api_types.py")
    spec = importlib.util.spec_from_loader("sglang_api_types_v1", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    exec(compile(source, "sglang/api/v1/api_types.py", "exec"), module.__dict__)  # noqa: S102 - the pinned wheel
    return module


@pytest.mark.parametrize("body", _bodies(), ids=["n2-lora-routed", "greedy", "merged", "split0", "split1"])
def test_sglangs_own_generate_contract_accepts_the_adapters_bodies(body):
    types = _api_types()
    decoded = types.GenerateRequest.from_json_value(body)
    assert decoded.input_ids == body["input_ids"] and decoded.return_logprob is True
    with pytest.raises(types.JsonContractError):  # and the gate is real: a wrong type is refused
        types.GenerateRequest.from_json_value(body | {"input_ids": "five"})
