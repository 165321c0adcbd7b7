"""Child processes of the checkout (torchrun workers of the tools and tests) get the checkout first on their path
and keep the caller's own PYTHONPATH: packages installed with ``pip --target`` (as on a lent GPU machine, where
megatron-core and fla come that way) must reach them. A child given the checkout alone could not import them:
tools/memory.py --measure timed out so on the first H200 run."""
from __future__ import annotations

import os
import subprocess
import sys

from k3train.runtime.process_groups import child_pythonpath


def test_the_checkout_comes_first_and_the_callers_path_is_kept(monkeypatch, tmp_path):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert child_pythonpath(tmp_path) == str(tmp_path)
    monkeypatch.setenv("PYTHONPATH", f"/opt/site{os.pathsep}/opt/more")
    assert child_pythonpath(tmp_path).split(os.pathsep) == [str(tmp_path), "/opt/site", "/opt/more"]


def test_a_child_imports_a_package_from_the_callers_path(monkeypatch, tmp_path):
    site = tmp_path / "site"
    (site / "only_on_callers_path").mkdir(parents=True)
    (site / "only_on_callers_path" / "__init__.py").write_text("VALUE = 42\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    env = dict(os.environ, PYTHONPATH=child_pythonpath(tmp_path / "checkout"))
    p = subprocess.run([sys.executable, "-c", "import only_on_callers_path as m; print(m.VALUE)"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "42", p.stderr
