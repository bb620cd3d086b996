"""The config, code and facts checks: what every rank must agree on beyond its parameters."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc
import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.contract.fingerprint import Fields, config_fields, fields_of, flatten
from cohortgate.coordinator.contract.layout import layout
from cohortgate.coordinator.contract.manifest import Manifest
from cohortgate.coordinator.decision.checks import Level, Policies
from cohortgate.coordinator.decision.cohort import CohortState, Member
from cohortgate.coordinator.decision.formation import FormationOptions
from cohortgate.coordinator.decision.report import judge
from cohortgate.coordinator.decision.verdict import Cause, Outcome
from tests.helpers import InProcessCoordinator, join_request, manifest_of

OPTS = FormationOptions(join_deadline_s=60)


def state(
    agreed: Mapping[int, Mapping[str, Fields]],
    tp: int = 1,
    built: Mapping[int, Manifest] | None = None,
) -> CohortState:
    """A complete cohort whose ranks sent `agreed`; `built`: ranks that built another model
    (its manifest uploaded)."""
    s = CohortState("j", 1, len(agreed), first_join_at=0.0)
    for r, fingerprints in agreed.items():
        m = (built or {}).get(r, manifest_of())
        lay = None
        if tp > 1:
            decl = layout(r, tp=tp, dp=len(agreed) // tp)
            decl.replicated("fc.weight", (4, 8))
            lay = decl.build()
        s.add(
            Member(
                rank=r,
                host=f"node{r // 2}",
                pid=r,
                incarnation=f"i{r}",
                signature=m.signature(),
                manifest_entries=len(m),
                runtime={"device_type": "cpu"},
                layout=lay,
                agreed=dict(fingerprints),
            ),
            0.0,
        )
        s.manifests[m.signature()] = m
    return s


def config(**values: object) -> Fields:
    return fields_of(config_fields(values))


def decide(s: CohortState, **levels: Level) -> tuple[Outcome, str, str, tuple[str, ...]]:
    opts = FormationOptions(join_deadline_s=60, policies=Policies(levels))
    decision, verdict = judge(s, 1.0, opts)
    assert verdict is not None
    return decision.outcome, verdict.report, verdict.headline, verdict.warnings


def test_a_config_field_that_differs_is_refused_naming_field_values_and_ranks() -> None:
    agreed = {r: {"config": config(num_attention_heads=2 if r else 4, n_layer=2)} for r in range(4)}
    outcome, report, headline, _ = decide(state(agreed))
    assert outcome is Outcome.REFUSED
    assert "config.num_attention_heads: 4 on rank 0, 2 on ranks 1-3" in report, report
    assert "n_layer" not in report
    assert headline.startswith("ranks disagree on the model config: config.num_attention_heads")
    assert "they disagree on the model config" in report.splitlines()[0]


@pytest.mark.parametrize(
    ("field", "odd", "built"),
    [("n_layer", 3, manifest_of(4, extra=2)), ("n_embd", 96, manifest_of(6))],
)
def test_a_config_that_changed_the_shapes_is_the_cause_and_leads_the_report(
    field: str, odd: int, built: Manifest
) -> None:
    """GPT-2's n_layer (more blocks: extra parameters) or n_embd (other shapes) on rank 3:
    the refusal's cause is CONFIG, its headline and first finding are the config field, and
    the shape differences follow as what it caused."""
    from transformers import GPT2Config

    def fields(rank: int) -> Fields:
        values: dict[str, Any] = {"n_layer": 2, "n_embd": 64, "n_head": 4}
        if rank == 3:
            values[field] = odd
        return fields_of(config_fields(GPT2Config(**values).to_dict()))

    s = state({r: {"config": fields(r)} for r in range(4)}, built={3: built})
    decision, verdict = judge(s, 1.0, OPTS)
    assert verdict is not None and decision.cause is Cause.CONFIG, decision
    std = field  # as GPT2Config.to_dict() names it
    assert verdict.headline.startswith(f"ranks disagree on the model config: config.{std}")
    lines = verdict.report.splitlines()
    assert "they disagree on the model config, and so built 2 different models" in lines[0]
    assert lines[1].startswith(f"strict config: config.{std}: "), lines
    config_at = verdict.report.index(f"config.{std}")
    differs_at = verdict.report.index("differs")
    assert config_at < differs_at, "the config fields come before the shapes they caused"
    assert verdict.diffs, "the shape differences are in the verdict"


def test_metadata_keys_and_equal_configs_form() -> None:
    agreed = {
        r: {"config": config(_name_or_path=f"/ckpt/{r}", transformers_version="5", n_head=4)}
        for r in range(4)
    }
    assert decide(state(agreed))[0] is Outcome.FORMED


def test_under_a_layout_the_config_is_global_not_per_replica_group() -> None:
    # tp=2 x dp=2: ranks 1 and 3 are one replica group, 0 and 2 the other; each group
    # agrees within itself, the two groups do not.
    agreed = {r: {"config": config(rope_theta=10000.0 if r % 2 else 500000.0)} for r in range(4)}
    outcome, report, _, _ = decide(state(agreed, tp=2))
    assert outcome is Outcome.REFUSED
    assert "config.rope_theta: 500000.0 on ranks 0,2, 10000.0 on ranks 1,3" in report, report


def test_code_differences_warn_by_default_and_refuse_under_strict() -> None:
    script = {
        r: fields_of({"script": '"train.py sha256:' + ("b" if r == 3 else "a") + '"'})
        for r in range(4)
    }
    agreed = {r: {"code": script[r]} for r in range(4)}
    outcome, _, _, warnings = decide(state(agreed))
    assert outcome is Outcome.FORMED
    assert warnings == (
        'code: code.script: "train.py sha256:a" on ranks 0-2, "train.py sha256:b" on rank 3',
    )
    outcome, report, headline, _ = decide(state(agreed), code=Level.STRICT)
    assert outcome is Outcome.REFUSED
    assert "ranks run different training code" in headline
    assert "--policy code=warn" in report


def test_facts_differing_in_one_key_are_refused_and_a_rank_without_facts_too() -> None:
    facts = {
        r: fields_of(flatten({"data": "mix-v3", "resume_step": 1200 if r else 1100}))
        for r in range(3)
    }
    outcome, report, _, _ = decide(state({r: {"facts": facts[r]} for r in range(3)}))
    assert outcome is Outcome.REFUSED
    assert "facts.resume_step: 1100 on rank 0, 1200 on ranks 1-2" in report, report
    assert "facts.data" not in report
    agreed: dict[int, dict[str, Fields]] = {r: {"facts": facts[1]} for r in range(2)}
    agreed[2] = {}
    outcome, report, _, _ = decide(state(agreed))
    assert outcome is Outcome.REFUSED and "facts: not sent by rank 2" in report, report


def test_a_partial_config_warns_and_a_check_set_off_says_nothing() -> None:
    agreed: dict[int, dict[str, Fields]] = {0: {"config": config(n_head=4)}, 1: {}}
    outcome, _, _, warnings = decide(state(agreed))
    assert outcome is Outcome.FORMED and warnings == ("config: config: not sent by rank 1",)
    different = {r: {"config": config(n_head=4 + r)} for r in range(2)}
    assert decide(state(different), config=Level.OFF)[0] is Outcome.FORMED


def test_many_differing_fields_are_capped_with_a_count() -> None:
    agreed = {r: {"config": config(**{f"f{i:02}": r for i in range(30)})} for r in range(2)}
    _, report, _, _ = decide(state(agreed))
    assert "config.f19: 0 on rank 0, 1 on rank 1" in report
    assert "config.f20" not in report and "and 10 more differing field(s)" in report


@pytest.mark.slow
def test_hugging_face_configs_are_named_by_their_standard_fields() -> None:
    import transformers

    gpt2 = config_fields(transformers.GPT2Config(n_head=4, n_layer=2, n_embd=64))
    assert gpt2["num_attention_heads"] == "4" and "n_head" not in gpt2
    assert "_name_or_path" not in gpt2 and "transformers_version" not in gpt2
    llama = config_fields(
        transformers.LlamaConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_hidden_layers=2,
            rope_theta=500000.0,  # type: ignore[call-arg]
        )
    )
    assert any(k.endswith("rope_theta") and v == "500000.0" for k, v in llama.items()), llama


def test_a_config_of_ten_thousand_keys_is_refused_at_the_limit() -> None:
    c = InProcessCoordinator(join_deadline=10.0)
    try:
        req = join_request("huge-config", 0, 1, manifest_of())
        req.config.fields.update({f"k{i}": "1" for i in range(10_000)})
        with grpc.insecure_channel(c.addr) as channel, pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.CohortServiceStub(channel).Join(req, timeout=10))
    finally:
        c.stop()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "config has 10000 fields; the limit is max_fingerprint_fields=4096" in (
        err.value.details() or ""
    )


def test_every_cause_reaches_the_wire_and_every_agreed_key_is_a_join_field() -> None:
    from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
    from cohortgate.coordinator.contract.fingerprint import AGREED
    from cohortgate.coordinator.edge.replies import _CAUSE_TO_PB

    assert set(_CAUSE_TO_PB) == set(Cause)
    assert len(set(_CAUSE_TO_PB.values())) == len(Cause), "two causes share a wire value"
    join = pb.JoinRequest.DESCRIPTOR.fields_by_name
    for name in AGREED:  # the agent sends it, the coordinator reads it, by this name
        message = join[name].message_type if name in join else None
        assert message is not None and message.name == "Fingerprint", name


def test_every_refusal_is_worded_by_what_refused() -> None:
    """Each check and each of formation's gates owns its words; together they cover every
    cause, and none falls back on another's advice."""
    from cohortgate.coordinator.decision.checks import CHECKS
    from cohortgate.coordinator.decision.checks.gates import GATES
    from cohortgate.coordinator.decision.report import WORDS

    assert {w.cause for w in WORDS.values()} == set(Cause)
    assert set(WORDS) == {w.name for w in (*GATES, *CHECKS)}, "two share a name"
    for check in CHECKS:
        for attr in ("head", "advice", "refusal", "help"):
            assert getattr(check, attr, ""), (check.name, attr)
    by_cause: dict[Cause, set[str]] = {}
    for check in CHECKS:
        by_cause.setdefault(check.cause, set()).add(check.advice)
    model_advice = next(iter(by_cause[Cause.SIGNATURE_MISMATCH]))
    for cause, advice in by_cause.items():
        if cause not in (Cause.SIGNATURE_MISMATCH, Cause.LAYOUT):
            assert model_advice not in advice, f"{cause} refusals get model-building advice"


def test_the_tokenizer_fingerprint_catches_one_added_special_token() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from cohortgate import tokenizer_fingerprint

    def tokenizer() -> PreTrainedTokenizerFast:
        vocab = {"<unk>": 0, "hello": 1, "world": 2}
        backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")  # type: ignore[no-untyped-call]

    same, other = tokenizer(), tokenizer()
    assert tokenizer_fingerprint(same) == tokenizer_fingerprint(other)
    other.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    assert tokenizer_fingerprint(same) != tokenizer_fingerprint(other)
    assert tokenizer_fingerprint(same).startswith("sha256:")
    # The pipeline counts, not only the vocabulary: another pre-tokenizer splits text
    # differently with the same tokens.
    split = tokenizer()
    split.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert tokenizer_fingerprint(split) != tokenizer_fingerprint(same)


# -- the code check's local modules ----------------------------------------------------------
def _modules(files: dict[str, bytes]) -> Fields:
    from cohortgate.coordinator.contract.digests import files_field

    fields = {"git.commit": '"abc123 (local changes)"', "modules": files_field(files.items())}
    return fields_of(fields)


def _files(changed: str = "") -> dict[str, bytes]:
    import hashlib

    names = ("data/loader.py", "helper.py", "model/attn.py")
    return {n: hashlib.sha256(f"{n}{n == changed}".encode()).digest() for n in names}


def test_ranks_whose_local_modules_differ_are_asked_for_their_files_then_the_file_is_named() -> (
    None
):
    odd = {2: _files("helper.py"), 3: _files("helper.py")}
    files = {r: odd.get(r, _files()) for r in range(4)}
    s = code_state(files)
    strict = FormationOptions(join_deadline_s=60, policies=Policies.parse(["code=strict"]))
    waiting, _ = judge(s, 1.0, strict)
    assert waiting.outcome is Outcome.WAITING
    assert (
        waiting.reason == "[4/4 ranks joined, their code differs, waiting for 2 code file list(s)]"
    )
    assert len(waiting.awaiting_files) == 2
    send_lists(s, files, (0, 2))
    refused, verdict = judge(s, 1.1, strict)
    assert refused.outcome is Outcome.REFUSED and refused.cause is Cause.CODE
    assert verdict is not None
    assert verdict.headline.startswith(
        "ranks run different training code: code.modules: 1 file differs: helper.py on ranks "
        "2-3 (node1), against ranks 0-1 (node0)"
    ), verdict.headline


def _key(s: CohortState, rank: int) -> bytes:
    from cohortgate.coordinator.decision.cohort import modules_key

    return modules_key(s.members[rank])


def code_state(files: Mapping[int, dict[str, bytes]], listed: tuple[int, ...] = ()) -> CohortState:
    """A complete cohort whose ranks sent the modules fields of `files`, with the file lists
    of the ranks `listed` come (see send_lists)."""
    s = state({r: {"code": _modules(f)} for r, f in files.items()})
    send_lists(s, files, listed)
    return s


def send_lists(
    s: CohortState, files: Mapping[int, dict[str, bytes]], ranks: tuple[int, ...]
) -> None:
    """The file lists of `ranks` uploaded (one rank per class: what the store keeps)."""
    for r in ranks:
        s.files[_key(s, r)] = tuple(sorted(files[r].items()))


def test_file_lists_that_never_come_still_refuse_once_the_uploads_are_due() -> None:
    s = code_state({r: _files("model/attn.py" if r == 3 else "") for r in range(4)})
    strict = FormationOptions(
        join_deadline_s=60, manifest_timeout_s=5, policies=Policies.parse(["code=strict"])
    )
    assert judge(s, 1.0, strict)[0].outcome is Outcome.WAITING
    refused, verdict = judge(s, 6.0, strict)
    assert refused.outcome is Outcome.REFUSED and verdict is not None
    assert (
        "code.modules: files not named (their ranks did not send the list in time) on rank 3"
        in (verdict.report)
    )


def test_a_file_imported_on_some_ranks_only_is_named_as_such() -> None:
    extra = {**_files(), "debug_hooks.py": b"\x01" * 32}
    s = code_state({r: extra if r == 1 else _files() for r in range(4)}, listed=(0, 1))
    _, verdict = judge(s, 1.0, OPTS)  # code=warn: forms, with the finding
    assert verdict is not None and verdict.outcome is Outcome.FORMED
    assert any(
        "code.modules: 1 file differs: debug_hooks.py (imported only here) on rank 1" in w
        for w in verdict.warnings
    ), verdict.warnings


@pytest.mark.parametrize(
    ("change", "code", "said"),
    [
        ({"paths": ["a.py", "b.py"]}, "INVALID_ARGUMENT", "2 paths for 1 digests"),
        ({"digests": [b"short"]}, "INVALID_ARGUMENT", "digests"),
        ({"paths": [""]}, "INVALID_ARGUMENT", "paths"),
        ({"incarnation": "someone-else"}, "FAILED_PRECONDITION", "is not a member"),
        ({"round": 7}, "NOT_FOUND", "no round 7"),
        ({"job_id": "no-such-job"}, "NOT_FOUND", "no-such-job"),
        ({}, "FAILED_PRECONDITION", "joined without a modules field"),
    ],
)
def test_a_bad_code_file_upload_is_refused_with_a_clear_error(
    change: dict[str, object], code: str, said: str
) -> None:
    import threading

    from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
    from tests.helpers import run_rank, wait_joined

    c = InProcessCoordinator(join_deadline=10)
    try:
        m = manifest_of()
        join = join_request("files-bad", 0, 2, m)
        waiting = threading.Thread(target=run_rank, args=(c.addr, join, m, 15.0), daemon=True)
        waiting.start()
        wait_joined(c.addr, "files-bad", 1)
        upload = pb.UploadFilesRequest(
            job_id="files-bad",
            round=1,
            rank=0,
            incarnation=join.incarnation,
            paths=["a.py"],
            digests=[b"\x00" * 32],
        )
        for name, value in change.items():
            field = getattr(upload, name)
            if isinstance(value, list):
                del field[:]
                field.extend(value)
            else:
                setattr(upload, name, value)
        with grpc.insecure_channel(c.addr) as ch, pytest.raises(grpc.RpcError) as caught:
            pb_grpc.CohortServiceStub(ch).UploadFiles(upload, timeout=10)
        assert caught.value.code().name == code, caught.value.details()
        assert said in (caught.value.details() or "")
    finally:
        c.stop()
