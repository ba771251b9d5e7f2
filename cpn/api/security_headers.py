"""Security headers on every response, the portal's and the API's (issue 35, L4).

The portal (web/) loads only its own script, stylesheet and world.json, and talks to this server with
fetch, so the policy allows 'self' and nothing inline; the favicon is a data: URL. No page may frame
the portal (clickjacking), and no response is sniffed into another type.
"""

from __future__ import annotations

from aiohttp import web

CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
                           "form-action 'self'")
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


async def add(_: web.Request, response: web.StreamResponse) -> None:
    """aiohttp's on_response_prepare: runs for handlers, static files, errors and streams alike."""
    for name, value in HEADERS.items():
        response.headers.setdefault(name, value)
