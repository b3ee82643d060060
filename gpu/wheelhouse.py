"""Prepare the wheelhouse for the GPU machine, which has no package index: what it lacks, as wheels, <= 60 MiB.

    python gpu/wheelhouse.py                       # -> gpu/wheelhouse/*.whl + manifest.json (Python 3.12, x86-64)
    python gpu/wheelhouse.py --python-version 3.11 --dest /tmp/wh   # for a CPU rehearsal on this machine's Python

The requirements of the project (pyproject.toml's dependencies) are walked through the wheels' own metadata
(Requires-Dist, markers evaluated for the target Python on Linux x86-64). Each requirement is:
- met by the device (`gpu/device-packages.txt`): a recorded version that satisfies it, or a package present with no
  recorded version (trusted, and listed in the manifest; `gpu/run.py` checks the whole closure there), unless `--carry`
  names it;
- else carried: `pip download --no-deps --only-binary=:all:` for the target platform, at the version installed in the
  environment running this script when that one satisfies it (the versions the project is tested with), else the
  newest that does; its own requirements are walked in turn.
The project itself is added as a wheel built from a copy of its sources (the working tree is not written to). Every
earlier wheel in the destination is removed first: two versions of one package stop an offline install.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from email.parser import Parser

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PLATFORMS = ("manylinux_2_39_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64")
# Present on the device with no recorded version, but carried anyway: the project needs peft >= 0.21, datasets
# pins fsspec <= 2026.9.0 and transformers needs regex >= 2025.10.22; all three are small.
DEFAULT_CARRY = ("peft", "fsspec", "regex")


def read_device(path: str) -> dict[str, Version | None]:
    """{canonical name: recorded version or None} from lines `name==version` or `name` (# comments)."""
    out = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, _, ver = line.partition("==")
                out[canonicalize_name(name)] = Version(ver) if ver else None
    return out


def marker_env(python_version: str) -> dict:
    env = default_environment()
    env.update(python_version=python_version, python_full_version=f"{python_version}.0", sys_platform="linux",
               platform_system="Linux", platform_machine="x86_64", os_name="posix", implementation_name="cpython",
               platform_python_implementation="CPython")
    return env


def applies(req: Requirement, env: dict, extras: set[str]) -> bool:
    """Whether `req` (a Requires-Dist line) is needed on the target for the requested `extras` of its parent."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in ({""} | extras))


def wheel_metadata(path: str) -> tuple[str, str, list[Requirement]]:
    """(canonical name, version, Requires-Dist) of a wheel file."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = Parser().parsestr(z.read(meta).decode())
    return canonicalize_name(msg["Name"]), msg["Version"], [Requirement(r) for r in msg.get_all("Requires-Dist") or []]


def pip_download(spec: str, dest: str, python_version: str) -> str:
    """Download one wheel for `spec` (no dependencies) for the target into `dest`; its path."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               python_version, "--implementation", "cp", "-d", tmp, spec]
        for plat in PLATFORMS:
            cmd += ["--platform", plat]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pip download {spec} failed:\n{proc.stderr[-2000:]}")
        (name,) = os.listdir(tmp)
        shutil.move(os.path.join(tmp, name), os.path.join(dest, name))
    return os.path.join(dest, name)


def local_version(name: str) -> Version | None:
    try:
        return Version(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        return None


def resolve(roots: list[Requirement], device: dict, carry: set[str], python_version: str, fetch, prefer=local_version):
    """Walk the requirements. fetch(spec) -> wheel path; prefer(name) -> a preferred version or None.

    Returns (carried {name: {"file", "version", "required_by": [...]}}, met {name: {"device_version", "required":
    [...]}}); raises ValueError when a carried package's version misses a later requirement (a conflict to settle by
    hand)."""
    env = marker_env(python_version)
    carried, met = {}, {}
    queue = [(r, "trl-isopo") for r in roots]
    while queue:
        req, parent = queue.pop(0)
        name = canonicalize_name(req.name)
        need = f"{req.name}{req.specifier}" + (f"[{','.join(sorted(req.extras))}]" if req.extras else "")
        if name in carried:
            got = carried[name]
            if not req.specifier.contains(got["version"], prereleases=True):
                raise ValueError(f"{parent} needs {need}, but {name} {got['version']} is carried")
            got["required_by"].append(f"{parent}: {need}")
            new = set(req.extras) - got["extras"]
            if new:  # requirements behind newly requested extras
                got["extras"] |= new
                queue += [(r, name) for r in got["requires"] if r.marker and applies(r, env, new)
                          and not applies(r, env, set())]
            continue
        dev = device.get(name, "absent")
        if dev != "absent" and name not in carry and (dev is None or req.specifier.contains(dev, prereleases=True)):
            entry = met.setdefault(name, {"device_version": None if dev is None else str(dev), "required": []})
            entry["required"].append(f"{parent}: {need}")
            continue
        pref = prefer(name)
        spec = f"{req.name}=={pref}" if pref is not None and req.specifier.contains(pref, prereleases=True) else \
            f"{req.name}{req.specifier}"
        path = fetch(spec)
        wname, version, requires = wheel_metadata(path)
        carried[name] = {"file": os.path.basename(path), "version": Version(version), "requires": requires,
                         "extras": set(req.extras), "required_by": [f"{parent}: {need}"],
                         "why": "absent on the device" if dev == "absent" else "carried by choice" if name in carry
                         else f"device has {dev}"}
        queue += [(r, name) for r in requires if applies(r, env, set(req.extras))]
    return carried, met


def build_project_wheel(dest: str) -> str:
    """The project as a wheel, built from a copy of pyproject.toml, README.md and trl_isopo/ (no egg-info or build/
    written into the working tree)."""
    with tempfile.TemporaryDirectory() as tmp:
        for f in ("pyproject.toml", "README.md"):
            shutil.copy(os.path.join(ROOT, f), tmp)
        shutil.copytree(os.path.join(ROOT, "trl_isopo"), os.path.join(tmp, "trl_isopo"),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dest, tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building the project wheel failed:\n{proc.stderr[-2000:]}")
    return max(glob.glob(os.path.join(dest, "trl_isopo-*.whl")), key=os.path.getmtime)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dest", default=os.path.join(HERE, "wheelhouse"))
    p.add_argument("--python-version", default="3.12", help="the device's Python (3.12.3)")
    p.add_argument("--device", default=os.path.join(HERE, "device-packages.txt"))
    p.add_argument("--carry", default=",".join(DEFAULT_CARRY), help="device packages to carry anyway (comma list)")
    p.add_argument("--max-mib", type=float, default=60.0)
    p.add_argument("--no-prefer-local", action="store_true", help="newest versions, not this environment's")
    args = p.parse_args(argv)
    os.makedirs(args.dest, exist_ok=True)
    for old in glob.glob(os.path.join(args.dest, "*.whl")):
        os.remove(old)
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        roots = [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"]]
    carry = {canonicalize_name(n) for n in args.carry.split(",") if n}
    prefer = (lambda name: None) if args.no_prefer_local else local_version
    carried, met = resolve(roots, read_device(args.device), carry, args.python_version,
                           lambda spec: pip_download(spec, args.dest, args.python_version), prefer)
    project = build_project_wheel(args.dest)
    wheels = [{"file": c["file"], "name": n, "version": str(c["version"]), "why": c["why"],
               "required_by": c["required_by"]} for n, c in sorted(carried.items())]
    wheels.append({"file": os.path.basename(project), "name": "trl-isopo", "version": wheel_metadata(project)[1],
                   "why": "the project", "required_by": []})
    for w in wheels:
        path = os.path.join(args.dest, w["file"])
        w.update(bytes=os.path.getsize(path), sha256=sha256(path))
    total = sum(w["bytes"] for w in wheels)
    manifest = {"created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                "python_version": args.python_version, "platforms": list(PLATFORMS),
                "device_packages": os.path.relpath(args.device, ROOT),
                "carry_anyway": sorted(carry), "total_bytes": total, "total_mib": round(total / 2**20, 2),
                "limit_mib": args.max_mib, "wheels": wheels,
                "met_by_device": {n: m for n, m in sorted(met.items())},
                "trusted_unrecorded": sorted(n for n, m in met.items() if m["device_version"] is None)}
    with open(os.path.join(args.dest, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    for w in wheels:
        print(f"{w['bytes'] / 2**20:7.2f} MiB  {w['file']}  ({w['why']})")
    print(f"{total / 2**20:.2f} MiB in {len(wheels)} wheels -> {args.dest} (limit {args.max_mib} MiB); device "
          f"versions trusted unrecorded: {', '.join(manifest['trusted_unrecorded']) or 'none'}")
    if total > args.max_mib * 2**20:
        print(f"too large: {total / 2**20:.2f} MiB > {args.max_mib} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
