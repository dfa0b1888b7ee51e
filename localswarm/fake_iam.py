"""The fake account's IAM: the roles, instance profiles and inline policies the program makes, and what IAM allows.

The mocks (tests/conftest.py) and the rehearsal's AWS stand-in (localswarm/fake_aws_api.py) evaluate the
program's own policy documents with iam_allows, so a policy that does not allow a call the node software
makes fails there, as AWS would refuse it.
"""
from __future__ import annotations

import fnmatch
import json

from localswarm.fake_account import ACCOUNT, ACCOUNT_ID, _digest


def iam_role(name: str, inputs: dict) -> tuple[str, dict]:
    """CreateRole (aws.iam.Role, auto-named as the provider names it: the resource's name and a suffix)."""
    role = f"{name}-{_digest(name, 7)}"
    ACCOUNT.roles.setdefault(role, {"policies": {}})
    return role, {**inputs, "name": role, "arn": f"arn:aws:iam::{ACCOUNT_ID}:role/{role}"}


def instance_profile(name: str, inputs: dict) -> tuple[str, dict]:
    """CreateInstanceProfile and AddRoleToInstanceProfile (aws.iam.InstanceProfile)."""
    profile = f"{name}-{_digest(name, 7)}"
    ACCOUNT.profiles[profile] = inputs.get("role")
    return profile, {**inputs, "name": profile, "arn": f"arn:aws:iam::{ACCOUNT_ID}:instance-profile/{profile}"}


def role_policy(name: str, inputs: dict) -> tuple[str, dict]:
    """PutRolePolicy (aws.iam.RolePolicy): an inline policy of the role; its id is role:policy, as the provider's."""
    policy = f"{name}-{_digest(name, 7)}"
    ACCOUNT.roles.setdefault(inputs["role"], {"policies": {}})["policies"][policy] = json.loads(inputs["policy"])
    return f"{inputs['role']}:{policy}", {**inputs, "name": policy}


def iam_allows(documents: list[dict], action: str, resource: str) -> bool:
    """Whether identity policies allow `action` on `resource`: an Allow statement whose Action and Resource match
    (IAM's * and ? wildcards, actions case-insensitively), and no Deny that matches (IAM User Guide, "Policy
    evaluation logic": an explicit deny wins; nothing allowed is denied)."""
    def matches(patterns, value: str, fold: bool) -> bool:
        patterns = [patterns] if isinstance(patterns, str) else list(patterns or [])
        return any(fnmatch.fnmatchcase(value.lower() if fold else value, p.lower() if fold else p) for p in patterns)
    verdicts = [s["Effect"] for d in documents for s in d.get("Statement", [])
                if matches(s.get("Action"), action, True) and matches(s.get("Resource"), resource, False)]
    return "Allow" in verdicts and "Deny" not in verdicts

