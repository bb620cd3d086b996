"""What the code check fingerprints, in-process (issue 37: these functions ran only inside the
e2e jobs, where mutation testing cannot see them): the script by its path in the work tree and
its bytes, the commit and whether it has local changes, the local modules the rank imported
from that work tree (never the script itself, an untracked file or a virtual environment's),
and the installed versions of the numerics packages and the ones the user names."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from cohortgate.agent import identity
from cohortgate.coordinator.contract.digests import files_field


def _git(tree: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _sha(path: Path) -> bytes:
    return hashlib.sha256(path.read_bytes()).digest()


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A git work tree: the script, a tracked helper module, an untracked one, and a
    virtual environment's module (tracked by mistake); every module imported, the script
    as __main__."""
    top = tmp_path / "repo"
    (top / "helpers").mkdir(parents=True)
    (top / "venv" / "lib").mkdir(parents=True)
    (top / "train.py").write_text("print('train')\n")
    (top / "helpers" / "util.py").write_text("X = 1\n")
    (top / "venv" / "pyvenv.cfg").write_text("home = /usr\n")
    (top / "venv" / "lib" / "vendored.py").write_text("Y = 2\n")
    _git(top, "init", "-q")
    _git(top, "-c", "user.email=t@t", "-c", "user.name=t", "add", ".")
    _git(top, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one")
    (top / "scratch.py").write_text("Z = 3\n")  # untracked
    names = []
    for rel in ("helpers/util.py", "venv/lib/vendored.py", "scratch.py", "train.py"):
        name = "cg_identity_" + rel.replace("/", "_").removesuffix(".py")
        spec = importlib.util.spec_from_file_location(name, top / rel)
        assert spec is not None
        monkeypatch.setitem(sys.modules, name, importlib.util.module_from_spec(spec))
        names.append(name)
    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(top / "train.py"), raising=False)
    monkeypatch.delenv("COHORTGATE_PACKAGES", raising=False)
    yield top


def test_a_clean_work_tree_gives_script_commit_and_the_tracked_modules_only(tree: Path) -> None:
    fields = identity.code_fields()
    script_sha = hashlib.sha256((tree / "train.py").read_bytes()).hexdigest()[:16]
    assert fields["script"] == json.dumps(f"train.py sha256:{script_sha}")
    assert fields["git.commit"] == json.dumps(_git(tree, "rev-parse", "HEAD")[:12])
    modules = [("helpers/util.py", _sha(tree / "helpers" / "util.py"))]
    assert modules == identity.LOCAL_FILES
    assert fields["modules"] == files_field(modules)
    assert fields["package.torch"] == json.dumps(metadata.version("torch"))
    assert "package.flash-attn" not in fields  # not installed: not named


def test_an_edited_helper_changes_the_modules_and_marks_local_changes(tree: Path) -> None:
    before = identity.code_fields()
    (tree / "helpers" / "util.py").write_text("X = 2\n")
    after = identity.code_fields()
    assert after["git.commit"] == json.dumps(
        _git(tree, "rev-parse", "HEAD")[:12] + " (local changes)"
    )
    assert after["modules"] != before["modules"]
    assert after["script"] == before["script"]
    (tree / "train.py").write_text("print('hot fix')\n")
    assert identity.code_fields()["script"] != before["script"]


def test_the_packages_named_by_the_caller_and_the_environment_are_versioned(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COHORTGATE_PACKAGES", " pytest , ,no-such-package")
    fields = identity.code_fields(packages=["grpcio"])
    assert fields["package.pytest"] == json.dumps(metadata.version("pytest"))
    assert fields["package.grpcio"] == json.dumps(metadata.version("grpcio"))
    assert not any(k.startswith("package.no-such") or k == "package." for k in fields)


def test_a_script_outside_a_work_tree_is_named_by_its_file_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "loose" / "run.py"
    script.parent.mkdir()
    script.write_text("pass\n")
    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(script), raising=False)
    fields = identity.code_fields()
    digest = hashlib.sha256(b"pass\n").hexdigest()[:16]
    assert fields["script"] == json.dumps(f"run.py sha256:{digest}")
    assert "git.commit" not in fields and "modules" not in fields


def test_a_virtual_environment_inside_the_tree_is_never_a_local_module(tree: Path) -> None:
    assert identity._in_venv(tree, Path("venv/lib/vendored.py"))
    assert identity._in_venv(tree, Path("lib/python3.11/site-packages/x.py"))
    assert not identity._in_venv(tree, Path("helpers/util.py"))
    # without `exclude`, the script (imported here as a module too) is one of them
    assert [rel for rel, _ in identity.local_files(tree)] == ["helpers/util.py", "train.py"]
    assert [rel for rel, _ in identity.local_files(tree, exclude=tree / "train.py")] == [
        "helpers/util.py"
    ]
    assert identity.local_files(tree / "helpers" / "nowhere") == []  # git fails: nothing


def test_a_script_in_a_subfolder_is_named_by_its_path_in_the_tree(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tree / "scripts").mkdir()
    (tree / "scripts" / "pretrain.py").write_text("pass\n")
    monkeypatch.setattr(
        sys.modules["__main__"], "__file__", str(tree / "scripts" / "pretrain.py"), raising=False
    )
    digest = hashlib.sha256(b"pass\n").hexdigest()[:16]
    assert identity.code_fields()["script"] == json.dumps(f"scripts/pretrain.py sha256:{digest}")
    # a script that cannot be read (gone since it started) is said so, not skipped
    monkeypatch.setattr(
        sys.modules["__main__"], "__file__", str(tree / "scripts" / "gone.py"), raising=False
    )
    assert identity.code_fields()["script"] == json.dumps("scripts/gone.py sha256:unreadable")


def test_without_a_script_only_the_packages_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -c` or an interactive session: __main__ has no file."""
    monkeypatch.delattr(sys.modules["__main__"], "__file__", raising=False)
    monkeypatch.setenv("COHORTGATE_PACKAGES", "pytest,grpcio")  # no spaces: still a list
    fields = identity.code_fields()
    assert not {"script", "git.commit", "modules"} & set(fields)
    assert {"package.torch", "package.pytest", "package.grpcio"} <= set(fields)


@pytest.mark.parametrize(
    ("gone", "left"), [("helpers/util.py", "train.py"), ("train.py", "helpers/util.py")]
)
def test_a_module_whose_file_is_gone_is_left_out_and_the_rest_still_listed(
    tree: Path, gone: str, left: str
) -> None:
    """Either way round: the script is __main__, the first module listed, as well."""
    (tree / gone).unlink()  # imported, deleted since
    assert [rel for rel, _ in identity.local_files(tree)] == [left]


def test_a_work_tree_without_a_commit_names_the_script_by_its_path_and_no_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`git rev-parse HEAD` fails there (and prints 'HEAD' as it does): no commit field."""
    top = tmp_path / "fresh"
    (top / "jobs").mkdir(parents=True)
    (top / "jobs" / "run.py").write_text("pass\n")
    _git(top, "init", "-q")
    monkeypatch.setattr(
        sys.modules["__main__"], "__file__", str(top / "jobs" / "run.py"), raising=False
    )
    fields = identity.code_fields()
    digest = hashlib.sha256(b"pass\n").hexdigest()[:16]
    assert fields["script"] == json.dumps(f"jobs/run.py sha256:{digest}")
    assert "git.commit" not in fields and "modules" not in fields


def test_a_git_that_hangs_costs_its_timeout_and_the_script_is_named_by_its_file(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wedged git (a network file system, a lock) must not hang the rank's join."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "git").write_text("#!/bin/sh\nexec sleep 20\n")
    (bin_dir / "git").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(identity, "GIT_TIMEOUT_S", 0.3)
    done: list[dict[str, str]] = []
    worker = threading.Thread(target=lambda: done.append(identity.code_fields()), daemon=True)
    worker.start()
    worker.join(10)
    assert done, "code_fields() still waits on a git that hangs"
    digest = hashlib.sha256((tree / "train.py").read_bytes()).hexdigest()[:16]
    assert done[0]["script"] == json.dumps(f"train.py sha256:{digest}")
    assert "git.commit" not in done[0]


def test_a_virtual_environment_is_found_at_any_depth_and_by_either_packages_folder(
    tree: Path,
) -> None:
    (tree / "tools" / "env").mkdir(parents=True)
    (tree / "tools" / "env" / "pyvenv.cfg").write_text("home = /usr\n")
    assert identity._in_venv(tree, Path("tools/env/x.py"))
    assert identity._in_venv(tree, Path("usr/lib/python3/dist-packages/x.py"))
    assert not identity._in_venv(tree, Path("tools/x.py"))


def test_a_tokenizer_object_with_only_a_vocabulary_has_a_fingerprint() -> None:
    """Neither added tokens nor a special tokens map: the fingerprint is still taken."""
    from cohortgate import tokenizer_fingerprint

    class Bare:
        def get_vocab(self) -> dict[str, int]:
            return {"a": 0, "b": 1}

    assert tokenizer_fingerprint(Bare()) == (
        "sha256:"
        + hashlib.sha256(
            b'{"added":[],"class":"Bare","format":"cohortgate.tokenizer.v1","special":{},'
            b'"vocab":[["a",0],["b",1]]}'
        ).hexdigest()
    )


def test_a_fast_tokenizer_is_fingerprinted_by_its_whole_pipeline() -> None:
    """A fast tokenizer: its `tokenizers` pipeline, as that library serializes it, in place
    of the vocabulary (which the pipeline's model holds)."""
    from cohortgate import tokenizer_fingerprint

    class Backend:
        def to_str(self) -> str:
            return '{"model": {"type": "WordLevel", "vocab": {"a": 0}}, "normalizer": null}'

    class Fast:
        def __init__(self) -> None:
            self.backend_tokenizer = Backend()
            self.special_tokens_map = {"unk_token": "<unk>"}

        def get_added_vocab(self) -> dict[str, int]:
            return {"<t>": 1}

    assert tokenizer_fingerprint(Fast()) == (
        "sha256:"
        + hashlib.sha256(
            b'{"added":[["<t>",1]],"class":"Fast","format":"cohortgate.tokenizer.v1",'
            b'"pipeline":{"model":{"type":"WordLevel","vocab":{"a":0}},"normalizer":null},'
            b'"special":{"unk_token":"<unk>"}}'
        ).hexdigest()
    )


def test_a_vocabulary_of_byte_tokens_has_a_fingerprint_that_tells_its_bytes() -> None:
    """Byte-level vocabularies (tiktoken-style tokenizers) hold bytes, not text: they are
    fingerprinted by their printed form, and two that differ by a byte differ."""
    from cohortgate import tokenizer_fingerprint

    class Bytes:
        def __init__(self, last: bytes) -> None:
            self.vocab = {b"a": 0, last: 1}

        def get_vocab(self) -> dict[bytes, int]:
            return self.vocab

    assert tokenizer_fingerprint(Bytes(b"\xe4")) == (
        "sha256:"
        + hashlib.sha256(
            b'{"added":[],"class":"Bytes","format":"cohortgate.tokenizer.v1","special":{},'
            b'"vocab":[["b\'a\'",0],["b\'\\\\xe4\'",1]]}'
        ).hexdigest()
    )
    assert tokenizer_fingerprint(Bytes(b"\xe4")) != tokenizer_fingerprint(Bytes(b"\xe5"))
