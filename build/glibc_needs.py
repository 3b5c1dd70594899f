"""The highest glibc symbol version a one-file executable needs: its bootloader and every bundled library.

    python build/glibc_needs.py dist/aarch64/kestrel-appliance      (a Python with PyInstaller installed)

Unpacks the bundled shared libraries (PyInstaller's CArchive) into a temporary directory and reads the
versioned dynamic symbols each one imports (objdump -T; aarch64-linux-gnu-objdump for aarch64 files).
Prints one line per file that needs the maximum, then `glibc minimum: X.Y`.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

from PyInstaller.archive.readers import CArchiveReader

OBJDUMP = {62: "objdump", 183: "aarch64-linux-gnu-objdump"}


def glibc_versions(path: str) -> set[tuple[int, ...]]:
    with open(path, "rb") as f:
        head = f.read(20)
    if head[:4] != b"\x7fELF":
        return set()
    tool = OBJDUMP[int.from_bytes(head[18:20], "little")]
    tool = shutil.which(tool) or shutil.which("llvm-objdump") or tool
    out = subprocess.run([tool, "-T", path], capture_output=True, text=True, check=True).stdout
    needed = set()
    for line in out.splitlines():
        m = re.search(r"\bGLIBC_(\d+(?:\.\d+)+)\b", line)
        if m and "*UND*" in line:  # imported from glibc (defined symbols are the library's own)
            needed.add(tuple(int(x) for x in m.group(1).split(".")))
    return needed


def main(argv: list[str]) -> int:
    exe = argv[0]
    per_file = {os.path.basename(exe) + " (bootloader)": glibc_versions(exe)}
    reader = CArchiveReader(exe)
    with tempfile.TemporaryDirectory() as tmp:
        for name, entry in reader.toc.items():
            if entry[-1] not in ("b", "x") or not re.search(r"\.so(\.|$)", name):
                continue
            data = reader.extract(name)
            path = os.path.join(tmp, name.replace("/", "__"))
            with open(path, "wb") as f:
                f.write(data)
            per_file[name] = glibc_versions(path)
    top = max(v for vs in per_file.values() for v in vs)
    for name, vs in sorted(per_file.items()):
        if vs and max(vs) == top:
            print(f"{name}: GLIBC_{'.'.join(map(str, max(vs)))}")
    print(f"glibc minimum: {'.'.join(map(str, top))} ({len(per_file)} files checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
