"""Package discovery for setuptools: every package under masenvs/, adapters/ and trainer/ is found,
never listed by hand (tests/test_wheel.py builds the wheel and checks it holds every file).

adapters/ and trainer/ install as masenvs.adapters and masenvs.trainer, never as top-level
packages (both names are taken on PyPI). The one top-level module besides masenvs is
masenvs_verifiers.py: verifiers finds an environment id (`masenvs-verifiers`) as a module of
that name. Everything else about the project is in pyproject.toml.
"""

from setuptools import find_packages, setup

# import root -> folder, as pyproject's package-dir (which setuptools applies); the remap is why
# this file exists: pyproject's packages.find cannot prefix "masenvs." to what it finds there.
PACKAGE_DIR = {"masenvs": "masenvs", "masenvs.adapters": "adapters", "masenvs.trainer": "trainer"}


def discover() -> list[str]:
    """Every package (a folder with __init__.py) under each root, named by its import path."""
    packages = []
    for root, folder in PACKAGE_DIR.items():
        packages.append(root)
        packages += [f"{root}.{name}" for name in find_packages(where=folder)]
    # masenvs/ itself holds no adapters/ or trainer/ folder, so no name is found twice
    return sorted(set(packages))


setup(packages=discover(), py_modules=["masenvs_verifiers"])
