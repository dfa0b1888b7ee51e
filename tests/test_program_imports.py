"""`program up` loads the program's libraries while the rehearsal's own infrastructure starts
(localswarm/program.py PROGRAM_IMPORTS). The list must be what the program really loads: a package
missing from it is loaded later, in the program's time; one the program no longer uses costs a load
for nothing. Each run is a fresh interpreter, so that nothing another test imported counts."""
from __future__ import annotations

import json
import subprocess
import sys

from localswarm.program import PROGRAM_IMPORTS
from tests.conftest import REPO

# The service packages the program loaded under one stack's config, after it ran under the mocks: the
# loaded subpackages (a lazy one is no plain module; asking it for __path__ would load it).
LOADED = """
import json, sys, types
sys.path.insert(0, {repo!r})
from tests.conftest import run_program
from localswarm.stack_config import stack_config
run_program(stack_config({stack!r}))
print(json.dumps(sorted(name for name, module in sys.modules.items()
                        if name.count(".") == 1 and name.split(".")[0] in ("pulumi_aws", "pulumi_command")
                        and type(module) is types.ModuleType and hasattr(module, "__path__"))))
"""


def loaded_by(stack: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", LOADED.format(repo=str(REPO), stack=stack)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_the_preloaded_packages_are_those_the_dev_and_prod_stacks_load():
    libraries = {name for name in PROGRAM_IMPORTS if name.startswith(("pulumi_aws.", "pulumi_command."))}
    assert loaded_by("dev") | loaded_by("prod") == libraries


def test_the_program_modules_it_preloads_are_those_its_main_imports():
    main = (REPO / "__main__.py").read_text()
    own = [name for name in PROGRAM_IMPORTS if not name.startswith(("pulumi_aws.", "pulumi_command."))]
    assert own and all(f"from {name} import" in main for name in own), own


def test_a_preloaded_package_is_loaded_whole_not_left_lazy():
    check = ("import sys, types; sys.path.insert(0, {repo!r}); from localswarm.program import _load; "
             "_load(('pulumi_aws.ec2',)); module = sys.modules['pulumi_aws.ec2']; "
             "print(type(module) is types.ModuleType and 'Instance' in vars(module))")
    done = subprocess.run([sys.executable, "-c", check.format(repo=str(REPO))], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["True"], done.stderr[-2000:]
