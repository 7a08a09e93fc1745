#!/usr/bin/env bash
# SGLang's own environment on a CPU machine (make sglang-env; docs/generators.md, "SGLang on CPU"):
#   deploy/sglang-cpu/build_env.sh VENV
# SGLang 0.5.23 pins torch 2.14.1 and always imports torchvision, so it cannot share Relay's venv (torch 2.13).
# sglang is installed with --no-deps, plus its requirements from its own metadata less the CUDA-only ones
# (deploy/sglang-cpu/exclude.txt): PyPI's sgl-kernel/sglang-kernel wheels are CUDA builds. The CPU kernel
# functions SGLang's CPU engine imports come from tests/support/sgl_kernel_standin (a stand-in in plain torch,
# not SGLang's kernel), copied into the venv as the package `sgl_kernel`.
set -euo pipefail
VENV=${1:?usage: build_env.sh VENV}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
SGLANG_VERSION=0.5.23
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" torch==2.14.1 torchvision==0.29.1
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
"$VENV/bin/python" -m pip download -q --no-deps "sglang==$SGLANG_VERSION" -d "$WHEELS"
# its install requirements (no extras), less the excluded ones
"$VENV/bin/python" - "$WHEELS" "$HERE/exclude.txt" > "$WHEELS/requirements.txt" <<'PY'
import re, sys, zipfile, pathlib
wheel = next(pathlib.Path(sys.argv[1]).glob("sglang-*.whl"))
exclude = {l.split("#")[0].strip().lower() for l in open(sys.argv[2]) if l.split("#")[0].strip()}
meta = zipfile.ZipFile(wheel).read(next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA")))
for line in meta.decode().splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    name = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if name not in exclude:
        print(req)
PY
"${PIP[@]}" -r "$WHEELS/requirements.txt" -r "$HERE/extra.txt" torch==2.14.1 torchvision==0.29.1
"${PIP[@]}" --no-deps "$WHEELS"/sglang-*.whl
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf "$SITE/sgl_kernel"
cp -r "$ROOT/tests/support/sgl_kernel_standin/sgl_kernel" "$SITE/sgl_kernel"
# the server must start from this venv alone: SGLang imports, and the stand-in is what it finds
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c "import sglang, sgl_kernel, torch; print('sglang', sglang.__version__, 'torch', torch.__version__, 'sgl_kernel', sgl_kernel.__file__)"
