"""scripts/env.sh (issue 37, item 10): the torch the user's python already imports is reused, never installed a
second time, and the packages that require torch (torchft: torch>=2.7) resolve against it.

The user's environment is stood in for by a venv whose site-packages reach this environment's packages through a
.pth file, less torchft and its opentelemetry dependencies, which env.sh must then install: no torch wheel is
copied or downloaded, and pip has a few small packages to fetch from the configured index."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from tests.launch import ROOT

LEFT_FOR_PIP = ("torchft", "opentelemetry")  # what the stand-in lacks: env.sh must install it over the reused torch


def _stand_in(tmp: Path) -> Path:
    """A python whose environment has this torch (in a folder outside it, as a conda or system torch is) and the
    project's other packages, but not torchft. Returns its bin folder."""
    packages = tmp / "user-site"
    packages.mkdir()
    for site in dict.fromkeys([os.path.dirname(os.path.dirname(torch.__file__)), sysconfig.get_paths()["purelib"]]):
        for name in os.listdir(site):
            if not name.lower().startswith(LEFT_FOR_PIP) and not name.endswith(".pth") and name != "__pycache__" \
                    and not (packages / name).exists():
                (packages / name).symlink_to(os.path.join(site, name))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "user")], check=True)
    purelib = subprocess.run([str(tmp / "user/bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "user-site.pth").write_text(f"{packages}\n")
    return tmp / "user/bin"


def test_env_sh_reuses_the_active_torch_and_resolves_torchft_against_it(tmp_path):
    bin_dir = _stand_in(tmp_path)
    venv = tmp_path / "venv"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TESSERA_VENV": str(venv), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    script = (f'source {ROOT}/scripts/env.sh || exit 9; "$PYTHON" -c "import torch, torchft; print(torch.__file__)"'
              f' && "$PYTHON" -m pytest -q -p no:cacheprovider {ROOT}/tests/test_fault_tolerance.py -k keeps_quiet')
    proc = subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"tessera: reusing torch {torch.__version__} from {tmp_path / 'user-site'}" in proc.stderr
    assert proc.stdout.splitlines()[0] == str(tmp_path / "user-site/torch/__init__.py")
    assert "1 passed" in proc.stdout
    installed = {p.name.lower() for p in Path(venv).glob("lib/python*/site-packages/*")}
    assert any(name.startswith("torchft") for name in installed), installed  # installed by env.sh
    assert not any(name == "torch" or name.startswith("torch-") for name in installed), installed  # not twice


@pytest.mark.fast
def test_env_sh_tells_a_torch_inside_the_venv_from_one_outside(tmp_path):
    """The reuse test is a `case` pattern: `[ "$site" != "$TESSERA_VENV"/* ]` expanded the glob ('too many
    arguments') and never reused anything."""
    text = (ROOT / "scripts/env.sh").read_text()
    assert '!= "$TESSERA_VENV"/*' not in text
    for site, reuse in [(f"{tmp_path}/venv/lib/python3.11/site-packages", ""), ("/opt/conda/lib/site-packages", "1"),
                        ("", "")]:
        (tmp_path / "venv/a").mkdir(parents=True, exist_ok=True)  # files the glob would have expanded to
        line = next(x for x in text.splitlines() if x.strip().startswith('case "$_torch_site"'))
        out = subprocess.run(["bash", "-c", f'TESSERA_VENV={tmp_path}/venv; _torch_site="{site}"; {line}; '
                              'echo "[$_reuse]"'], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == f"[{reuse}]" and out.stderr == "", (site, out)
