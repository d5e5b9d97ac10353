"""``zerolayer fetch-model``: download one model repository revision into the node cache.

The runtime pod runs it as an init container for each ``huggingFace`` model source
(operator/manifests.py); the server then mounts the cache entry read-only. Contract:

- **Idempotent.** A complete snapshot already in the cache (it carries :data:`MARKER`) is
  reused without any network access: restarts, rollouts and other pods on the node pay
  nothing. A branch revision is therefore resolved once per node cache.
- **Atomic.** The download goes into a fresh staging directory under ``<cache>/.staging``;
  only a complete download gets :data:`MARKER` and is renamed into place (one ``rename``
  on the same file system). A killed download leaves only staging debris, which is never
  mounted and is swept by the next run. Concurrent fetches of one entry serialise on a lock.
- **Readable by the server.** Everything written is made world-readable (directories
  0755, files 0644): the server runs as a non-root user and fsGroup does not apply to
  hostPath volumes.
- **Clear failures.** Any failure exits non-zero with one line saying why, on stderr and in
  ``--termination-log`` (the container's termination message, shown by ``kubectl describe``).
  The access token (``--token-file``, else ``$HF_TOKEN``) is never printed.

Downloads use the real ``huggingface_hub`` client (``snapshot_download``); ``--endpoint``
(else ``$HF_ENDPOINT``) points it at a mirror or a private hub.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import pathlib
import shutil
import sys
import uuid
from typing import Iterator

from zerolayer import models as model_layout
from zerolayer.runtime.errors import RuntimeServerError

MARKER = ".zerolayer-snapshot.json"
STAGING = ".staging"
LOCKS = ".locks"


class FetchError(RuntimeServerError):
    """A download that did not produce a complete snapshot; the message is one line."""


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "fetch-model",
        help="download a model repository revision into a node-local cache (the runtime pod's init container)",
        description="Download REPO at REVISION with huggingface_hub into CACHE_DIR/<org>--<name>/<revision>, "
                    "atomically; a complete cached snapshot is reused without network access.",
    )
    parser.add_argument("--repo", required=True, help="repository id, e.g. org/name")
    parser.add_argument("--revision", default=model_layout.DEFAULT_REVISION, help="branch, tag or commit (main)")
    parser.add_argument("--cache-dir", required=True, help="the node cache (the runtime pod mounts it from the node)")
    parser.add_argument("--endpoint", default=None, help="hub endpoint (default $HF_ENDPOINT, else the public hub)")
    parser.add_argument("--token-file", default=None,
                        help="file holding an access token (default: $HF_TOKEN if set); never printed")
    parser.add_argument("--termination-log", default=None,
                        help="also write the one-line failure reason here (Kubernetes: /dev/termination-log)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the hub to answer (30)")
    parser.set_defaults(handler=run)


def entry_dir(cache_dir: str | os.PathLike[str], repo: str, revision: str) -> pathlib.Path:
    """Where the complete snapshot of ``repo`` at ``revision`` lives in the cache."""
    return pathlib.Path(cache_dir) / model_layout.cache_entry(repo, revision)


def is_complete(path: pathlib.Path) -> bool:
    return (path / MARKER).is_file()


@contextlib.contextmanager
def _entry_lock(cache: pathlib.Path, repo: str, revision: str) -> Iterator[None]:
    locks = cache / LOCKS
    locks.mkdir(parents=True, exist_ok=True)
    name = model_layout.cache_entry(repo, revision).replace("/", "@")
    with open(locks / f"{name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
        yield


def _make_readable(root: pathlib.Path) -> None:
    root.chmod(0o755)
    for path in root.rglob("*"):
        if path.is_symlink():
            continue
        path.chmod(0o755 if path.is_dir() else 0o644)


def _sweep_staging(staging: pathlib.Path) -> None:
    """Remove what killed downloads left (only called while holding the entry's lock, and
    staging names carry the entry, so a concurrent download of another entry is untouched)."""
    for debris in staging.glob("*"):
        shutil.rmtree(debris, ignore_errors=True)


def _describe(exc: BaseException, repo: str, revision: str, endpoint: str) -> str:
    """One line a person can act on, for the errors ``snapshot_download`` raises."""
    from huggingface_hub import errors as hf_errors

    where = f"{repo}@{revision} from {endpoint}"
    if isinstance(exc, hf_errors.RevisionNotFoundError):
        return f"revision {revision!r} not found in repository {repo} at {endpoint}"
    if isinstance(exc, hf_errors.GatedRepoError):
        return f"repository {repo} at {endpoint} is gated: give a token with access (tokenSecretRef)"
    if isinstance(exc, hf_errors.RepositoryNotFoundError):
        return (f"repository {repo} not found at {endpoint} (or it is private and the token is missing or "
                "refused)")
    if isinstance(exc, hf_errors.LocalEntryNotFoundError):
        cause = exc.__cause__ or exc.__context__
        detail = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
        return f"cannot download {where}: hub unreachable or failing ({detail})"
    if isinstance(exc, hf_errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", "?")
        return f"cannot download {where}: HTTP {status}"
    if isinstance(exc, OSError):
        return f"cannot download {where}: {type(exc).__name__}: {exc}"
    return f"cannot download {where}: {type(exc).__name__}: {exc}"


def fetch(repo: str, revision: str, cache_dir: str | os.PathLike[str], *, endpoint: str | None = None,
          token: str | None = None, timeout: float = 30.0, log=print) -> tuple[pathlib.Path, bool]:  # type: ignore[no-untyped-def]
    """Make ``repo`` at ``revision`` complete in the cache; returns (its directory, whether
    it was downloaded now). Raises :class:`FetchError` with a one-line reason."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    cache = pathlib.Path(cache_dir)
    final = entry_dir(cache, repo, revision)
    if is_complete(final):
        log(f"fetch-model: {repo}@{revision} is complete in the cache at {final}; no download")
        return final, False
    shown_endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    os.umask(0o022)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with _entry_lock(cache, repo, revision):
            if is_complete(final):  # another fetch finished it while we waited
                log(f"fetch-model: {repo}@{revision} was completed by another fetch at {final}")
                return final, False
            staging = cache / STAGING / final.relative_to(cache).as_posix().replace("/", "@")
            _sweep_staging(staging)
            work = staging / uuid.uuid4().hex
            work.mkdir(parents=True)
            log(f"fetch-model: downloading {repo}@{revision} from {shown_endpoint}")
            disable_progress_bars()  # one line per event in the pod log, not bars
            try:
                snapshot_download(repo, revision=revision, local_dir=work, endpoint=endpoint, token=token,
                                  etag_timeout=timeout)
            except Exception as exc:  # every failure becomes one line; the traceback adds nothing here
                shutil.rmtree(work, ignore_errors=True)
                message = _describe(exc, repo, revision, shown_endpoint)
                raise FetchError(message.replace(token, "***") if token else message) from exc
            shutil.rmtree(work / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping, not the model
            files = sorted(p.relative_to(work).as_posix() for p in work.rglob("*") if p.is_file())
            if not files:
                shutil.rmtree(work, ignore_errors=True)
                raise FetchError(f"repository {repo}@{revision} at {shown_endpoint} has no files")
            (work / MARKER).write_text(json.dumps({
                "repo": repo, "revision": revision, "endpoint": shown_endpoint, "files": files,
                "completed": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            }, indent=1) + "\n")
            _make_readable(work)
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():  # not complete (checked above under the lock): a stray directory
                shutil.rmtree(final)
            os.rename(work, final)  # the snapshot appears whole or not at all
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        raise FetchError(f"cannot write the model cache {cache}: {exc}") from exc
    log(f"fetch-model: {repo}@{revision} complete at {final} ({len(files)} files)")
    return final, True


def read_token(path: str | None) -> str | None:
    """The access token from ``path`` (surrounding whitespace removed), else ``$HF_TOKEN``, else None."""
    if path is None:
        return os.environ.get("HF_TOKEN") or None
    try:
        token = pathlib.Path(path).read_text().strip()
    except OSError as exc:
        raise FetchError(f"cannot read the token file {path}: {exc.strerror}") from exc
    if not token:
        raise FetchError(f"the token file {path} is empty")
    return token


def run(args: argparse.Namespace) -> int:
    try:
        token = read_token(args.token_file)
        fetch(args.repo, args.revision, args.cache_dir, endpoint=args.endpoint or None, token=token,
              timeout=args.timeout, log=lambda line: print(line, flush=True))
    except FetchError as exc:
        line = f"fetch-model: {exc}".replace("\n", " ")
        print(line, file=sys.stderr, flush=True)
        if args.termination_log:
            with contextlib.suppress(OSError):
                pathlib.Path(args.termination_log).write_text(line + "\n")
        return 1
    return 0
