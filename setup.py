"""Maps the top-level folders into the `trims` namespace (see README.md, Development).

pyproject.toml holds all metadata; this file only enumerates the sub-packages of each mapped
folder, because setuptools' declarative `packages.find` cannot rename a folder into a namespace.
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOTS = {
    "trims": "trims",
    "trims.daemon": "daemon",
    "trims.runtime": "runtime",
    "trims.operators": "operators",
    "trims.kernels": "kernels",
    "trims.evaluation": "evaluation",
}

packages: list[str] = []
package_dir: dict[str, str] = {}
for name, folder in ROOTS.items():
    if not (Path(folder) / "__init__.py").exists():
        continue
    packages.append(name)
    package_dir[name] = folder
    for sub in find_packages(where=folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={
        pkg: ["*.json", "*.yaml", "*.sql", "*.cu", "*.txt", "py.typed"] for pkg in packages
    }
    # the web UI's templates and stylesheet (folders without __init__.py: data, not packages)
    | {"trims.evaluation.ui": ["templates/*.html", "static/*.css"]},
)
