"""vLLM's own tests, from the vllm sdist on the package registry pip uses.

``fetch_tests(cache)`` returns a folder holding the sdist's ``tests/`` tree (and nothing of
``vllm/``, so ``import vllm`` finds the installed package). The sdist is found the way pip
finds it: pip's own index model gives the simple-index URL, its JSON project page
(PEP 691) names the file and its sha256, which must equal the pin below. The archive and
the extracted tree are cached; a second call reads the cache (the digest is checked again).

    python scripts/vllm_peer/sdist.py [CACHE]     # prints the extracted folder
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

VERSION = "0.33.0"
FILENAME = f"vllm-{VERSION}.tar.gz"
# The digest the registry's project page gives for vllm-0.33.0.tar.gz (47,101,396 bytes).
SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
DEFAULT_CACHE = Path.home() / ".cache" / "kvlife" / "vllm-peer"
PEP691 = "application/vnd.pypi.simple.v1+json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _get(request: urllib.request.Request | str, timeout: float) -> Any:
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except OSError as exc:  # no network, a proxy, the index down: one line, no traceback
        url = request if isinstance(request, str) else request.full_url
        raise SystemExit(f"vllm-peer: cannot fetch {url}: {exc}") from None


def _file_url() -> str:
    from pip._internal.models.index import PyPI  # the index pip itself defaults to

    page = PyPI.simple_url.rstrip("/") + "/vllm/"
    request = urllib.request.Request(page, headers={"Accept": PEP691})
    with _get(request, 120) as response:
        project = json.load(response)
    for entry in project.get("files", []):
        if entry.get("filename") == FILENAME:
            given = entry.get("hashes", {}).get("sha256")
            if given != SHA256:
                raise SystemExit(f"vllm-peer: the index gives sha256 {given} for {FILENAME}, pinned {SHA256}")
            return urllib.parse.urljoin(page, str(entry["url"]))
    raise SystemExit(f"vllm-peer: the index's vllm page lists no {FILENAME}")


def fetch_sdist(cache: Path) -> Path:
    archive = cache / FILENAME
    if archive.exists() and _sha256(archive) == SHA256:
        return archive
    cache.mkdir(parents=True, exist_ok=True)
    url = _file_url()
    partial = archive.with_suffix(".part")
    print(f"vllm-peer: downloading {FILENAME} (47 MB)", file=sys.stderr)
    with _get(url, 600) as response, partial.open("wb") as out:
        shutil.copyfileobj(response, out, 1 << 20)
    digest = _sha256(partial)
    if digest != SHA256:
        partial.unlink()
        raise SystemExit(f"vllm-peer: {FILENAME} downloaded with sha256 {digest}, pinned {SHA256}")
    partial.replace(archive)
    return archive


def fetch_tests(cache: Path = DEFAULT_CACHE) -> Path:
    """The folder that holds the sdist's ``tests/`` (extracted once per pinned digest)."""
    root = cache / f"vllm-{VERSION}-tests"
    stamp = root / ".sha256"
    if stamp.exists() and stamp.read_text().strip() == SHA256:
        return root
    archive = fetch_sdist(cache)
    shutil.rmtree(root, ignore_errors=True)
    prefix = f"vllm-{VERSION}/tests/"
    with tarfile.open(archive, "r:gz") as tar:
        members = []
        for member in tar.getmembers():
            if member.name.startswith(prefix) and (member.isfile() or member.isdir()):
                member.name = member.name[len(f"vllm-{VERSION}/"):]
                members.append(member)
        tar.extractall(root, members=members, filter="data")
    stamp.write_text(SHA256 + "\n")
    return root


if __name__ == "__main__":
    print(fetch_tests(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_CACHE))
