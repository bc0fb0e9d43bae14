"""The front end: an OpenAI-compatible HTTP API over the Placement Controller and the inference instances
(docs/inference.md; README, "The front end").

Resources, relative to the front end's base URI:

* ``POST v1/completions``, ``POST v1/chat/completions`` (whole and streamed: :mod:`kvsp_frontend.openai_routes`; the
  parameters: :mod:`kvsp_frontend.params`);
* ``GET v1/models``, ``GET v1/models/{model}``;
* ``POST tokenize`` (``{"prompt"}`` or ``{"messages"}``) -> ``{"count", "max_model_len", "tokens"}``, ``POST
  detokenize`` (``{"tokens"}``) -> ``{"prompt"}`` (vLLM's shapes);
* ``GET health`` (200, empty) and ``GET version`` (``{"version"}``), without authentication; ``GET metrics``.

Every other request authenticates with a policy-listed client certificate or ``Authorization: Bearer KEY``, within
its principal's limits (:mod:`kvsp_frontend.auth`); errors are OpenAI's shape (:mod:`kvsp_frontend.errors`).
Request bodies are JSON objects of at most ``max_body_bytes`` (16 MiB), read against that limit as they arrive
whatever the framing (413 as soon as they pass it), nested at most ``kvsp_quic.fields.MAX_JSON_DEPTH`` deep (400).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from http3.asgi_types import ASGIApp
from http3.client import TransportError
from kvsp_frontend.auth import ApiAuthentication, PrincipalLimits
from kvsp_frontend.errors import InvalidParameter, ModelNotFound, install_errors
from kvsp_frontend.openai_routes import generate
from kvsp_frontend.params import chat_params, check_keys, check_model, completion_params, prompts_of
from kvsp_frontend.session import Completion, Frontend, FrontendStats, Tokenizer
from kvsp_frontend.text import ChatTemplateError
from kvsp_http.app_kit import BasePath, read_body_within
from kvsp_http.metrics_app import metrics_route
from kvsp_quic import __version__
from kvsp_quic import fields as f
from kvsp_quic.auth import Policy
from kvsp_quic.metrics import Registry
from kvsp_quic.problems import BadRequest, Problem

__all__ = ["Completion", "Frontend", "FrontendStats", "Tokenizer", "frontend_app"]

log = logging.getLogger("kvsp.frontend")

MAX_BODY = 16 << 20


def _json(obj: Any, status: int = 200) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), status_code=status, media_type="application/json",
                    headers={"cache-control": "no-store"})


async def read_json_object(request: Request, limit: int = MAX_BODY) -> dict[str, Any]:
    """The JSON object of the request, read as it arrives and refused (413) as soon as it passes *limit* octets --
    whatever the framing: a declared ``Content-Length``, HTTP/1.1 chunks, HTTP/2 or HTTP/3 DATA frames -- without
    buffering more; nesting deeper than :data:`kvsp_quic.fields.MAX_JSON_DEPTH` is a 400 (issue 13)."""
    raw = await read_body_within(request, limit)
    try:
        body = f.loads_json(raw)
    except BadRequest as exc:  # not JSON, a duplicate member, NaN, or nested too deeply: the reason is the message
        raise BadRequest(f"the body must be a JSON object: {exc.detail}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


async def cancel_session(frontend: Frontend, run: Completion) -> None:
    """``DELETE {pc}sessions/{id}`` (docs/wire.md, "Cancelling a session"): the PC ends the session at its instance
    and frees its slot. Best effort: a PC without the resource, or one that does not answer, is logged."""
    try:
        ended = await frontend.api.cancel_session(frontend.pc, run.session, timeout=frontend.placement_timeout_s)
    except (TransportError, OSError, Problem) as exc:
        log.warning("session %s: the cancel did not reach the PC (%s)", run.session, exc)
        return
    frontend.stats.cancelled += 1
    log.info("session %s: %s", run.session, "cancelled" if ended else "cancelled (the PC no longer had it)")


def frontend_app(frontend: Frontend, policy: Policy, *, base_path: str = "/",
                 limits: PrincipalLimits | None = None, max_body_bytes: int = MAX_BODY) -> ASGIApp:
    """The front end's ASGI app; request bodies above *max_body_bytes* get 413 (:func:`read_json_object`)."""
    async def _body(request: Request) -> dict[str, Any]:
        return await read_json_object(request, max_body_bytes)

    async def cancel(run: Completion) -> None:
        await cancel_session(frontend, run)

    async def completions(request: Request) -> Response:
        params = completion_params(await _body(request), frontend.tokenizer, frontend.limits)
        return await generate(request, frontend, params, chat=False, cancel=cancel)

    async def chat_completions(request: Request) -> Response:
        body = await _body(request)
        try:
            params = chat_params(body, frontend.tokenizer, frontend.limits, frontend.chat_template)
        except ChatTemplateError as exc:
            raise InvalidParameter("messages", str(exc)) from None
        return await generate(request, frontend, params, chat=True, cancel=cancel)

    def model_card() -> dict[str, Any]:
        return {"id": frontend.model_name, "object": "model", "created": 0, "owned_by": "kvsp-quic",
                "root": frontend.model_name, "parent": None, "max_model_len": frontend.context}

    async def models(request: Request) -> Response:
        return _json({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        if name != frontend.model_name:
            raise ModelNotFound(name, frontend.model_name)
        return _json(model_card())

    async def tokenize(request: Request) -> Response:
        body = await _body(request)
        check_keys(body, frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"}))
        check_model(body, frontend.limits)
        if body.get("add_special_tokens") not in (None, False) or body.get("add_generation_prompt") not in \
                (None, True):
            raise InvalidParameter("add_special_tokens", "special tokens are never added; the generation prompt "
                                                         "always is", code="unsupported_parameter")
        if ("prompt" in body) == ("messages" in body):
            raise InvalidParameter("prompt", "give either prompt (a string) or messages")
        if "prompt" in body:
            if not isinstance(body["prompt"], str):
                raise InvalidParameter("prompt", "must be a string")
            tokens = frontend.tokenizer.encode(body["prompt"]) if body["prompt"] else []
        else:
            try:
                params = chat_params({"messages": body["messages"]}, frontend.tokenizer, frontend.limits,
                                     frontend.chat_template)
            except ChatTemplateError as exc:
                raise InvalidParameter("messages", str(exc)) from None
            tokens = list(params.choices[0].prompt)
        return _json({"count": len(tokens), "max_model_len": frontend.context, "tokens": tokens})

    async def detokenize(request: Request) -> Response:
        body = await _body(request)
        check_keys(body, frozenset({"model", "tokens"}))
        check_model(body, frontend.limits)
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise InvalidParameter("tokens", "an array of token ids is required")
        ids = list(prompts_of(tokens, frontend.tokenizer, frontend.limits)[0][0]) if tokens else []
        return _json({"prompt": frontend.tokenizer.decode(ids)})

    async def health(request: Request) -> Response:
        return Response(b"", headers={"cache-control": "no-store"})

    async def version(request: Request) -> Response:
        return _json({"version": __version__})

    registry = Registry()
    registry.counter("kvsp_frontend_events_total", "Sessions, failovers, tokens delivered and tokens discarded",
                     ("event",)).collect(lambda: [({"event": name}, float(value))
                                                  for name, value in vars(frontend.stats).items()])
    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        metrics_route(registry),
    ])
    install_errors(app)
    return BasePath(ApiAuthentication(app, policy, frontend.keyer.scope_id, limits), base_path)
