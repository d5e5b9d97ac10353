"""Shared pytest setup: repository paths for every tier."""

import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo() -> pathlib.Path:
    return REPO
