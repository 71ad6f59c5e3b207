"""The JSON error body every answer of ``rd2h proxy`` uses (OpenAI's shape)."""

from __future__ import annotations

from typing import Any


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "rd2h_proxy", "code": status}}
