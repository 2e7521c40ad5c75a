"""Derive the SGLang API schema the tests check against, from an SGLang wheel (no SGLang import).

    pip download sglang==0.5.23 --no-deps -d /tmp/sgw
    python scripts/sglang_schema.py /tmp/sgw/sglang-0.5.23-*.whl tests/engines/sglang_0_5_23_schema.json

Reads, with Python's ``ast`` only: the request classes of ``sglang/srt/managers/io_struct.py`` and
``SamplingParams`` of ``sglang/srt/sampling/sampling_params.py`` (field names and literal defaults), and the
paths of ``sglang/srt/entrypoints/http_server.py``'s routes. Writes them with the wheel's name and sha256.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import zipfile
from pathlib import Path

CLASSES = {
    "sglang/srt/managers/io_struct.py": [
        "GenerateReqInput", "AbortReq", "UpdateWeightFromDiskReqInput", "InitWeightsUpdateGroupReqInput",
        "UpdateWeightsFromDistributedReqInput", "DestroyWeightsUpdateGroupReqInput", "PauseGenerationReqInput",
        "ContinueGenerationReqInput", "ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput",
        "LoadLoRAAdapterReqInput", "UnloadLoRAAdapterReqInput", "BaseReq",
    ],
    "sglang/srt/sampling/sampling_params.py": ["SamplingParams"],
}
SERVER = "sglang/srt/entrypoints/http_server.py"
_NO_DEFAULT = "<required>"


def _default(node: ast.expr | None):
    if node is None:
        return _NO_DEFAULT
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "field":  # dataclasses.field(default=...)
        for kw in node.keywords:
            if kw.arg == "default":
                return _default(kw.value)
        return "<factory>"
    try:
        return ast.literal_eval(node)
    except ValueError:
        return f"<{ast.unparse(node)}>"


def class_fields(source: str, names: list[str]) -> dict[str, dict[str, object]]:
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in names:
            out[node.name] = {stmt.target.id: _default(stmt.value) for stmt in node.body
                              if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)}
    missing = sorted(set(names) - set(out))
    if missing:
        raise SystemExit(f"classes not found: {missing}")
    return out


def routes(source: str) -> list[str]:
    paths = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            for dec in node.decorator_list:
                if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                        and getattr(dec.func.value, "id", None) == "app" and dec.args
                        and isinstance(dec.args[0], ast.Constant) and isinstance(dec.args[0].value, str)):
                    paths.add(dec.args[0].value)
    return sorted(paths)


def main(wheel: str, out: str) -> None:
    data = Path(wheel).read_bytes()
    schema: dict[str, object] = {"wheel": Path(wheel).name, "sha256": hashlib.sha256(data).hexdigest(),
                                 "files": sorted([*CLASSES, SERVER]), "classes": {}}
    with zipfile.ZipFile(wheel) as z:
        version = next((n.removesuffix(".dist-info/METADATA").split("-")[1] for n in z.namelist()
                        if n.endswith(".dist-info/METADATA")), "?")
        schema["sglang"] = version
        for path, names in CLASSES.items():
            schema["classes"] |= class_fields(z.read(path).decode(), names)
        schema["endpoints"] = routes(z.read(SERVER).decode())
    Path(out).write_text(json.dumps(schema, indent=1, sort_keys=True, default=str) + "\n")
    print(f"{out}: SGLang {version}, {len(schema['classes'])} classes, {len(schema['endpoints'])} endpoints")


if __name__ == "__main__":
    main(*sys.argv[1:3])
