"""Maps the repository's top-level folders onto one import namespace, `kvyard`.

`epp/` is `kvyard.epp`, `workers/` is `kvyard.workers`, and so on. The list of
packages is computed so a new subpackage needs no edit. `operator/` is mapped
as `kvyard.operator` once it holds code; it never becomes a top-level package
(that would shadow the standard library's `operator`).
"""
from pathlib import Path

from setuptools import find_packages, setup

ROOTS = {
    "kvyard": "kvyard",
    "kvyard.epp": "epp",
    "kvyard.workers": "workers",
    "kvyard.kvstore": "kvstore",
}
if (Path(__file__).parent / "operator" / "__init__.py").exists():
    ROOTS["kvyard.operator"] = "operator"

packages = []
for name, folder in ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(
    packages=packages,
    package_dir=ROOTS,
    # *.c, *.h: kernels compiled on the host at first use (workers/cpu_ops);
    # data/*.jsonl: the bench's shipped traces (kvyard/bench/data)
    package_data={"": ["*.yaml", "*.json", "*.jinja", "*.proto", "*.c", "*.h",
                       "data/*.jsonl", "data/*.txt", "data/spec/*.jsonl"]},
)
