"""Print the project's runtime dependencies (pyproject.toml [project] dependencies), one per line, for pip."""
import os
import sys
import tomllib

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pyproject.toml"), "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
sys.stdout.write("".join(d + "\n" for d in deps))
