"""An image's config (its Env) read from its registry over the Registry HTTP API v2, at preview.

Docker v2 and OCI manifests, and their lists/indexes (linux/amd64 is taken: the nodes are
x86_64). Credentials as registries ask for them: a Bearer token from the realm the 401's
WWW-Authenticate names (the Docker registry token spec), or Basic. One Registry object per
program run caches each image by digest and each token, and gives up on a registry that did
not answer once, so an unreachable one costs one short timeout, not one per service.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

DOCKER_HUB = "docker.io"
# Where to reach a registry instead of https://<its name>: Docker Hub's API host, and, for the
# tests and the rehearsal, a registry on loopback or the bridge ("*": every registry not named).
ENDPOINTS: dict[str, str] = {DOCKER_HUB: "https://registry-1.docker.io"}
TIMEOUT_SECONDS = 5.0  # per request: preview waits at most this long for a registry that is down

MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
_INDEX_TYPES = MANIFEST_TYPES[:2]
_PLATFORM = ("linux", "amd64")


class RegistryUnreachable(LookupError):
    """The registry did not answer (connection, timeout, 5xx, 429): the image could not be read."""


class RegistryRefused(LookupError):
    """The registry answered no: no such image, or the credentials are missing or wrong."""


@dataclass(frozen=True)
class ImageRef:
    registry: str  # docker.io, ghcr.io, nvcr.io, host:port
    repository: str  # library/ubuntu, nvidia/cuda
    reference: str  # a tag, or sha256:... when pinned

    @property
    def pinned(self) -> bool:
        return self.reference.startswith("sha256:")


def parse_reference(image: str) -> ImageRef:
    """As docker reads an image name: the first part is a registry when it has a '.' or ':' or is
    localhost; else Docker Hub, where one-part names are library/. A digest wins over a tag."""
    name, _, digest = image.strip().partition("@")
    head, _, rest = name.partition("/")
    if rest and ("." in head or ":" in head or head == "localhost"):
        registry, path = head, rest
    else:
        registry, path = DOCKER_HUB, name
    if registry == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    tag = "latest"
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, _, tag = path.rpartition(":")
    if not re.fullmatch(r"[a-z0-9]+(?:[._/-]+[a-z0-9]+)*", path):
        raise ValueError(f"{image!r} is not an image name docker accepts")
    return ImageRef(registry, path, digest or tag)


@dataclass(frozen=True)
class ImageConfig:
    digest: str  # the linux/amd64 manifest's
    env: tuple[str, ...]  # KEY=VALUE, as the image's config sets them


class Registry:
    """Reads image configs; one per program run (its caches are that run's)."""

    def __init__(self, credentials: dict[str, tuple[str, str]] | None = None, timeout: float = TIMEOUT_SECONDS):
        self.credentials = dict(credentials or {})  # registry name -> (username, password)
        self.timeout = timeout
        self._tokens: dict[tuple[str, str], str] = {}  # (registry, repository) -> Authorization header
        self._by_digest: dict[str, ImageConfig] = {}
        self._down: dict[str, str] = {}  # registry -> why it did not answer
        self._opener = urllib.request.build_opener(_RedirectWithoutAuth())

    def image_config(self, image: str) -> ImageConfig:
        """The image's linux/amd64 config. Raises RegistryUnreachable, RegistryRefused or ValueError."""
        ref = parse_reference(image)
        if ref.registry in self._down:
            raise RegistryUnreachable(self._down[ref.registry])
        if ref.pinned and ref.reference in self._by_digest:
            return self._by_digest[ref.reference]
        try:
            return self._read(ref)
        except RegistryUnreachable as exc:
            self._down[ref.registry] = str(exc)
            raise

    def _read(self, ref: ImageRef) -> ImageConfig:
        body, media_type, digest = self._manifest(ref, ref.reference)
        if ref.pinned and digest != ref.reference:
            raise RegistryRefused(f"the registry answered a manifest of digest {digest} for {ref.reference}")
        manifest = _json(body, f"the manifest of {ref.repository}")
        media_type = manifest.get("mediaType") or media_type
        if media_type in _INDEX_TYPES or "manifests" in manifest:
            chosen = next((m for m in manifest.get("manifests") or []
                           if (m.get("platform") or {}).get("os") == _PLATFORM[0]
                           and (m.get("platform") or {}).get("architecture") == _PLATFORM[1]), None)
            if chosen is None:
                raise RegistryRefused(f"{ref.repository}@{digest} has no {'/'.join(_PLATFORM)} image "
                                      "(the nodes are x86_64)")
            digest = chosen["digest"]
            if digest in self._by_digest:
                return self._by_digest[digest]
            body, _, _ = self._manifest(ref, digest)
            manifest = _json(body, f"the manifest {digest}")
        if digest in self._by_digest:
            return self._by_digest[digest]
        config_digest = (manifest.get("config") or {}).get("digest")
        if not config_digest:
            raise RegistryRefused(f"the manifest {digest} of {ref.repository} names no config (a schema 1 "
                                  "manifest? push the image again with a current docker)")
        blob, _ = self._get(ref, f"blobs/{config_digest}", {})
        if _digest(blob) != config_digest:
            raise RegistryRefused(f"the config blob of {ref.repository} does not match its digest {config_digest}")
        env = (_json(blob, f"the config of {ref.repository}").get("config") or {}).get("Env") or []
        found = ImageConfig(digest, tuple(str(e) for e in env))
        self._by_digest[digest] = found
        return found

    def _manifest(self, ref: ImageRef, reference: str) -> tuple[bytes, str, str]:
        body, headers = self._get(ref, f"manifests/{reference}", {"Accept": ", ".join(MANIFEST_TYPES)})
        digest = headers.get("Docker-Content-Digest") or _digest(body)
        if reference.startswith("sha256:") and _digest(body) != reference:
            raise RegistryRefused(f"the manifest answered for {reference} does not match that digest")
        return body, (headers.get("Content-Type") or "").split(";")[0].strip(), digest

    def _get(self, ref: ImageRef, path: str, headers: dict[str, str]) -> tuple[bytes, dict]:
        base = ENDPOINTS.get(ref.registry) or ENDPOINTS.get("*") or f"https://{ref.registry}"
        url = f"{base.rstrip('/')}/v2/{ref.repository}/{path}"
        auth = self._tokens.get((ref.registry, ref.repository))
        for attempt in range(2):
            try:
                with self._open(url, {**headers, **({"Authorization": auth} if auth else {})}) as answer:
                    return answer.read(), dict(answer.headers)
            except urllib.error.HTTPError as exc:
                if exc.code == 401 and attempt == 0:
                    auth = self._authorize(ref, exc.headers.get("WWW-Authenticate") or "")
                    self._tokens[(ref.registry, ref.repository)] = auth
                    continue
                raise self._refusal(ref, exc) from None
        raise AssertionError("unreachable: the second 401 raises above")

    def _open(self, url: str, headers: dict[str, str]):
        try:
            return self._opener.open(urllib.request.Request(url, headers=headers), timeout=self.timeout)
        except urllib.error.HTTPError:
            raise
        except (OSError, socket.timeout) as exc:
            reason = getattr(exc, "reason", exc)
            raise RegistryUnreachable(f"{urllib.parse.urlsplit(url).netloc} did not answer ({reason})") from None

    def _authorize(self, ref: ImageRef, challenge: str) -> str:
        scheme, params = _challenge(challenge)
        user = self.credentials.get(ref.registry)
        basic = "Basic " + base64.b64encode(f"{user[0]}:{user[1]}".encode()).decode() if user else None
        if scheme == "basic":
            if not basic:
                raise RegistryRefused(f"{ref.registry} asks for credentials, and gpu-swarm:registryCredentials "
                                      "has none for it")
            return basic
        if scheme != "bearer" or "realm" not in params:
            raise RegistryRefused(f"{ref.registry} asks for an authentication this check does not speak "
                                  f"({challenge or 'no WWW-Authenticate header'})")
        query = {"scope": f"repository:{ref.repository}:pull"}
        if params.get("service"):
            query["service"] = params["service"]
        url = f"{params['realm']}{'&' if '?' in params['realm'] else '?'}{urllib.parse.urlencode(query)}"
        try:
            with self._open(url, {"Authorization": basic} if basic else {}) as answer:
                token = _json(answer.read(), f"the token from {params['realm']}")
        except urllib.error.HTTPError as exc:
            raise self._refusal(ref, exc) from None
        value = token.get("token") or token.get("access_token")
        if not value:
            raise RegistryRefused(f"the token service {params['realm']} answered no token")
        return f"Bearer {value}"

    def _refusal(self, ref: ImageRef, exc: urllib.error.HTTPError) -> LookupError:
        where = f"{ref.registry}/{ref.repository}:{ref.reference}".replace(":sha256:", "@sha256:")
        if exc.code == 429 or exc.code >= 500:
            return RegistryUnreachable(f"{ref.registry} answered HTTP {exc.code} for {where}")
        if exc.code in (401, 403):
            has = "were refused" if ref.registry in self.credentials else "are not in gpu-swarm:registryCredentials"
            return RegistryRefused(f"{ref.registry} refused {where} (HTTP {exc.code}): its credentials {has}")
        if exc.code == 404:
            return RegistryRefused(f"{ref.registry} has no {where} (HTTP 404)")
        return RegistryRefused(f"{ref.registry} answered HTTP {exc.code} for {where}")


class _RedirectWithoutAuth(urllib.request.HTTPRedirectHandler):
    """Blobs are often served from a storage host (S3, a CDN) through a redirect: the registry's
    credentials must not follow it there (S3 refuses a request with two kinds of auth)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")
        return new


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    """WWW-Authenticate: Bearer realm="...",service="...",scope="..." -> ("bearer", {...})."""
    scheme, _, rest = header.strip().partition(" ")
    params = {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', rest)}
    return scheme.lower(), params


def _json(body: bytes, what: str) -> dict:
    try:
        value = json.loads(body)
    except ValueError:
        raise RegistryRefused(f"{what} is not JSON") from None
    if not isinstance(value, dict):
        raise RegistryRefused(f"{what} is not a JSON object")
    return value


def _digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"
