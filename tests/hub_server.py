"""A stand-in for the Hugging Face Hub on loopback: the few routes that huggingface_hub's `HfFileSystem` reads a
dataset repository through, answered from a local folder (`<root>/<owner>/<name>/...` is dataset `owner/name`).

Like the Hub: an unknown repository is a 401 with `X-Error-Code: RepoNotFound` (what the Hub answers for a
missing and for a private repository alike, without a token), a missing file a 404 `EntryNotFound`, and files are
read with HTTP range requests. One revision, `main`; no pagination, no Xet storage (files are plain downloads).
"""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SHA = "0123456789abcdef0123456789abcdef01234567"


class HubServer:
    """Serves `root` on a free loopback port; `endpoint` is its URL, `requests` the (method, path) seen."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.requests: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _entry(repo: Path, path: Path) -> dict:
    name = path.relative_to(repo).as_posix()
    if path.is_dir():
        return {"type": "directory", "path": name, "oid": hashlib.sha1(name.encode()).hexdigest()}
    return {"type": "file", "path": name, "size": path.stat().st_size,
            "oid": hashlib.sha1(path.read_bytes()).hexdigest()}


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
            hub.requests.append((self.command, self.path))

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self._answer(body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(body=False)

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length", 0))
            form = urllib.parse.parse_qs(self.rfile.read(length).decode())
            route = self._route()
            if route is None or route[1][:1] != ["paths-info"]:
                return self._error(404, "EntryNotFound")
            repo = route[0]
            self._json([_entry(repo, repo / p) for p in form.get("paths", []) if (repo / p).exists()])

        def _route(self) -> tuple[Path, list[str]] | None:
            """(the repository's folder, the rest of the path) of /api/datasets/OWNER/NAME/..."""
            parts = [urllib.parse.unquote(p) for p in urllib.parse.urlparse(self.path).path.strip("/").split("/")]
            if parts[:2] != ["api", "datasets"] or len(parts) < 4 or not (hub.root / parts[2] / parts[3]).is_dir():
                return None
            return hub.root / parts[2] / parts[3], parts[4:]

        def _answer(self, body: bool) -> None:
            url = urllib.parse.urlparse(self.path)
            parts = [urllib.parse.unquote(p) for p in url.path.strip("/").split("/")]
            if parts[:1] == ["datasets"] and len(parts) > 5 and parts[3] == "resolve":
                return self._file(hub.root / parts[1] / parts[2], parts[5:], body)
            route = self._route()
            if route is None:
                return self._error(401, "RepoNotFound")
            repo, rest = route
            if not rest or rest[0] == "revision":
                return self._json({"id": f"{repo.parent.name}/{repo.name}", "sha": SHA, "siblings": []})
            if rest[0] == "tree":
                folder = repo.joinpath(*rest[2:])
                if not folder.is_dir():
                    return self._error(404, "EntryNotFound")
                recursive = urllib.parse.parse_qs(url.query).get("recursive") == ["true"]
                found = sorted(folder.rglob("*") if recursive else folder.iterdir())
                return self._json([_entry(repo, p) for p in found])
            self._error(404, "EntryNotFound")

        def _file(self, repo: Path, parts: list[str], body: bool) -> None:
            path = repo.joinpath(*parts)
            if not path.is_file():
                return self._error(404, "EntryNotFound")
            data = path.read_bytes()
            wanted = self.headers.get("Range")
            if wanted:
                first, _, last = wanted.removeprefix("bytes=").partition("-")
                start, end = int(first), min(int(last) if last else len(data) - 1, len(data) - 1)
                chunk = data[start:end + 1]
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{start + len(chunk) - 1}/{len(data)}")
            else:
                chunk = data
                self.send_response(200)
            self.send_header("Content-Length", str(len(chunk)))
            self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')  # the oid `_entry` lists
            self.send_header("X-Repo-Commit", SHA)
            self.end_headers()
            if body:
                self.wfile.write(chunk)

        def _json(self, value) -> None:
            data = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, code: str) -> None:
            data = json.dumps({"error": code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler
