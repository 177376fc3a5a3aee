"""SGLang-compatible information routes: GET /server_info, /model_info, /version.

Routers built for SGLang (sglang-router's worker discovery) probe ``/server_info`` and ``/model_info``
and fall back to the deprecated ``/get_server_info`` / ``/get_model_info`` after a 404; we serve all four.
The shapes follow SGLang's HTTP server: ``/server_info`` is every setting by flat name plus ``version``
(``public_info``), ``/model_info`` names the model (path, tokenizer path, whether it
generates, the Hugging Face ``model_type`` and ``architectures``), ``/version`` is ``{"version": ...}``.
All are open (no API key), like /health.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ddtree_serve.server.config import ServerConfig, config_fields
from ddtree_serve.server.sampling_defaults import sampling_defaults


def public_info(config: ServerConfig) -> dict[str, Any]:
    """Every setting by flat name, for ``GET /server_info`` (the API key and the seal key are withheld), plus
    ``speculative_lossy``: whether accept thresholds below 1 make sampled verification lossy."""
    out = {flat: getattr(getattr(config, area), f.name) for flat, area, _, f in config_fields()}
    out["api_key"] = None if config.server.api_key is None else "(set)"
    out["reasoning_seal_key"] = None if config.server.reasoning_seal_key is None else "(set)"
    out["speculative_lossy"] = config.speculative.lossy
    return out


def server_version() -> str:
    """The installed ddtree-serve distribution's version ("unknown" when run from an uninstalled tree)."""
    try:
        return metadata.version("ddtree-serve")
    except metadata.PackageNotFoundError:
        return "unknown"


def model_info(config: ServerConfig) -> dict[str, Any]:
    """SGLang's ``/model_info`` fields for the model at ``config.model.model_path`` (a resolved local
    directory): ``model_type`` / ``architectures`` come from its config.json (``None`` when unreadable)."""
    path = config.model.model_path
    hf: dict[str, Any] = {}
    try:
        loaded = json.loads((Path(path) / "config.json").read_text())
        hf = loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        pass
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    return {
        "model_path": path,
        "tokenizer_path": path,  # the tokenizer is always loaded from the model directory
        "served_model_name": config.model.served_model_name or path,
        "is_generation": True,
        "preferred_sampling_params": sampling_defaults(config.server.sampling_defaults, path) or None,
        "weight_version": "default",
        "has_image_understanding": isinstance(hf.get("vision_config"), dict)  # a MoonViT tower (kimi_k25.py)
        and "vt_hidden_size" in hf["vision_config"] and "media_placeholder_token_id" in hf
        and config.server.max_images_per_request > 0,
        "has_audio_understanding": False,
        "model_type": hf.get("model_type") or text.get("model_type"),
        "architectures": hf.get("architectures") or text.get("architectures"),
    }


def add_info_routes(app: FastAPI, config: ServerConfig) -> None:
    version = server_version()
    info = model_info(config)

    async def get_server_info() -> JSONResponse:
        return JSONResponse({**public_info(config), "version": version})

    async def get_model_info() -> JSONResponse:
        return JSONResponse(info)

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, get_server_info, methods=["GET"],
                          summary="every setting by flat name (API key withheld) and the version")
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, get_model_info, methods=["GET"], summary="the served model (SGLang's shape)")

    @app.get("/version", summary="the server's version")
    async def get_version() -> JSONResponse:
        return JSONResponse({"version": version})
