"""Where a request goes inside the app: its path below the point the app is mounted at.

Owns: `route_path`. Must not: route (Starlette does) or import the app.

An ASGI server that mounts the app under a prefix (Ray Serve's `route_prefix="/api"`, a proxy
with `--root-path`) sets `scope["root_path"]` to it and, as the ASGI spec now says, keeps it in
`scope["path"]` ("/api/v1/models"); Starlette routes on what follows. The middlewares that pick
requests by path (API key, concurrency limit) and the Ray ingress, which forwards a request to a
replica's app mounted at "/", must look at the same thing.
"""

from __future__ import annotations

from starlette.types import Scope


def route_path(scope: Scope) -> str:
    """The request's path without the app's mount point (`root_path`), as Starlette routes it;
    a server that strips the prefix itself passes the path unchanged."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root) :] or "/"
    return path
