"""Who may do what, in-process (issue 37: the tokens file's and the bearer header's words were
checked only through a server, where mutants of them were caught by timeouts): each problem
with the file or the header is refused in the words an operator acts on."""

from __future__ import annotations

from pathlib import Path

import pytest

from cohortgate.coordinator.contract.errors import PermissionDenied, Unauthenticated
from cohortgate.coordinator.edge.auth import ADMIN, Auth, Grant, TokenStore

TOKEN = "t" * 16
ADMIN_TOKEN = "a" * 20


def _store(tmp_path: Path, text: str | bytes) -> TokenStore:
    path = tmp_path / "tokens"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return TokenStore.load(path)


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (b"\xff\xfe", "not UTF-8 text (byte 0); expected 'TOKEN JOB_ID' lines"),
        (f"{TOKEN}\n", ":1: expected 'TOKEN JOB_ID' (or 'TOKEN *' for an admin token)"),
        (f"# tokens\n{TOKEN} job extra\n", ":2: expected 'TOKEN JOB_ID'"),
        ("short job\n", ":1: a token must be at least 16 characters"),
        ("# nothing but a comment\n\n", " holds no tokens"),
    ],
)
def test_a_bad_tokens_file_is_refused_naming_the_line_and_the_rule(
    tmp_path: Path, text: str | bytes, said: str
) -> None:
    with pytest.raises(ValueError) as err:
        _store(tmp_path, text)
    assert str(err.value).startswith(f"--tokens-file {tmp_path / 'tokens'}")
    assert said in str(err.value)


def test_a_missing_tokens_file_says_so() -> None:
    with pytest.raises(ValueError) as err:
        TokenStore.load(Path("/nonexistent/tokens"))
    assert str(err.value) == "--tokens-file /nonexistent/tokens: No such file or directory"


def test_comments_end_a_line_at_the_first_hash_and_grants_are_per_job(tmp_path: Path) -> None:
    store = _store(tmp_path, f"{TOKEN} job-a # the team's # job\n{ADMIN_TOKEN} *\n")
    grant = store.grant(_bearer(TOKEN))
    assert grant == Grant("job-a") and not grant.admin
    assert grant.allows("job-a") and not grant.allows("job-ab") and not grant.allows("job-")
    assert store.grant(_bearer(ADMIN_TOKEN)).scope == ADMIN
    # surrounding spaces of a token read from a file are not part of it
    assert store.grant([("authorization", f"Bearer  {TOKEN} ")]) == Grant("job-a")
    assert store.grant([("authorization", f"bearer {TOKEN}".encode())]) == Grant("job-a")


@pytest.mark.parametrize(
    ("metadata", "said"),
    [
        ([], "no token: send 'authorization: Bearer TOKEN' (agents: set COHORTGATE_TOKEN)"),
        ([("authorization", f"Basic {TOKEN}")], "the authorization header must be 'Bearer TOKEN'"),
        ([("authorization", "Bearer")], "the authorization header must be 'Bearer TOKEN'"),
        (_bearer("x" * 16), "the token is not valid on this coordinator"),
    ],
)
def test_a_call_without_a_valid_bearer_token_is_unauthenticated_in_words(
    tmp_path: Path, metadata: list[tuple[str, str]], said: str
) -> None:
    store = _store(tmp_path, f"{TOKEN} job-a\n")
    with pytest.raises(Unauthenticated) as err:
        store.grant(metadata)
    assert str(err.value) == said


def test_a_token_of_another_job_is_denied_naming_the_job(tmp_path: Path) -> None:
    auth = Auth(_store(tmp_path, f"{TOKEN} job-a\n"))
    assert auth.enabled and auth.check_job(_bearer(TOKEN), "job-a") == Grant("job-a")
    with pytest.raises(PermissionDenied) as err:
        auth.check_job(_bearer(TOKEN), "job-b")
    assert str(err.value) == "this token is for another job; it cannot reach job 'job-b'"
    # checked before the request is validated: a hostile job id is named by its first 64
    with pytest.raises(PermissionDenied) as err:
        auth.check_job(_bearer(TOKEN), "x" * 64 + "TAIL" * 1000)
    assert str(err.value) == f"this token is for another job; it cannot reach job '{'x' * 64}'"
    open_auth = Auth(None)
    assert not open_auth.enabled and open_auth.check_job([], "any").admin
