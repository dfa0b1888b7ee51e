"""A stack's Compose profiles, variables and secrets, from the stack config to what the deploy sends.

Under the mocks, as `pulumi up` runs the program: bad values are refused at preview with the
key and the fix; profiles and variables change what is deployed; a secret reaches the deploy
only as a Pulumi secret, and never any output, log line or hash in clear.
"""
from __future__ import annotations

import hashlib
import json
from textwrap import dedent

import pulumi
import pytest

import settings
from settings import SettingsError, load_settings
from tests.conftest import request_inputs, run_program, stack_config, unwrap, use_mocks

LLM = dedent("""\
    # An LLM server with a GPU and a CPU variant, as projects publish them.
    services:
      llm-cuda:
        profiles: [cuda]
        image: ghcr.io/example/llm:${LLM_TAG:-1.0}
        command: ["serve", "--model", "${MODEL:?name the model}"]
        environment:
          HF_TOKEN: ${HF_TOKEN}
        deploy:
          resources:
            reservations:
              devices:
                - driver: nvidia
                  count: 1
                  capabilities: [gpu]
      llm-cpu:
        profiles: [cpu]
        image: ghcr.io/example/llm:${LLM_TAG:-1.0}-cpu
        command: ["serve", "--model", "${MODEL:?name the model}"]
        environment:
          HF_TOKEN: ${HF_TOKEN}
    """)
TOKEN = "hf_s3cr3tT0kenValue"


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "stacks").mkdir()
    (tmp_path / "stacks" / "llm.yml").write_text(LLM)
    monkeypatch.setattr(settings.reader, "PROJECT_DIR", tmp_path)
    return tmp_path


def llm_stack(**extra) -> list[dict]:
    return [{"name": "llm", "file": "stacks/llm.yml", "profiles": ["cuda"],
             "variables": {"MODEL": "meta-llama/Llama-3.1-8B-Instruct"}, **extra}]


BAD = [
    # (id, config overrides, secret keys, fragments of the one problem)
    ("profiles-not-a-list", {"stacks": llm_stack(profiles="cuda")}, (),
     ["gpu-swarm:stacks[0].profiles: expected a list of Compose profile names",
      "--path 'stacks[0].profiles[0]' cuda"]),
    ("profile-unknown", {"stacks": llm_stack(profiles=["gpu"])}, (),
     ["gpu-swarm:stacks[0].file: stacks/llm.yml: profiles: 'gpu' is no profile of the file (its profiles: cpu, cuda)"]),
    ("variables-not-an-object", {"stacks": llm_stack(variables=["MODEL=x"])}, (),
     ["gpu-swarm:stacks[0].variables: expected an object", "--path 'stacks[0].variables.MODEL'"]),
    ("variable-name", {"stacks": llm_stack(variables={"MODEL": "x", "2FAST": "y"})}, (),
     ["gpu-swarm:stacks[0].variables.2FAST: is not a variable name"]),
    ("variable-value", {"stacks": llm_stack(variables={"MODEL": {"name": "x"}})}, (),
     ["gpu-swarm:stacks[0].variables.MODEL: expected a text, number or boolean value"]),
    ("required-variable", {"stacks": llm_stack(variables={})}, (),
     ["gpu-swarm:stacks[0].file: stacks/llm.yml: services.llm-cuda.command[2]: ${MODEL} is required: name the model",
      "variables: {MODEL: ...}"]),
    ("unset-variable", {"stacks": llm_stack()}, (),
     ["services.llm-cuda.environment.HF_TOKEN: ${HF_TOKEN} is not set, and the file gives it no default",
      "stackSecrets.<stack>.HF_TOKEN"]),
    ("secrets-in-plain-text", {"stacks": llm_stack(), "stackSecrets": {"llm": {"HF_TOKEN": TOKEN}}}, (),
     ["gpu-swarm:stackSecrets: is stored in plain text", "pulumi config set --secret --path"]),
    ("secrets-unknown-stack", {"stacks": llm_stack(variables={"MODEL": "m", "HF_TOKEN": ""}),
                               "stackSecrets": {"lm": {"HF_TOKEN": TOKEN}}}, ("gpu-swarm:stackSecrets",),
     ["gpu-swarm:stackSecrets.lm: names no stack of gpu-swarm:stacks; did you mean llm?"]),
    ("secret-and-variable", {"stacks": llm_stack(variables={"MODEL": "m", "HF_TOKEN": ""}),
                             "stackSecrets": {"llm": {"HF_TOKEN": TOKEN}}}, ("gpu-swarm:stackSecrets",),
     ["gpu-swarm:stackSecrets.llm: HF_TOKEN also set in stacks[0].variables; keep the secret one"]),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_stack_config_is_refused_at_preview_with_the_key_and_the_fix(project, case):
    _, overrides, secret_keys, fragments = case
    use_mocks(stack_config("dev", **overrides), secret_keys)
    with pytest.raises(SettingsError) as err:
        load_settings()
    matching = [p for p in err.value.problems if all(f in p for f in fragments)]
    assert len(matching) == 1, "\n".join(err.value.problems)
    assert TOKEN not in str(err.value)


def test_profiles_and_variables_choose_what_is_deployed(project):
    use_mocks(stack_config("dev", stacks=llm_stack(variables={"MODEL": "m1", "HF_TOKEN": "", "LLM_TAG": "2.1"})))
    (stack,) = load_settings().stacks
    assert [s.name for s in stack.info.services] == ["llm-cuda"]
    assert "image: ghcr.io/example/llm:2.1\n" in stack.content and '"m1"' in stack.content
    assert "llm-cpu" in " ".join(stack.info.warnings) and "profiles" not in stack.content

    use_mocks(stack_config("dev", stacks=llm_stack(profiles=["cpu"], variables={"MODEL": "m1", "HF_TOKEN": ""})))
    (stack,) = load_settings().stacks
    assert [s.name for s in stack.info.services] == ["llm-cpu"] and "ghcr.io/example/llm:1.0-cpu" in stack.content


RAG = dedent("""\
    services:
      llm:
        image: ghcr.io/example/llm:1.0
        profiles: ["", rag]
        deploy:
          replicas: ${LLM_REPLICAS:-1}
          resources:
            reservations:
              devices: [{driver: nvidia, count: 1, capabilities: [gpu]}]
      ingestor:
        image: ghcr.io/example/ingest:1.0
        profiles: [ingest]
    """)


def test_compose_default_profile_runs_without_a_profile_and_the_setting_may_name_it(project):
    """profiles: ["", rag] runs under a plain `docker compose up`; ["", ingest] is COMPOSE_PROFILES=,ingest."""
    (project / "stacks" / "rag.yml").write_text(RAG)
    use_mocks(stack_config("dev", stacks=[{"name": "rag", "file": "stacks/rag.yml"}]))
    (stack,) = load_settings().stacks
    assert [s.name for s in stack.info.services] == ["llm"]
    use_mocks(stack_config("dev", stacks=[{"name": "rag", "file": "stacks/rag.yml", "profiles": ["", "ingest"]}]))
    (stack,) = load_settings().stacks
    assert [s.name for s in stack.info.services] == ["llm", "ingestor"]


def test_more_gpus_than_the_pools_hold_is_said_at_preview_with_the_pools(project, monkeypatch):
    """dev's one pool, t4, is one node of one GPU: a second replica would wait, and `up` would succeed."""
    (project / "stacks" / "rag.yml").write_text(RAG)
    said = []
    monkeypatch.setattr(pulumi.log, "warn", lambda msg, *a, **k: said.append(msg))
    stacks = [{"name": "rag", "file": "stacks/rag.yml", "variables": {"LLM_REPLICAS": "2"}}]
    use_mocks(stack_config("dev", stacks=stacks))
    (stack,) = load_settings().stacks
    (warning,) = [w for w in stack.info.warnings if "whole GPUs" in w]
    assert warning.startswith("the stack reserves 2 whole GPUs, but the pools its GPU services can land on hold 1 "
                              "(t4: 1 node × 1)") and "llm 2 × 1" in warning
    run_program(stack_config("dev", stacks=stacks), stack="dev")
    assert f"stack rag: {warning}" in said  # shown at preview beside the stack's resource


def test_a_secret_reaches_the_deploy_only_as_a_secret_and_nothing_shows_it(project, monkeypatch):
    said = []
    monkeypatch.setattr(pulumi.log, "info", lambda msg, *a, **k: said.append(msg))
    monkeypatch.setattr(pulumi.log, "warn", lambda msg, *a, **k: said.append(msg))
    config = stack_config("dev", stacks=llm_stack(), stackSecrets={"llm": {"HF_TOKEN": TOKEN}})
    run = run_program(config, ("gpu-swarm:stackSecrets",), stack="dev")

    request = run.monitor.requests["gpu-swarm-stack-llm-deploy"]
    inputs = request_inputs(request)
    assert TOKEN in unwrap(inputs)["stdin"]  # the task gets its token...
    raw = json.dumps(inputs)
    assert TOKEN not in raw.replace(json.dumps(unwrap(inputs)["stdin"]), "")  # ...only inside the secret stdin
    assert unwrap(inputs)["stdin"] != inputs["stdin"], "stdin must be a Pulumi secret"
    assert TOKEN not in json.dumps(run.exports) and not any(TOKEN in m for m in said)
    shown = run.exports["stacks"]["llm"]
    use_mocks(config, ("gpu-swarm:stackSecrets",), stack="dev")
    (stack,) = load_settings().stacks
    assert "[secret HF_TOKEN]" in stack.info.shown and TOKEN not in stack.info.shown
    assert shown["sha256"] == hashlib.sha256(stack.info.shown.encode()).hexdigest()
    assert hashlib.sha256(stack.content.encode()).hexdigest() != shown["sha256"]  # no hash of the secret in clear


def test_a_new_secret_redeploys_the_stack_and_an_unchanged_one_does_not(project):
    from tests.test_plan import plan

    def config(token: str) -> dict:
        return stack_config("dev", stacks=llm_stack(), stackSecrets={"llm": {"HF_TOKEN": token}})

    keys = ("gpu-swarm:stackSecrets",)
    assert plan(config(TOKEN), config(TOKEN), secret_keys=keys, stack="dev").changed() == set()
    rotated = plan(config(TOKEN), config(TOKEN + "2"), secret_keys=keys, stack="dev")
    assert rotated.changed() == {"gpu-swarm-stack-llm-deploy"}
    assert rotated.updated["gpu-swarm-stack-llm-deploy"] == {"stdin"}  # an update re-runs the deploy
