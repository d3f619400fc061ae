"""Certificates for the security tests (made once per session with ``cryptography``)."""

from __future__ import annotations

import pytest

from tests.security.certs import Certs, make_certs


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("security-tls"))
