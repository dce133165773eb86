"""One file of a vLLM release, read from its wheel on the package registry without
downloading the wheel (about 330 MB) and without importing vLLM.

A wheel is a zip archive: its central directory sits at the end of the file, so a
few HTTP range requests (the end record, the directory, the member's bytes) are
enough to pull one member out. The registry's JSON API names the wheel's URL.
Extracted files are cached under ``KVB_VLLM_RELEASE_CACHE`` (default
``~/.cache/kvbridge/vllm-releases/<version>/<path>``), so later runs and offline
runs read the cache. vLLM's code is never committed to this repository.
"""

from __future__ import annotations

import json
import os
import pathlib
import urllib.error
import urllib.parse
import urllib.request
import zipfile

__all__ = ["ReleaseUnavailable", "cache_dir", "release_file"]

INDEX = "https://pypi.org/pypi/vllm/json"
TIMEOUT_S = 60.0
_READ_AHEAD = 1 << 18


class ReleaseUnavailable(RuntimeError):
    """The registry could not be reached (or named no wheel) and nothing is cached."""


def cache_dir() -> pathlib.Path:
    env = os.environ.get("KVB_VLLM_RELEASE_CACHE")
    if env:
        return pathlib.Path(env)
    return pathlib.Path.home() / ".cache" / "kvbridge" / "vllm-releases"


class _RangeFile:
    """A read-only, seekable view of a remote file over HTTP range requests (what
    :class:`zipfile.ZipFile` needs), reading ahead in 256 KiB pieces."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size = url, size
        self.pos = 0
        self.requests = 0
        self._buf, self._buf_at = b"", 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        if end <= self.pos:
            return b""
        if not (self._buf_at <= self.pos and end <= self._buf_at + len(self._buf)):
            start, stop = self.pos, min(self.size, max(end, self.pos + _READ_AHEAD))
            req = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{stop - 1}"})
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
                if resp.status != 206:
                    raise ReleaseUnavailable(f"{self.url} ignored the range request "
                                             f"(HTTP {resp.status})")
                self._buf, self._buf_at = resp.read(), start
            self.requests += 1
        out = self._buf[self.pos - self._buf_at:end - self._buf_at]
        self.pos += len(out)
        return out


def _wheel(version: str) -> tuple[str, int]:
    """(URL, size) of one wheel of vLLM ``version`` (any platform: the Python files are
    the same in each)."""
    with urllib.request.urlopen(INDEX, timeout=TIMEOUT_S) as resp:
        meta = json.load(resp)
    files = meta.get("releases", {}).get(version)
    if not files:
        raise ReleaseUnavailable(f"the registry lists no vLLM {version}")
    wheels = sorted((f for f in files if f["filename"].endswith(".whl")),
                    key=lambda f: "x86_64" not in f["filename"])
    if not wheels:
        raise ReleaseUnavailable(f"the registry has no wheel of vLLM {version}")
    # the registry may answer with URLs relative to the index page
    return urllib.parse.urljoin(INDEX, wheels[0]["url"]), int(wheels[0]["size"])


def release_file(version: str, path: str) -> str:
    """The text of ``path`` (e.g. ``vllm/distributed/.../base.py``) in vLLM ``version``'s
    wheel: from the cache, else from the registry (then cached). Raises
    :class:`ReleaseUnavailable` when neither has it."""
    cached = cache_dir() / version / path
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    try:
        url, size = _wheel(version)
        with zipfile.ZipFile(_RangeFile(url, size)) as zf:  # type: ignore[arg-type]
            text = zf.read(path).decode("utf-8")
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        raise ReleaseUnavailable(f"cannot fetch vLLM {version} from {INDEX} ({exc}) and "
                                 f"{cached} is not cached") from exc
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(cached.suffix + f".{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(cached)
    return text
