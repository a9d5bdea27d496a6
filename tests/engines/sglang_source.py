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
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

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


TRITON = "3.9.0"
"""The Triton release SGLang's kernels are run with under Triton's interpreter (CPU tensors, no GPU)."""


@functools.cache
def triton_path(version: str = TRITON) -> Path:
    """A folder holding `triton` alone (`pip install --target`, once per machine, ~8 s), put on the path of the
    subprocess that runs a kernel, never into the test environment: megatron-core imports triton when it can, and
    every process of the suite would pay its import. SAO_TRITON_PATH=<folder> points at one already there."""
    given = os.environ.get("SAO_TRITON_PATH")
    if given:
        return Path(given)
    target = CACHE.parent / f"triton-{version}"
    if not (target / "triton" / "__init__.py").exists():
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
               f"triton=={version}"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if not (target / "triton" / "__init__.py").exists():
            raise RuntimeError(f"could not install triton {version} ({' '.join(cmd)}):\n{done.stderr[-2000:]}"
                               "\nset SAO_TRITON_PATH to a folder holding triton")  # fmt: skip
    return target


def run_kernel(path: str, call: str, inputs: dict[str, Any], lift: tuple[str, ...] = ()) -> Any:
    """Run SGLang's Triton kernel module `sglang/<path>` under Triton's interpreter in a subprocess, on CPU tensors:
    `call` is an expression over the module's names and `x` (each value of `inputs` in turn, passed by torch.save);
    `lift`: lines of the module removed first (asserts that the tensors are on CUDA). {key: result}."""
    text = source(path)
    for line in lift:
        if line not in text:
            raise KeyError(f"sglang/{path} no longer holds {line!r}: update the test")
        text = text.replace(line, "pass")
    with tempfile.TemporaryDirectory() as tmp:
        torch.save({"text": text, "inputs": inputs, "call": call, "path": path}, f"{tmp}/job.pt")
        script = (
            "import sys, torch\n"
            f"job = torch.load({tmp + '/job.pt'!r}, weights_only=True)\n"
            "ns = {'__name__': 'sglang_kernel'}\n"
            "exec(compile(job['text'], 'sglang/' + job['path'], 'exec'), ns)\n"
            "out = {k: eval(job['call'], dict(ns, x=x)) for k, x in job['inputs'].items()}\n"
            f"torch.save(out, {tmp + '/out.pt'!r})\n"
        )
        env = dict(os.environ, TRITON_INTERPRET="1",
                   PYTHONPATH=os.pathsep.join([str(triton_path()), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"sglang/{path} under Triton's interpreter failed:\n{done.stderr[-3000:]}")
        return torch.load(f"{tmp}/out.pt", weights_only=True)
