"""A small HTTP client for the CPN API; the only way `cpnctl` and agents reach the server.

Server errors come back as :class:`ApiError` carrying the server's code, message and field, so
the CLI prints what the server said; transport failures become ApiError with code "unreachable".
"""

from __future__ import annotations

from typing import Any

import httpx

import cpn

__all__ = ["ApiError", "Client"]


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 details: dict[str, Any] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field
        self.details = details or {}

    def __str__(self) -> str:
        return self.message


class Client:
    def __init__(self, server: str, token: str | None = None, *, timeout: float = 30.0):
        if not server:
            raise ApiError(0, "no_server", "no server configured: use --server, CPN_SERVER or "
                           "`cpnctl config set-context`")
        self.server = server.rstrip("/")
        headers = {"User-Agent": f"cpnctl/{cpn.__version__}"}
        token = (token or "").strip()  # a token pasted with its line break still works
        if token:
            if not all("!" <= c <= "~" for c in token):
                raise ApiError(0, "bad_token", "the token holds a space, line break or other character a token "
                               "never has: pass only the token that `cpn token create` printed (cpn_...)", field="token")
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(base_url=self.server, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None,
                headers: dict[str, str] | None = None) -> Any:
        try:
            response = self._http.request(method, path, json=json, params=params, headers=headers)
        except httpx.TransportError as exc:
            raise ApiError(0, "unreachable", f"cannot reach {self.server}: {exc}") from exc
        return self._decode(response)

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, json: Any = None, headers: dict[str, str] | None = None) -> Any:
        return self.request("POST", path, json=json, headers=headers)

    def put(self, path: str, json: Any) -> Any:
        return self.request("PUT", path, json=json)

    def patch(self, path: str, json: Any) -> Any:
        return self.request("PATCH", path, json=json)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    def exists(self, path: str) -> bool:
        """HEAD: 200 → True, 404 → False, anything else raises."""
        try:
            response = self._http.head(path)
        except httpx.TransportError as exc:
            raise ApiError(0, "unreachable", f"cannot reach {self.server}: {exc}") from exc
        if response.status_code == 404:
            return False
        self._decode(response)
        return True

    def put_bytes(self, path: str, data: bytes, timeout: float = 600.0) -> Any:
        """PUT a binary body (code bundles)."""
        try:
            response = self._http.put(path, content=data, timeout=timeout,
                                      headers={"Content-Type": "application/octet-stream"})
        except httpx.TransportError as exc:
            raise ApiError(0, "unreachable", f"cannot reach {self.server}: {exc}") from exc
        return self._decode(response)

    def download(self, path: str, dest: Any, progress: Any = None) -> int:
        """Stream a binary GET into the open file ``dest``; ``progress(done, total)`` after each chunk."""
        try:
            with self._http.stream("GET", path, timeout=None) as response:
                if response.status_code >= 400:
                    response.read()
                    self._decode(response)
                total = int(response.headers.get("Content-Length") or 0)
                done = 0
                for chunk in response.iter_bytes(1 << 20):
                    dest.write(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(done, total)
                return done
        except httpx.TransportError as exc:
            raise ApiError(0, "unreachable", f"cannot reach {self.server}: {exc}") from exc

    def stream_lines(self, path: str, params: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        """Yield lines of a streaming response (logs -f)."""
        try:
            with self._http.stream("GET", path, params=params, timeout=None) as response:
                if response.status_code >= 400:
                    response.read()
                    self._decode(response)
                yield from response.iter_lines()
        except httpx.TransportError as exc:
            raise ApiError(0, "unreachable", f"cannot reach {self.server}: {exc}") from exc

    @staticmethod
    def _decode(response: httpx.Response) -> Any:
        try:
            body = response.json() if response.content else None
        except ValueError:
            body = None
        if response.status_code >= 400:
            err = (body or {}).get("error") if isinstance(body, dict) else None
            if isinstance(err, dict):
                raise ApiError(response.status_code, err.get("code", "error"), err.get("message", ""),
                               err.get("field"), err.get("details"))
            said = " ".join(response.text.split())[:200] or response.reason_phrase or "no body"
            raise ApiError(response.status_code, "http_error", f"HTTP {response.status_code} from {response.request.url}, "
                           f"not a CPN API answer ({said}): is the server address right?")
        return body
