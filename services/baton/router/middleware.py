"""The router's aiohttp middlewares: OpenAI-shaped errors for whatever a handler or aiohttp
raises, and the caller's tenant from its API key (`tenants.py`)."""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from baton.common.errors import OpenAIError
from baton.router.tenants import Tenant, Tenants


def error_response(err: OpenAIError) -> web.Response:
    return web.Response(body=err.json_bytes(), status=err.status, headers=err.headers,
                        content_type="application/json")


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Unknown paths, wrong methods, big bodies and handlers' OpenAIErrors: OpenAI-shaped."""
    try:
        return await handler(request)
    except OpenAIError as err:
        return error_response(err)
    except web.HTTPRequestEntityTooLarge:
        return error_response(OpenAIError(413, "the request body is too large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(OpenAIError(exc.status, exc.reason))


TENANT = web.RequestKey("tenant", Tenant)  # who is calling, set by `authenticate`
# with keys configured; probes and scrapers stay open
PROTECTED = ("/v1/", "/workers", "/tokenize", "/detokenize")


def authenticate(tenants: Tenants) -> Middleware:
    """With any key configured, the OpenAI paths (/v1/…, /tokenize, /detokenize) and
    /workers (worker URLs and loads) need `Authorization: Bearer <key>`, as vLLM's
    --api-key; /health, /ready and /metrics stay open. Without keys every request is
    tenant `default`."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        tenant = tenants.anonymous
        if tenant is None and request.path.startswith(PROTECTED):
            tenant = tenants.identify(request.headers.get("Authorization"))
            if tenant is None:
                return error_response(OpenAIError(401, "invalid or missing API key (send "
                                               "Authorization: Bearer <key>)",
                                          code="invalid_api_key"))
        if tenant is not None:
            request[TENANT] = tenant
        return await handler(request)
    return check
