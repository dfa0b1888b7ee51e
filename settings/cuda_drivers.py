"""Which CUDA each NVIDIA driver branch runs, and what an image's NVIDIA_REQUIRE_CUDA asks of it.

The one copy of the driver-branch table. Source: NVIDIA's CUDA Toolkit release notes, table
"CUDA Toolkit and Corresponding Driver Versions" (docs.nvidia.com/cuda/cuda-toolkit-release-notes):
each toolkit's minimum Linux driver, e.g. CUDA 13.0 GA >= 580.65.06, 12.8 GA >= 570.26, 12.4 GA
>= 550.54.14. A branch runs the newest CUDA whose minimum it meets, as `nvidia-smi` prints it
("CUDA Version: 13.0" on 580). Add a row when a branch ships; a branch not listed is refused
by name, not guessed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

MAX_CUDA_BY_BRANCH: dict[int, tuple[int, int]] = {
    590: (13, 1),
    580: (13, 0),
    575: (12, 9),
    570: (12, 8),
    565: (12, 7),
    560: (12, 6),
    555: (12, 5),
    550: (12, 4),
    545: (12, 3),
    535: (12, 2),
    530: (12, 1),
    525: (12, 0),
    520: (11, 8),
    515: (11, 7),
    510: (11, 6),
    470: (11, 4),
}


def max_cuda(branch: int) -> tuple[int, int]:
    """The newest CUDA version a driver of this branch (e.g. 580) runs."""
    try:
        return MAX_CUDA_BY_BRANCH[branch]
    except KeyError:
        known = ", ".join(str(b) for b in sorted(MAX_CUDA_BY_BRANCH))
        raise ValueError(f"driver branch {branch} is not in settings/cuda_drivers.py's table ({known}); "
                         "add its row from NVIDIA's CUDA toolkit release notes") from None


def version_text(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


_CONDITION = re.compile(r"^(cuda|driver|brand|arch)\s*(>=|<=|==|=|>|<)\s*(\S+)$")


@dataclass(frozen=True)
class Requirement:
    """NVIDIA_REQUIRE_CUDA as nvidia-container-toolkit reads it: alternatives (space-separated),
    each a set of conditions that must all hold (comma-separated)."""

    text: str
    alternatives: tuple[tuple[tuple[str, str, str], ...], ...]

    @property
    def cuda(self) -> tuple[int, int] | None:
        """The CUDA version the first alternative asks for (cuda>=X.Y), for messages."""
        for alternative in self.alternatives:
            for name, op, value in alternative:
                if name == "cuda" and op in (">=", ">", "=", "=="):
                    return _version(value)
        return None

    def met_by(self, branch: int) -> bool:
        """Whether a node with a driver of this branch starts the image.

        Only the branch is known before the node boots: a driver bound holds when the branch's
        versions (580.x) all meet it. A brand (tesla, nvidia...) depends on the GPU, not the
        driver: the check does not refuse over it.
        """
        cuda = max_cuda(branch)
        return any(all(_holds(c, branch, cuda) for c in alt) for alt in self.alternatives)


def parse_requirement(text: str) -> Requirement:
    """Raises ValueError naming the condition that is not one the toolkit reads."""
    alternatives = []
    for alternative in text.split():
        conditions = []
        for condition in alternative.split(","):
            match = _CONDITION.match(condition.strip())
            if not match or (match[1] in ("cuda", "driver") and _version(match[3]) is None):
                raise ValueError(f"{condition!r} is not a condition nvidia-container-toolkit reads "
                                 "(cuda>=12.4, driver>=535, brand=tesla)")
            conditions.append((match[1], match[2], match[3]))
        alternatives.append(tuple(conditions))
    return Requirement(text, tuple(alternatives))


def _version(text: str) -> tuple[int, int] | None:
    match = re.match(r"^(\d+)(?:\.(\d+))?", text)
    return (int(match[1]), int(match[2] or 0)) if match else None


def _compare(have: tuple[int, int], op: str, want: tuple[int, int]) -> bool:
    return {">=": have >= want, ">": have > want, "<=": have <= want, "<": have < want,
            "=": have == want, "==": have == want}[op]


def _holds(condition: tuple[str, str, str], branch: int, cuda: tuple[int, int]) -> bool:
    name, op, value = condition
    if name == "cuda":
        return _compare(cuda, op, _version(value))
    if name == "driver":
        want = _version(value)
        # Every version of the branch must meet the bound: driver>=470 holds on 470.x, driver<471 too.
        low, high = (branch, 0), (branch, 10**6)
        return _compare(low, op, want) and _compare(high, op, want) if op != "==" and op != "=" else False
    return True  # brand and arch: the GPU's, not known before boot
