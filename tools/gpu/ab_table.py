"""One table of the W4A16, gemm, MoE, MLA and small-op times of every build and round of `run.sh ab`.

usage: python3 ab_table.py OUT   (OUT holds <build>-<round>/bench.txt; prints columns in name order)
"""
import glob
import os
import re
import sys

gemm, moe, names = {}, {}, []
for path in sorted(glob.glob(os.path.join(sys.argv[1], '*', 'bench.txt'))):
    name = os.path.basename(os.path.dirname(path))
    names.append(name)
    small = False  # inside the small-ops table: op | shape | us | over the floor
    for line in open(path):
        if line.startswith('small ops of'):
            small = True
        elif small and line.startswith('|'):
            cells = [c.strip() for c in line.strip().strip('|').split('|')]
            if re.fullmatch(r'[0-9.]+', cells[2]):
                gemm.setdefault(f"{cells[0]} {cells[1]}"[:60], {})[name] = cells[2]
        elif line.startswith('|'):
            cells = [c.strip() for c in line.strip().strip('|').split('|')]
            if len(cells) > 2 and cells[1].isdigit() and 'x' in cells[0]:
                gemm.setdefault(f"{cells[0]} M={cells[1]}", {})[name] = cells[2]
            elif len(cells) > 3 and cells[2].isdigit() and 'x' in cells[0]:  # gemm: N x K | layer | M | us
                gemm.setdefault(f"{cells[0]} {cells[1]} M={cells[2]}"[:60], {})[name] = cells[3]
            elif len(cells) > 4 and cells[1].isdigit() and cells[0] in ('decode', 'tree verify', 'prefill'):
                gemm.setdefault(f"MLA {cells[0]} T={cells[1]} {cells[3]}", {})[name] = cells[4]
        elif line.startswith('MoE'):
            us = re.search(r': ([0-9.]+) us', line)
            if us:
                moe.setdefault(line.split(':')[0][:40], {})[name] = us.group(1)
width = max([len(k) for k in list(gemm) + list(moe)] + [10])
print(' ' * width + ''.join(f"{n:>10}" for n in names))
for key, by_name in list(gemm.items()) + list(moe.items()):
    print(f"{key:<{width}}" + ''.join(f"{by_name.get(n, '-'):>10}" for n in names))
