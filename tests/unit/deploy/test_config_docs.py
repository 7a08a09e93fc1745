"""docs/config.md (deploy/configdoc.py): current, complete; `relay <service> --help` points at it with a
`--set` example the service accepts; `relay config show RUN`; errors that never dump a whole config."""

import json
import typing

import pytest
from pydantic import BaseModel

from broker.runtime.config import ConfigError, load_config, set_overrides
from deploy import cli
from deploy.configdoc import render, services
from tests.support.services import ROOT

DOC = ROOT / "docs" / "config.md"


def test_the_committed_reference_is_what_the_models_generate():
    assert DOC.read_text() == render(), (
        "docs/config.md is stale: regenerate it with `.venv/bin/relay config docs > docs/config.md`"
    )


def _paths(prefix: str, model: type[BaseModel]):
    """Every field path, walked independently of the generator (unions: every member)."""
    for name, f in model.model_fields.items():
        yield f"{prefix}.{name}", f
        stack = [f.annotation]
        while stack:
            ann = stack.pop()
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                yield from _paths(f"{prefix}.{name}", ann)
            elif (
                typing.get_origin(ann) is dict
                and isinstance(typing.get_args(ann)[-1], type)
                and issubclass(typing.get_args(ann)[-1], BaseModel)
            ):
                yield from _paths(f"{prefix}.{name}.<name>", typing.get_args(ann)[-1])
            else:
                stack.extend(typing.get_args(ann))


def test_every_field_of_every_service_is_listed_with_its_default_and_description():
    text = DOC.read_text()
    rows: dict[str, str] = {}  # path -> its rows (a union's members share paths)
    for line in text.splitlines():
        if line.startswith("| `"):
            path = line.split("|")[1].strip().strip("`")
            rows[path] = rows.get(path, "") + line
    n = 0
    for service, model in services():
        for path, f in _paths(service, model):
            assert path in rows, f"{path} is missing from docs/config.md"
            if f.description:
                assert " ".join(f.description.split())[:40].replace("|", "\\|") in rows[path], path
            n += 1
    assert n > 150 and "`generator.sampling.max_tokens` | int | `8` | ≥ 1, ≤ 1048576" in text
    assert "`learner.publish.keep_versions` | int | `4` | ≥ 1" in text


def test_every_renamed_key_is_in_the_migration_table():
    from generators.config import RENAMED as GENERATOR
    from learner.config import RENAMED as LEARNER

    text = DOC.read_text()
    for service, table in (("learner", LEARNER), ("generator", GENERATOR)):
        for old, new in table.items():
            assert f"| `{service}.{old}` | `{service}.{new}` |" in text, old


@pytest.mark.parametrize("service", ["broker", "reward", "generator", "learner"])
def test_service_help_points_at_the_reference_with_a_set_example_it_accepts(service, capsys):
    with pytest.raises(SystemExit):
        cli.main([service, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "docs/config.md" in text and f"--set {cli.SET_EXAMPLES[service]}" in text
    load_config(dict(services())[service], None, set_overrides([cli.SET_EXAMPLES[service]]), environ={})


def test_the_old_example_is_refused_where_it_was_shown():
    from learner.config import LearnerConfig

    with pytest.raises(ConfigError) as e:
        load_config(LearnerConfig, None, set_overrides(["sampling.temperature=0.7"]), environ={})
    assert "sampling: unknown field" in str(e.value) and "docs/config.md" in str(e.value)


def test_a_model_level_error_does_not_dump_the_config():
    from broker.config import BrokerConfig

    with pytest.raises(ConfigError) as e:  # a dataset without a held-out set: the model validator's error
        load_config(
            BrokerConfig, None, {"dataset": {"path": "d.jsonl"}, "ingest_bind": "tcp://127.0.0.1:7"}, environ={}
        )
    msg = str(e.value)
    assert "held-out set" in msg and "ingest_bind" not in msg and "d.jsonl" not in msg and len(msg) < 400


def test_config_show_prints_a_runs_effective_config(tmp_path, capsys):
    cfg = tmp_path / "runs" / "r1" / "config"
    cfg.mkdir(parents=True)
    (cfg / "learner.json").write_text(json.dumps({"run_id": "r1", "steps": 12}))
    (cfg / "reward.json").write_text(json.dumps({"port": 9000, "auth_token": "s3cret"}))
    (cfg / "generator-0.json").write_text(json.dumps({"run_id": "r1", "id": "gen-0", "sampling": {"temperature": 0.5}}))
    assert cli.main(["config", "show", "r1", "--runs-dir", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    blocks = {b.split("\n", 1)[0]: json.loads(b.split("\n", 1)[1]) for b in out.strip().split("\n\n")}
    learner = blocks[f"# {cfg / 'learner.json'}"]
    assert (
        learner["steps"] == 12 and learner["publish"]["keep_versions"] == 4 and learner["optim"]["lr"] == 0.001
    )  # defaults filled
    assert blocks[f"# {cfg / 'generator-0.json'}"]["sampling"] == {
        "n": 8,
        "temperature": 0.5,
        "top_p": 1.0,
        "top_k": 0,
        "max_tokens": 8,
    }
    reward = blocks[f"# {cfg / 'reward.json'}"]
    assert reward["port"] == 9000 and reward["auth_token"] == "(set)" and "s3cret" not in out
    assert cli.main(["config", "show", "nope", "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "not a run folder" in capsys.readouterr().err
