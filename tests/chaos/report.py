"""Where the chaos suite's runs leave their record: one JSON file per run under $SAO_CHAOS_REPORT_DIR (unset: none).
tools/reliability_report.py runs the suite with it set and turns the files into docs/reliability.md."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_report(name: str, record: dict[str, Any]) -> None:
    out = os.environ.get("SAO_CHAOS_REPORT_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps({"test": name, **record}, indent=1))
