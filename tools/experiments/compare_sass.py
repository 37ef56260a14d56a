"""Compares the machine code (SASS) of every kernel in two sets of CUDA objects, kernel by kernel:
the check that a change which must not alter the kernels (a move of files, a rename) did not.

    KEEP_OBJ=/tmp/before bash tools/ci/compile_cuda.sh     # in the old checkout
    KEEP_OBJ=/tmp/after bash tools/ci/compile_cuda.sh      # in the new one
    python tools/experiments/compare_sass.py /tmp/before /tmp/after

Kernels are matched by their demangled name without the parameter list (a kernel whose parameter is
now spelled `typename Pass::Args` rather than `FusedLinearArgs<T>` is the same kernel), per
architecture. Instructions are compared as text without addresses and encodings; branch targets are
relative, so moving code elsewhere in a file changes nothing; a device assertion's line number is a
constant of its call, so moving one to another line shows as one differing instruction. Needs
cuobjdump (with nvdisasm) and c++filt.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

FUNCTION = re.compile(r"^\s*Function : (\S+)")
ARCH = re.compile(r"^\s*arch = (sm_\w+)")
INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;?\s*/\*")


def demangled_key(mangled: str) -> str:
    name = subprocess.run(["c++filt", mangled], capture_output=True, text=True, check=True).stdout.strip()
    # Drop the parameter list: everything from the '(' that closes the name (outside template brackets).
    depth = 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and not name.startswith("(anonymous", i):
            return name[:i]
    return name


def kernels(folder: Path) -> dict[tuple[str, str], list[str]]:
    """{(arch, kernel): instructions} of every object in folder."""
    found: dict[tuple[str, str], list[str]] = {}
    for obj in sorted(folder.glob("*.o")):
        text = subprocess.run(["cuobjdump", "-sass", str(obj)], capture_output=True, text=True).stdout
        arch, key, body = "?", None, None
        for line in text.splitlines():
            if m := ARCH.match(line):
                arch = m.group(1)
            elif m := FUNCTION.match(line):
                key, body = (arch, demangled_key(m.group(1))), []
                found[key] = body
            elif body is not None and (m := INSTRUCTION.match(line)):
                body.append(m.group(1))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args()
    before, after = kernels(args.before), kernels(args.after)
    same, differ = defaultdict(int), []
    for key in sorted(set(before) & set(after)):
        if before[key] == after[key]:
            same[key[0]] += 1
        else:
            differ.append(key)
    for arch, count in sorted(same.items()):
        print(f"{arch}: {count} kernels with identical SASS")
    for arch, name in differ:
        old, new = before[(arch, name)], after[(arch, name)]
        print(f"DIFFERENT {arch} {name} ({len(old)} -> {len(new)} instructions)")
        if len(old) == len(new):  # show where (an assertion's line number is a constant of its call)
            for i, (a, b) in [(i, pair) for i, pair in enumerate(zip(old, new)) if pair[0] != pair[1]][:3]:
                print(f"    at {i}: {a}  ->  {b}")
    for arch, name in sorted(set(before) - set(after)):
        print(f"ONLY BEFORE {arch} {name}")
    for arch, name in sorted(set(after) - set(before)):
        print(f"ONLY AFTER {arch} {name}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
