"""The `operator/` folder is `kvyard.operator`, never the standard library's name:
a Python started in the checkout (`python -m pip` in a fresh venv, as CI's first
step does) must still get the real `operator` module."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_checkout_first_on_sys_path_still_gets_the_stdlib_operator() -> None:
    # -S: no site, so nothing imported `operator` before the checkout is on the path
    code = ("import sys; sys.path.insert(0, %r); import collections, operator; "
            "assert operator.eq(1, 1) and operator.attrgetter; print(operator.__name__)" % str(ROOT))
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "operator"


def test_kvyard_operator_is_the_folder() -> None:
    import kvyard.operator
    assert Path(kvyard.operator.__file__).parent == ROOT / "operator"
