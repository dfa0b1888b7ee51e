"""Every Compose key gpu-swarm knows, one row each: passed on, translated, dropped with what is lost, or refused.

The table in swarm/compose_swarm.py is the one place these are decided; these rows make each
decision fail loudly if it changes, and swarm's own loader (the docker CLI, no engine) judges
every file that is accepted: it must load, and `docker stack deploy` must ignore nothing.
"""
from __future__ import annotations

import re
from textwrap import dedent, indent

import pytest
import yaml

from swarm.compose_swarm import DROPPED, REFUSED, parse_bytes
from swarm.compose_vars import InterpolationError, Variables, interpolate
from swarm.stack_files import StackFileError, validate_stack_file
from tests.test_compose_corpus import swarm_loader

KIND = "NVIDIA-GPU"


def check(text: str, **extra):
    return validate_stack_file(dedent(text), kind=KIND, max_gpus_per_node=4, pool_sizes={"gpu": 4}, **extra)


def one(keys: str, image: str = "busybox:1.36") -> str:
    return f"services:\n  app:\n    image: {image}\n" + indent(dedent(keys), "    ")


VARIABLES = [
    # (text, variables, expected)
    ("$A-${A}", {"A": "a"}, "a-a"),
    ("${B:-d}|${B-d}", {}, "d|d"),
    ("${E:-d}|${E-d}", {"E": ""}, "d|"),
    ("${A:+set}|${B:+set}", {"A": "a"}, "set|"),
    ("${B:-${C:-deep}}", {}, "deep"),
    ("${A:-${C}}", {"A": "a"}, "a"),  # the default is not read while A is set
    ("$$A costs $$5", {}, "$A costs $5"),
]


@pytest.mark.parametrize("text,values,expected", VARIABLES)
def test_interpolation_follows_compose(text, values, expected):
    assert interpolate(text, Variables(values)) == expected


@pytest.mark.parametrize("text,fragment", [
    ("${C}", "${C} is not set"), ("$C", "${C} is not set"), ("${C:?say why}", "${C} is required: say why"),
    ("${C?}", "${C} is required"), ("${1}", "must be followed by a variable name"), ("${A", "after `${A` expected"),
    ("a $ b", "write `$$`"),
])
def test_interpolation_refuses_what_compose_cannot_resolve(text, fragment):
    with pytest.raises(InterpolationError, match=re.escape(fragment)):
        interpolate(text, Variables({"A": "a"}))


@pytest.mark.parametrize("value,expected", [
    ("8g", 8 << 30), ("8gb", 8 << 30), ("16GB", 16 << 30), ("512m", 512 << 20), ("1.5g", 3 << 29),
    ("2GiB", 2 << 30), (1073741824, 1 << 30), ("1024", 1024), ("lots", None),
])
def test_sizes_read_as_compose_reads_them(value, expected):
    from swarm.compose_yaml import load
    assert parse_bytes(load(f"v: {value}")["v"]) == expected


TRANSLATED = [
    # (id, service keys, what the deployed service must hold)
    ("restart-always", "restart: always\n", {"deploy": {"restart_policy": {"condition": "any"}}}),
    ("restart-no", 'restart: "no"\n', {"deploy": {"restart_policy": {"condition": "none"}}}),
    ("restart-on-failure-3", "restart: on-failure:3\n",
     {"deploy": {"restart_policy": {"condition": "on-failure", "max_attempts": 3}}}),
    ("shm-size", "shm_size: 2gb\n", {"volumes": [{"type": "tmpfs", "target": "/dev/shm",
                                                  "tmpfs": {"size": 2 << 30}}]}),
    ("ipc-host", "ipc: host\n", {"volumes": [{"type": "tmpfs", "target": "/dev/shm"}]}),
    ("scale", "scale: 3\n", {"deploy": {"replicas": 3}}),
    ("mem-and-cpus", "mem_limit: 4g\ncpus: 2.5\nmem_reservation: 1g\n",
     {"deploy": {"resources": {"limits": {"memory": "4g", "cpus": "2.5"}, "reservations": {"memory": "1g"}}}}),
    ("network-host", "network_mode: host\nports: ['8096:8096']\n", {"networks": ["host"]}),
]


@pytest.mark.parametrize("case", TRANSLATED, ids=[c[0] for c in TRANSLATED])
def test_a_translated_key_reaches_swarm_in_its_swarm_form(case, tmp_path):
    _, keys, expected = case
    info = check(one(keys))
    app = yaml.safe_load(info.content)["services"]["app"]
    for key, value in expected.items():
        assert app[key] == value, (key, app)
    assert info.rewrites, "each translation is shown at preview"
    swarm_loader(tmp_path, info.content)


@pytest.mark.parametrize("key", sorted(DROPPED))
def test_a_dropped_key_is_left_out_with_what_is_lost(key, tmp_path):
    value = {"container_name": "app", "expose": "['80']", "depends_on": "[db]", "develop": "{watch: []}",
             "pull_policy": "always", "platform": "linux/amd64", "annotations": "{a: b}", "memswap_limit": "2g",
             "build": "."}[key]
    text = one(f"{key}: {value}\n") + "  db:\n    image: postgres:16\n"
    info = check(text)
    assert key not in yaml.safe_load(info.content)["services"]["app"]
    (warning,) = [w for w in info.warnings if w.startswith(f"{key} (services app)")]
    assert DROPPED[key] in warning
    swarm_loader(tmp_path, info.content)


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_a_refused_key_names_the_service_and_the_fix(key):
    with pytest.raises(StackFileError) as err:
        check(one(f"{key}: x\n") + f"  other:\n    image: busybox:1.36\n    {key}: x\n")
    (problem,) = [p for p in err.value.problems if f".{key}:" in p]
    assert problem == f"services.app.{key}: {REFUSED[key]} (the same in services other)"


@pytest.mark.parametrize("keys,fragment", [
    ("volumes: ['./data:/data']\n", "services.app.volumes[0]: ./data is a path on the machine that deploys"),
    ("volumes: ['~/models:/models']\n", "services.app.volumes[0]: ~/models"),
    ("volumes: [{type: bind, source: ../cache, target: /cache}]\n", "services.app.volumes[0]: ../cache"),
    ("volumes: ['models:/models']\n", "the named volume 'models' is not declared"),
    ("network_mode: service:db\n", "network_mode: 'service:db'"),
    ("network_mode: host\nnetworks: [default]\n", "host with `networks`"),
    ("ipc: container:db\n", "cannot share another container's IPC namespace"),
    ("restart: sometimes\n", "'sometimes' is not a restart policy"),
    ("shm_size: lots\n", "'lots' is not a size"),
    ("cpu_count: 2\n", "use deploy.resources.limits.cpus"),
    ("oom_score_adj: 5\nuts: host\n", "services.app.uts: not a setting swarm services have"),
])
def test_what_swarm_cannot_honour_is_refused_at_preview(keys, fragment):
    with pytest.raises(StackFileError) as err:
        check(one(keys))
    assert any(fragment in p for p in err.value.problems), err.value.problems


def test_a_relative_bind_in_many_services_is_said_once():
    text = "services:\n" + "".join(f"  s{i}:\n    image: busybox:1.36\n    volumes: ['./data:/data']\n"
                                   for i in range(12))
    with pytest.raises(StackFileError) as err:
        check(text)
    (problem,) = err.value.problems
    assert problem.startswith("services.s0.volumes[0]: ./data") and "(the same in services s1, s2," in problem


@pytest.mark.parametrize("version,expected", [('"3.3"', "3.6"), ('"3.5"', "3.6"), ('"3.8"', "3.8"), ('"3"', "3")])
def test_version_is_raised_to_what_the_added_keys_need(version, expected, tmp_path):
    text = f"version: {version}\n" + one("shm_size: 1g\n" + dedent("""\
        deploy:
          resources:
            reservations:
              devices: [{driver: nvidia, count: 1, capabilities: [gpu]}]
        """))
    info = check(text)
    assert str(yaml.safe_load(info.content)["version"]) == expected
    swarm_loader(tmp_path, info.content)


@pytest.mark.parametrize("version", ['"2.4"', '"2"', '"1"'])
def test_compose_format_2_is_refused_clearly(version):
    with pytest.raises(StackFileError, match="which swarm does not read; remove the `version` line"):
        check(f"version: {version}\n" + one("restart: always\n"))


def test_top_level_name_is_left_out_and_the_stack_keeps_its_config_name(tmp_path):
    info = check("name: my-project\n" + one("restart: always\n"))
    assert "name" not in yaml.safe_load(info.content)
    assert any(w.startswith("name: 'my-project' left out") for w in info.warnings)
    swarm_loader(tmp_path, info.content)


def test_a_dollar_that_is_text_stays_text_after_swarms_own_interpolation(tmp_path):
    info = check(one("command: [sh, -c, 'echo $$HOME costs $$5 ${GREETING:-hi}']\n"))
    loaded = swarm_loader(tmp_path, info.content)["services"]["app"]
    assert loaded["command"] == ["sh", "-c", "echo $HOME costs $5 hi"]


def test_build_beside_an_image_says_every_node_must_pull_that_image(tmp_path):
    info = check(one("build: ./trainer\n", image="trainer:dev"))
    assert "build" not in yaml.safe_load(info.content)["services"]["app"]
    (warning,) = [w for w in info.warnings if w.startswith("services.app.build: left out")]
    assert "'trainer:dev'" in warning and "push it to a registry that every node can pull from" in warning
    swarm_loader(tmp_path, info.content)


PORTS = [
    # (id, ports of service a, ports of service b, the port both publish, or None)
    ("same-short", "['8080:80']", "['8080:8080']", "8080/tcp"),
    ("long-and-short", "[{target: 80, published: 8080}]", "['8080:80']", "8080/tcp"),
    ("range-overlap", "['9000-9002:9000-9002']", "['9001:80']", "9001/tcp"),
    ("udp-beside-tcp", "['5000:5000/udp']", "['5000:5000']", None),
    ("host-mode", "[{target: 80, published: 8080, mode: host}]", "[{target: 80, published: 8080, mode: host}]", None),
    ("targets-only", "['80']", "['80']", None),
]


@pytest.mark.parametrize("case", PORTS, ids=[c[0] for c in PORTS])
def test_a_port_two_services_publish_is_refused_naming_both(case, tmp_path):
    _, a, b, both = case
    text = one(f"ports: {a}\n") + f"  other:\n    image: busybox:1.36\n    ports: {b}\n"
    if both is None:
        swarm_loader(tmp_path, check(text).content)
        return
    with pytest.raises(StackFileError) as err:
        check(text)
    (problem,) = err.value.problems
    assert problem.startswith(f"ports: {both} is published by services.app.ports[0] and services.other.ports[0]")


def test_an_unset_variable_hides_no_other_check_and_is_not_judged_again():
    text = one("""\
        command: ["serve", "${MODEL}"]
        ports: ["${PORT}:80"]
        volumes: ["${DATA_DIR}:/data", "./cache:/cache"]
        """) + "  other:\n    image: busybox:1.36\n    ports: ['${PORT}:80']\n    privileged: true\n"
    with pytest.raises(StackFileError) as err:
        check(text)
    problems = err.value.problems
    assert [p.split(":")[0] for p in problems] == [
        "services.app.command[1]", "services.app.ports[0]", "services.app.volumes[0]", "services.app.volumes[1]",
        "services.other.privileged"], problems
    assert problems[1].endswith("(the same in services other)")
    assert not [p for p in problems if "not declared" in p or "is published by" in p], problems


@pytest.mark.parametrize("source,fix", [
    ("./nginx.conf:/etc/nginx/nginx.conf:ro", "docker config create nginx.conf ./nginx.conf"),
    ("./data:/data", "named volume (`data:/data`"),
])
def test_a_relative_bind_is_told_what_to_become_by_what_it_holds(source, fix):
    """With no folder to look in (the rehearsal's --stack), a file is known by its name."""
    with pytest.raises(StackFileError) as err:
        check(one(f"volumes: ['{source}']\n"))
    (problem,) = err.value.problems
    assert fix in problem, problem


def test_an_absolute_bind_names_the_pools_it_must_exist_on(tmp_path):
    from swarm.labels import POOL_GPU_COUNT_LABEL, POOL_LABEL, POOL_SLOTS_PER_GPU_LABEL
    pools = {p: {POOL_LABEL: p, POOL_GPU_COUNT_LABEL: n, POOL_SLOTS_PER_GPU_LABEL: "0"}
             for p, n in (("a10", "1"), ("h100", "8"))}
    info = check(one("volumes: ['/srv/models:/models:ro', '/var/run/docker.sock:/var/run/docker.sock']\n" + dedent("""\
        deploy:
          resources:
            reservations:
              devices: [{driver: nvidia, count: 4, capabilities: [gpu]}]
        """)), pools=pools)
    (warning,) = [w for w in info.warnings if "must exist" in w]
    assert warning.startswith("services.app.volumes[0]: the bind source /srv/models must exist on every node of the "
                              "pool h100: swarm does not create it")  # a10's single GPU cannot take 4
    swarm_loader(tmp_path, info.content)


def test_an_extends_cycle_is_a_file_and_service_met_twice_and_hides_no_other_service(tmp_path):
    (tmp_path / "b.yml").write_text("services:\n  app:\n    extends: {file: a.yml, service: app}\n")
    (tmp_path / "a.yml").write_text("services:\n  app:\n    extends: {file: b.yml, service: app}\n")
    text = ("services:\n  app:\n    extends: {file: a.yml, service: app}\n"
            "  web:\n    image: nginx:1.27\n    volumes: ['./site:/usr/share/nginx/html']\n")
    with pytest.raises(StackFileError) as err:
        check(text, base_dir=tmp_path)
    cycle, bind = err.value.problems
    assert cycle == ("a.yml: services.app.extends: extends itself through app (this file) -> app (a.yml) -> "
                     "app (b.yml) -> app (a.yml)")
    assert bind.startswith("services.web.volumes[0]: ./site")
