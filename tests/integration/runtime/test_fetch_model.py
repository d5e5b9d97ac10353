"""``zerolayer fetch-model`` with the real huggingface_hub client against a local hub mirror
(hub_mirror.py) serving the project's generated tiny model. What the public hub adds and this
does not cover: LFS/Xet transfers, CDN redirects, gated-repo flows, pagination."""

from __future__ import annotations

import os
import pathlib
import stat
import subprocess
import sys

import pytest
from hub_mirror import HubMirror

from zerolayer import models as model_layout
from zerolayer.runtime.node import fetch_model
from zerolayer.runtime.node.fetch_model import MARKER, FetchError, fetch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
REPO_ID = "zerolayer-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> pathlib.Path:
    pytest.importorskip("transformers")
    from zerolayer.runtime.node import tinymodel

    return tinymodel.generate(tmp_path_factory.mktemp("hub") / "tiny-llama")


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerolayer.cli", "fetch-model", *args], capture_output=True,
                          text=True, timeout=90, env={**os.environ, **(env or {})})


def test_downloads_a_complete_readable_snapshot_then_reuses_it_without_network(tiny_model, tmp_path):
    with HubMirror({REPO_ID: (tiny_model, {"main": COMMIT})}) as hub:
        path, downloaded = fetch(REPO_ID, "main", tmp_path, endpoint=hub.url, log=lambda _: None)
        assert downloaded and path == tmp_path / model_layout.cache_entry(REPO_ID, "main")
        wanted = sorted(p.relative_to(tiny_model).as_posix() for p in tiny_model.rglob("*") if p.is_file())
        got = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != MARKER)
        assert got == wanted
        for name in wanted:
            assert (path / name).read_bytes() == (tiny_model / name).read_bytes()
            assert stat.S_IMODE((path / name).stat().st_mode) == 0o644  # the non-root server can read it
        assert not (path / ".cache").exists()
        assert not list((tmp_path / fetch_model.STAGING).glob("*/*"))  # nothing half-written left
        before = len(hub.requests)
        assert any(p.startswith(f"/api/models/{REPO_ID}/revision/main") for _, p, _ in hub.requests)

        again, downloaded = fetch(REPO_ID, "main", tmp_path, endpoint=hub.url, log=lambda _: None)
        assert again == path and not downloaded
        assert len(hub.requests) == before  # the complete snapshot is reused with no request at all


def test_the_cli_reuses_the_cache_with_the_hub_gone(tiny_model, tmp_path):
    with HubMirror({REPO_ID: (tiny_model, {"main": COMMIT})}) as hub:
        first = _cli(f"--repo={REPO_ID}", f"--cache-dir={tmp_path}", f"--endpoint={hub.url}")
        assert first.returncode == 0, first.stderr
        url = hub.url
    second = _cli(f"--repo={REPO_ID}", f"--cache-dir={tmp_path}", f"--endpoint={url}")  # nothing listens now
    assert second.returncode == 0 and "no download" in second.stdout


def test_unknown_revision_fails_with_one_clear_line_in_the_termination_log(tiny_model, tmp_path):
    log = tmp_path / "termination-log"
    with HubMirror({REPO_ID: (tiny_model, {"main": COMMIT})}) as hub:
        result = _cli(f"--repo={REPO_ID}", "--revision=v9-missing", f"--cache-dir={tmp_path / 'cache'}",
                      f"--endpoint={hub.url}", f"--termination-log={log}")
    assert result.returncode == 1
    line = log.read_text().strip()
    assert line == (f"fetch-model: revision 'v9-missing' not found in repository {REPO_ID} at {hub.url}")
    assert result.stderr.strip().splitlines()[-1] == line and "Traceback" not in result.stderr
    assert not (tmp_path / "cache" / model_layout.cache_entry(REPO_ID, "v9-missing")).exists()


def test_unreachable_endpoint_is_reported_and_nothing_is_cached(tmp_path):
    with HubMirror({}) as hub:
        url = hub.url  # a port that just closed: connection refused
    with pytest.raises(FetchError, match=r"cannot download .* hub unreachable or failing"):
        fetch(REPO_ID, "main", tmp_path, endpoint=url, timeout=2, log=lambda _: None)
    assert not (tmp_path / model_layout.cache_entry(REPO_ID, "main")).exists()


def test_token_from_a_file_is_sent_and_never_printed(tiny_model, tmp_path):
    token = "hf_secret_token_value_1234"
    (tmp_path / "token").write_text(token + "\n")
    with HubMirror({REPO_ID: (tiny_model, {"main": COMMIT})}, token=token) as hub:
        denied = _cli(f"--repo={REPO_ID}", f"--cache-dir={tmp_path / 'c1'}", f"--endpoint={hub.url}",
                      env={"HF_TOKEN": ""})
        assert denied.returncode == 1 and "not found" in denied.stderr and "private" in denied.stderr
        ok = _cli(f"--repo={REPO_ID}", f"--cache-dir={tmp_path / 'c2'}", f"--endpoint={hub.url}",
                  f"--token-file={tmp_path / 'token'}")
        assert ok.returncode == 0, ok.stderr
        assert {auth for _, _, auth in hub.requests[-3:]} == {f"Bearer {token}"}
    for out in (denied.stdout, denied.stderr, ok.stdout, ok.stderr):
        assert token not in out


def test_a_stray_incomplete_entry_is_replaced_not_used(tiny_model, tmp_path):
    stray = tmp_path / model_layout.cache_entry(REPO_ID, COMMIT)
    stray.mkdir(parents=True)
    (stray / "config.json").write_text("{half")  # e.g. someone copied by hand and stopped
    with HubMirror({REPO_ID: (tiny_model, {"main": COMMIT})}) as hub:
        path, downloaded = fetch(REPO_ID, COMMIT, tmp_path, endpoint=hub.url, log=lambda _: None)
    assert downloaded and path == stray and (path / MARKER).is_file()
    assert (path / "config.json").read_bytes() == (tiny_model / "config.json").read_bytes()
    # A commit needs no resolution: the client goes straight to the file list.
    assert not any("/revision/" in p for _, p, _ in hub.requests)
