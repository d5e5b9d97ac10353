"""Review finding 32: the local cluster's private keys were written with the default umask and only
then chmod-ed to 0600, so for a moment (and for good if the chmod failed) other local users could read
them. Keys are now created 0600 by the open itself."""

from __future__ import annotations

import os
import pathlib
import stat

import pytest

from zerolayer.cluster import pki

pytestmark = [pytest.mark.regression]


def test_private_keys_are_created_owner_only(tmp_path, monkeypatch):
    # Take the chmod away: whatever mode the key has then is the mode it was created with.
    monkeypatch.setattr(pathlib.Path, "chmod", lambda self, mode: None)
    old = os.umask(0o022)
    try:
        pki.create(tmp_path)
    finally:
        os.umask(old)
    keys = sorted(tmp_path.glob("*.key"))
    assert keys, "pki.create wrote no private keys"
    for key in keys:
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key.name
