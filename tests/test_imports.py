"""Layering rules: the core imports only stdlib/torch/numpy; nothing imports an engine eagerly."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import tandem

PKG = Path(tandem.__file__).parent
ENGINES = ("vllm", "sglang", "megatron", "ray", "cupy")


def _imports(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods.add(node.module)
    return mods


def test_core_imports_only_stdlib_torch_numpy():
    allowed_roots = set(sys.stdlib_module_names) | {"torch", "numpy", "__future__"}
    files = sorted((PKG / "core").rglob("*.py"))
    assert files, "tandem/core has no modules"
    offenders = []
    for f in files:
        for mod in _imports(f):
            root = mod.split(".")[0]
            if mod.startswith("tandem.core") or root in allowed_roots:
                continue
            offenders.append(f"{f.relative_to(PKG)} imports {mod}")
    assert not offenders, offenders


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint('\\n'.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {m.split(".")[0] for m in out.split()}


def test_import_tandem_and_core_load_no_engine():
    loaded = _loaded_after("import tandem, tandem.core, tandem.core.protocols, tandem.config, tandem.plugins")
    assert not loaded & set(ENGINES), loaded & set(ENGINES)
    # the core must not even pull in transformers
    loaded_core = _loaded_after("import tandem.core.protocols")
    assert "transformers" not in loaded_core


def test_cli_help_loads_no_engine():
    code = "import sys\nfrom tandem.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass"
    loaded = _loaded_after(code)
    assert not loaded & set(ENGINES), loaded & set(ENGINES)


def test_cli_help_runs():
    r = subprocess.run([sys.executable, "-m", "tandem", "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    assert "config" in r.stdout and "models" in r.stdout
