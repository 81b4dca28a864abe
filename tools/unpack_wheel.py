"""Unpack the Python sources and the dist-info of a wheel (no native libraries): what
``check --vllm-root`` reads.   python tools/unpack_wheel.py WHEEL DEST"""

import sys
import zipfile

wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as zf:
    names = [n for n in zf.namelist() if n.endswith(".py") or ".dist-info/" in n]
    zf.extractall(dest, names)
print(f"{len(names)} files of {wheel} -> {dest}")
