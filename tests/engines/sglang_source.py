"""SGLang's own source as the spec: the pinned PyPI wheel, downloaded once (`pip download --no-deps`) into a cache
and read as text; classes, fields and routes are taken from its syntax tree. The sglang package is never imported
(its import chain needs triton and CUDA torch); the one file executed, srt/weight_sync/tensor_bucket.py, imports
only torch and the standard library.

SAO_SGLANG_WHEEL=<path> points at a wheel already on disk; otherwise it is fetched into
~/.cache/megatron-sao/wheels (39 MB, once per machine).
"""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

PINNED = "0.5.23"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megatron-sao" / "wheels"


@functools.cache
def wheel(version: str = PINNED) -> Path:
    given = os.environ.get("SAO_SGLANG_WHEEL")
    if given:
        return Path(given)
    CACHE.mkdir(parents=True, exist_ok=True)
    found = sorted(CACHE.glob(f"sglang-{version}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(CACHE),
               f"sglang=={version}"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        found = sorted(CACHE.glob(f"sglang-{version}-*.whl"))
        if not found:
            raise RuntimeError(f"could not fetch the sglang {version} wheel ({' '.join(cmd)}):\n{done.stderr[-2000:]}"
                               "\nset SAO_SGLANG_WHEEL to a downloaded wheel")  # fmt: skip
    return found[-1]


@functools.cache
def source(path: str, version: str = PINNED) -> str:
    """The text of `sglang/<path>` inside the wheel."""
    with zipfile.ZipFile(wheel(version)) as z:
        return z.read(f"sglang/{path}").decode()


def class_fields(path: str, cls: str) -> dict[str, ast.AnnAssign]:
    """{field: its annotated assignment (`.annotation`, `.value` the default or None)} of class `cls` in
    sglang/<path>, with the fields of its base classes defined in the same file (e.g. BaseReq's rid)."""
    classes = {n.name: n for n in ast.walk(ast.parse(source(path))) if isinstance(n, ast.ClassDef)}
    if cls not in classes:
        raise KeyError(f"class {cls} not in sglang/{path}")
    fields: dict[str, ast.AnnAssign] = {}
    for base in classes[cls].bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields.update(class_fields(path, base.id))
    for st in classes[cls].body:
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
            fields[st.target.id] = st
    return fields


def routes(path: str = "srt/entrypoints/http_server.py") -> dict[str, set[str]]:
    """{route: HTTP methods} of the FastAPI app: @app.get/post/put(...) and @app.api_route(..., methods=[...])."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(source(path))):
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)):
                continue
            if not (isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app"):
                continue
            if not dec.args or not isinstance(dec.args[0], ast.Constant):
                continue
            route, kind = str(dec.args[0].value), dec.func.attr
            if kind in ("get", "post", "put", "delete"):
                out.setdefault(route, set()).add(kind.upper())
            elif kind == "api_route":
                for kw in dec.keywords:
                    if kw.arg == "methods" and isinstance(kw.value, ast.List):
                        out.setdefault(route, set()).update(str(e.value) for e in kw.value.elts)  # type: ignore[attr-defined]
    return out


def version_string() -> str:
    """`__version__` as sglang/_version.py assigns it."""
    for node in ast.walk(ast.parse(source("_version.py"))):
        names = [getattr(t, "id", "") for t in node.targets] if isinstance(node, ast.Assign) else []
        if "__version__" in names and isinstance(node.value, ast.Constant):  # type: ignore[union-attr]
            return str(node.value.value)  # type: ignore[union-attr]
    raise KeyError("no __version__ in sglang/_version.py")


@functools.cache
def tensor_bucket_module() -> ModuleType:
    """SGLang's srt/weight_sync/tensor_bucket.py, executed alone (it imports only torch, dataclasses, typing)."""
    text = source("srt/weight_sync/tensor_bucket.py")
    imported = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= {"torch", "dataclasses", "typing"}, f"tensor_bucket.py now imports {imported}"
    module = ModuleType("_sglang_tensor_bucket")
    sys.modules[module.__name__] = module  # dataclasses look their module up there
    exec(compile(text, "sglang/srt/weight_sync/tensor_bucket.py", "exec"), module.__dict__)
    return module
