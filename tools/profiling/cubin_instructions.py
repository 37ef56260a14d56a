"""SASS instructions per kernel of a cubin, without a disassembler: every Hopper / Ampere instruction is 16
bytes, so a kernel's `.text.<name>` section size / 16 is its static instruction count (cuobjdump agrees). Compile
with `nvcc --keep --keep-dir DIR` (tools/ci/compile_cuda.sh takes NVCC_EXTRA), then

    python3 tools/profiling/cubin_instructions.py DIR/logits_cuda.cubin [OTHER.cubin] --match mixture_pass

One cubin: each kernel's count. Two (before, after): the kernels whose counts differ. Names are demangled
(c++filt) and shortened to the kernel and its template arguments, so that two builds' kernels pair up.
"""

import argparse
import re
import subprocess


def kernels(path):
    out = subprocess.run(["readelf", "-SW", path], capture_output=True, text=True, check=True).stdout
    sizes = {}
    for line in out.splitlines():
        m = re.search(r"\]\s+\.text\.(\S+)\s+\S+\s+\S+\s+\S+\s+([0-9a-f]+)", line)
        if m:
            sizes[m.group(1)] = int(m.group(2), 16) // 16
    names = list(sizes)
    demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    def short(d):  # the kernel and its template arguments, without namespaces or parameters
        d = d.replace("(anonymous namespace)::", "").replace("nitrobrew::", "").replace("cuda::", "")
        return re.sub(r"^void |\(.*", "", d.replace("(Divergence)", ""))
    return {short(d): sizes[n] for n, d in zip(names, demangled)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cubins", nargs="+")
    parser.add_argument("--match", default="", help="only kernels whose name matches this regular expression")
    args = parser.parse_args()
    counts = [kernels(c) for c in args.cubins[:2]]
    for name in sorted(set().union(*counts)):
        if not re.search(args.match, name):
            continue
        row = [c.get(name) for c in counts]
        if len(row) == 1 or row[0] != row[1]:
            print(" -> ".join(f"{x if x is not None else '-':>6}" for x in row), name)


if __name__ == "__main__":
    main()
