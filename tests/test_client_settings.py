"""The agent's and the CLI's client settings read in-process (test_settings.py runs them
through real processes): TLS files named by their variables from both channel kinds, a
client certificate read, seconds and tokens from the environment checked and named."""

from __future__ import annotations

from pathlib import Path

import pytest

from cohortgate.coordinator.codec.channel import ClientSecurity
from cohortgate.coordinator.contract.settings import SettingError, env_seconds, token_text


def test_a_tls_file_that_cannot_be_read_is_named_with_its_variable_in_process() -> None:
    """The same words as the subprocess tests above, from both channel kinds (agents use
    the blocking one, relays the asyncio one), before anything connects."""
    security = ClientSecurity(tls=True, ca=Path("/missing/ca.pem"))
    for make in (security.channel, security.aio_channel):
        with pytest.raises(SettingError) as raised:
            make("127.0.0.1:1")
        assert str(raised.value) == "COHORTGATE_TLS_CA=/missing/ca.pem: No such file or directory"


def test_seconds_from_the_environment_take_any_positive_value_and_name_a_bad_one() -> None:
    assert env_seconds("COHORTGATE_T", 5, {"COHORTGATE_T": "0.5"}) == 0.5  # under a second
    with pytest.raises(SettingError) as raised:
        env_seconds("COHORTGATE_T", 5, {"COHORTGATE_T": "y" * 100})
    assert str(raised.value) == (
        f"COHORTGATE_T={'y' * 40!r} is not a number; give seconds, e.g. COHORTGATE_T=5"
    )
    with pytest.raises(SettingError) as raised:
        env_seconds("COHORTGATE_T", 5, {"COHORTGATE_T": "-" + "9" * 100})
    assert str(raised.value).startswith(f"COHORTGATE_T=-{'9' * 39} must be a finite number")


def test_a_token_with_a_bad_character_names_the_first() -> None:
    with pytest.raises(SettingError) as raised:
        token_text("COHORTGATE_TOKEN", "ab\tcd\tef")
    assert "('\\t' at position 2)" in str(raised.value)


def test_a_client_certificate_is_read_from_the_environment_and_a_missing_file_named(
    tmp_path: Path,
) -> None:
    cert, key = tmp_path / "rank.pem", tmp_path / "rank.key"
    cert.write_text("cert")
    key.write_text("key")
    env = {"COHORTGATE_TLS_CERT": str(cert), "COHORTGATE_TLS_KEY": str(key)}
    security = ClientSecurity.from_env(env)
    assert (security.tls, security.cert, security.key, security.ca) == (True, cert, key, None)
    for name in ("COHORTGATE_TLS_CA", "COHORTGATE_TLS_CERT", "COHORTGATE_TLS_KEY"):
        with pytest.raises(SettingError) as raised:
            ClientSecurity.from_env({**env, name: "/missing.pem"})
        assert str(raised.value) == (
            f"{name}=/missing.pem: no such file; give a PEM file readable here (or unset the "
            "variable)"
        )
