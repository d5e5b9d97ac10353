"""A local model hub for tests: serves model folders with the HTTP API that ``huggingface_hub``
uses for ``snapshot_download`` (the real client, unmodified, pointed here with ``endpoint=``).

Endpoints (what ``snapshot_download`` 1.x/2.x calls, read from its source):

- ``GET /api/models/{repo}/revision/{revision}`` -> ``{"id", "sha", "siblings"}``: resolves a
  branch or tag to a commit (skipped by the client when the revision already is a commit);
- ``GET /api/models/{repo}/tree/{commit}?recursive=...`` -> the file list (one page, no ``Link``);
- ``HEAD``/``GET /{repo}/resolve/{commit}/{path}`` -> the file, with ``X-Repo-Commit``,
  ``ETag`` and ``Content-Length`` headers.

Errors carry the hub's ``X-Error-Code`` header (``RepoNotFound``, ``RevisionNotFound``,
``EntryNotFound``), which is how the client tells them apart. With ``token`` set, every request
must carry ``Authorization: Bearer <token>``, else 401 ``RepoNotFound`` (as the hub answers for
private repositories). Every request is recorded in ``requests`` so tests can assert "no
network". Not covered: LFS/Xet transfers, pagination, gated-repo flows, redirects to a CDN.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import pathlib
import re
import threading
import urllib.parse

_API = re.compile(r"^/api/models/(?P<repo>[^/]+(?:/[^/]+)?)/(?P<kind>revision|tree)/(?P<rev>[^/?]+)")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+(?:/[^/]+)?)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


class HubMirror:
    """``repos``: repo id -> (folder, {revision name: commit}); the folder's files are every revision's content."""

    def __init__(self, repos: dict[str, tuple[pathlib.Path, dict[str, str]]], token: str | None = None) -> None:
        self.repos = repos
        self.token = token
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, authorization)
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "HubMirror":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _commit(self, repo: str, rev: str) -> str | None:
        commits = self.repos[repo][1]
        return commits.get(rev) or (rev if rev in commits.values() else None)

    def _files(self, repo: str) -> list[pathlib.Path]:
        folder = self.repos[repo][0]
        return sorted(p for p in folder.rglob("*") if p.is_file())

    def _handler(self):  # type: ignore[no-untyped-def]
        mirror = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet test output
                pass

            def _error(self, status: int, code: str, message: str) -> None:
                body = json.dumps({"error": message}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _json(self, data: object) -> None:
                body = json.dumps(data).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _serve(self) -> None:
                auth = self.headers.get("Authorization")
                path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
                mirror.requests.append((self.command, path, auth))
                if mirror.token and auth != f"Bearer {mirror.token}":
                    return self._error(401, "RepoNotFound", "Repository not found")
                api, resolve = _API.match(path), _RESOLVE.match(path)
                match = api or resolve
                if match is None or match["repo"] not in mirror.repos:
                    return self._error(404, "RepoNotFound", "Repository not found")
                repo = match["repo"]
                commit = mirror._commit(repo, match["rev"])
                if commit is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {match['rev']}")
                folder = mirror.repos[repo][0]
                if api and api["kind"] == "revision":
                    return self._json({"id": repo, "sha": commit, "private": bool(mirror.token), "siblings": [
                        {"rfilename": p.relative_to(folder).as_posix()} for p in mirror._files(repo)]})
                if api:
                    return self._json([{"type": "file", "path": p.relative_to(folder).as_posix(),
                                        "size": p.stat().st_size,
                                        "oid": hashlib.sha1(p.read_bytes()).hexdigest()}
                                       for p in mirror._files(repo)])
                target = folder / resolve["path"]
                if not target.is_file():
                    return self._error(404, "EntryNotFound", f"{resolve['path']} does not exist")
                data = target.read_bytes()
                self.send_response(200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(data)

            do_GET = do_HEAD = _serve

        return Handler
