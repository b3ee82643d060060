#!/usr/bin/env bash
# CPU rehearsal of the GPU run, end to end: a fresh venv stands in for the device's image (torch, an older
# transformers, and the packages the wheelhouse leaves to the device, at their recorded versions), a wheelhouse is
# built for this machine's Python, installed offline by gpu/run.py, and the check runs in its --smoke form.
#
#   bash gpu/rehearse_cpu.sh [SIM_VENV]      # default /tmp/trl-isopo-devsim; needs PyPI for the stand-in image only
#   DEVICE_TORCH=2.11.0 bash gpu/rehearse_cpu.sh /tmp/devsim-211   # the device's torch (PyPI's CUDA build, ~3.5 GB;
#                                                                  # it runs on the CPU too)
#
# Run it from the project's environment (`python3` with packaging and pip; the wheelhouse prefers its versions).
# Stand-in differences from the device: this machine's Python (3.11 here, 3.12 there) and torch build (the local CPU
# wheel, torch 2.13.0; the device has 2.11.0+cu130, whose PyPI wheel is a multi-GB CUDA build).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SIM=${1:-/tmp/trl-isopo-devsim}
WH=${WH:-/tmp/trl-isopo-wheelhouse-cpu}
OUT_DIR=${OUT_DIR:-/tmp/trl-isopo-rehearsal}
PY=${PYTHON:-python3}
PYVER=$($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')

echo "== wheelhouse for Python $PYVER -> $WH"
$PY "$ROOT/gpu/wheelhouse.py" --python-version "$PYVER" --dest "$WH"

echo "== stand-in device image: $SIM"
rm -rf "$SIM"
$PY -m venv "$SIM"
# The device's packages the wheelhouse relies on (manifest: met_by_device), pinned where the device's version is
# recorded, except torch (the local CPU wheel) and numpy (2.5.2 has no wheel for Python 3.11); plus transformers
# 5.17.0 (the device's, older than the project needs: the wheelhouse must shadow it).
mapfile -t IMAGE < <($PY - "$WH/manifest.json" <<'EOF'
import json, os, sys
m = json.load(open(sys.argv[1]))
for name, met in m["met_by_device"].items():
    torch_pin = "==" + os.environ.get("DEVICE_TORCH", "2.13.0")
    pin = {"torch": torch_pin, "numpy": ""}.get(name, f"=={met['device_version']}" if met["device_version"] else "")
    print(name + pin)
EOF
)
"$SIM/bin/python" -m pip install -q "${IMAGE[@]}" transformers==5.17.0 pytest
"$SIM/bin/python" -m pip list --format=freeze > "$SIM/image-freeze.txt"
echo "stand-in image: $(wc -l < "$SIM/image-freeze.txt") packages ($SIM/image-freeze.txt)"

echo "== gpu/run.py --smoke (offline install of the wheelhouse, then the check)"
cd "$ROOT"
rm -rf "$OUT_DIR"
"$SIM/bin/python" gpu/run.py --smoke --wheelhouse "$WH" --site /tmp/trl-isopo-site-cpu --out "$OUT_DIR"
